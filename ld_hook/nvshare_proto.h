/*
 * nvshare wire protocol, version 2: the one definition of the frames exchanged between
 * libnvshare.so (and nvsharectl) and the node scheduler over a Unix stream socket.
 * appliance/wire/protocol.py mirrors this file; tests/protocol/ compiles a probe that prints every
 * size and offset here and compares them with the Python side.
 *
 * Every frame is a fixed 24-byte header followed by `body_len` bytes of body. All integers are
 * little-endian and of explicit width; every struct below is laid out without implicit padding
 * (checked by the static asserts at the end). Fixed-size strings are NUL-padded UTF-8.
 * Types marked JSON carry a UTF-8 JSON document as their body and are used only between the
 * Python CLI and the daemon.
 */
#ifndef NVSHARE_PROTO_H
#define NVSHARE_PROTO_H

#include <stdint.h>

#define NVS_MAGIC 0x4853564Eu /* "NVSH" read as little-endian bytes */
#define NVS_PROTO_VERSION 4u /* 4: a borrower's queue bound; 3: idle windows in microseconds; 2: pod names of 253 characters */
#define NVS_MAX_BODY (1u << 20) /* frames larger than this are rejected */

#define NVS_UUID_LEN 48
#define NVS_NAME_LEN 64      /* a namespace: a DNS-1123 label, at most 63 */
#define NVS_POD_NAME_LEN 256 /* a pod name: a DNS-1123 subdomain, at most 253 */
#define NVS_MESSAGE_LEN 248
#define NVS_GANG_LEN 128

/* Message types. Numbers are never reused. */
enum {
    NVS_MSG_REGISTER = 1,      /* hook -> daemon: struct nvs_register */
    NVS_MSG_REGISTERED = 2,    /* daemon -> hook: struct nvs_registered */
    NVS_MSG_LOCK_REQUEST = 3,  /* hook -> daemon: empty */
    NVS_MSG_LOCK_GRANT = 4,    /* daemon -> hook: struct nvs_lock_grant */
    NVS_MSG_LOCK_DROP = 5,     /* daemon -> hook: empty; release as soon as work is synchronised */
    NVS_MSG_LOCK_RELEASED = 6, /* hook -> daemon: struct nvs_lock_released */
    NVS_MSG_SET_TQ = 7,        /* ctl -> daemon: struct nvs_set_tq; reply OK or ERROR */
    NVS_MSG_SET_MODE = 8,      /* ctl -> daemon: struct nvs_set_mode; reply OK or ERROR */
    NVS_MSG_STATUS_REQUEST = 9,/* ctl -> daemon: empty; reply STATUS_REPLY */
    NVS_MSG_STATUS_REPLY = 10, /* daemon -> ctl: JSON */
    NVS_MSG_ERROR = 11,        /* either way: struct nvs_result, status != 0 */
    NVS_MSG_OK = 12,           /* daemon -> ctl: struct nvs_result, status == 0 */
    /* memory (chunked reservations against a pod- or process-wide ledger) */
    NVS_MSG_MEM_RESERVE = 20,  /* hook -> daemon: struct nvs_mem_reserve; reply MEM_GRANT */
    NVS_MSG_MEM_GRANT = 21,    /* daemon -> hook: struct nvs_mem_grant */
    NVS_MSG_MEM_RETURN = 22,   /* hook -> daemon: struct nvs_mem_return; no reply (also a usage report) */
    NVS_MSG_LIMIT_UPDATE = 23, /* daemon -> hook: struct nvs_limits, unsolicited (seq 0) */
    NVS_MSG_LIMIT_SET = 24,    /* ctl -> daemon: struct nvs_limit_set; reply OK or ERROR */
    NVS_MSG_MEM_RECLAIM = 25,  /* daemon -> hook: empty, unsolicited (seq 0); a peer on the ledger
                                * was refused for want of room: give back every byte reserved
                                * and not in use now, answered by a MEM_RETURN (of 0 bytes when
                                * there is nothing to give back) */
    /* generic JSON query for the CLI (policy show/explain, ...) */
    NVS_MSG_QUERY = 30,        /* ctl -> daemon: JSON {"query": name, ...} */
    NVS_MSG_QUERY_REPLY = 31,  /* daemon -> ctl: JSON */
    /* a JSON document larger than NVS_MAX_BODY: its first bytes in JSON_PART frames, the rest in
     * a last frame of the document's own type, all with the request's seq */
    NVS_MSG_JSON_PART = 40,    /* daemon -> ctl: raw bytes of a JSON document, continued */
    /* liveness and what the GPU really holds */
    NVS_MSG_HEARTBEAT = 50,     /* hook -> daemon: empty; reply HEARTBEAT_ACK with the same seq */
    NVS_MSG_HEARTBEAT_ACK = 51, /* daemon -> hook: empty */
    NVS_MSG_MEM_OBSERVED = 52,  /* daemon -> hook: struct nvs_mem_observed, unsolicited (seq 0) */
    NVS_MSG_LEDGER_PEERS = 53,  /* daemon -> hook: struct nvs_ledger_peers, unsolicited (seq 0) */
    /* the GPU as a process is shown it (NVML, cuMemGetInfo), also before or without REGISTER */
    NVS_MSG_VIEW_REQUEST = 54,  /* hook -> daemon: struct nvs_view_request; reply VIEW */
    NVS_MSG_VIEW = 55,          /* daemon -> hook: struct nvs_view */
    /* what the hook decided on its own, for the daemon's counts */
    NVS_MSG_MEM_REFUSALS = 60,  /* hook -> daemon: struct nvs_mem_refusals; no reply */
    /* gangs: the clients of one job hold their GPUs' locks together (appliance/core/gang.py) */
    NVS_MSG_GANG_HINT = 70,     /* hook -> daemon: struct nvs_gang_hint, right after REGISTER */
    NVS_MSG_GANG_DROP = 71,     /* daemon -> hook: struct nvs_gang_cut; begin no collective past
                                 * the count now, answer GANG_POSITION */
    NVS_MSG_GANG_POSITION = 72, /* hook -> daemon: struct nvs_gang_cut: collectives begun */
    NVS_MSG_GANG_CUT = 73,      /* daemon -> hook: struct nvs_gang_cut: submit collectives up to
                                 * this count, then release as on LOCK_DROP */
    NVS_MSG_GANG_CATCHUP = 74,  /* hook -> daemon: empty; a lock request to reach the cut,
                                 * answered LOCK_GRANT */
    NVS_MSG_GANG_CUT_OVER = 75, /* daemon -> hook: struct nvs_gang_cut: the gang has released;
                                 * collectives are free again */
    /* what a process asks of the scheduler for itself */
    NVS_MSG_PRIORITY_HINT = 76, /* hook -> daemon: struct nvs_priority_hint, right after REGISTER;
                                 * taken only where it lowers the process's priority */
    /* the lock's terms while it is held */
    NVS_MSG_LOCK_TERMS = 80,    /* daemon -> hook: struct nvs_lock_grant, unsolicited (seq 0); new
                                 * terms for the grant held (a shorter idle window while others
                                 * wait); ignored unless the lock is held */
    NVS_MSG_LOCK_LENT = 81,     /* daemon -> hook: empty; this idle GPU is lent to lower priorities
                                 * only: submit at once and ask as you go (LOCK_REQUEST, granted
                                 * with the borrowers' drop); ignored unless idle */
    NVS_MSG_LOCK_UNLENT = 82,   /* daemon -> hook: empty; lent no more: ask and wait again */
};

/* Scheduling modes (nvs_limits.mode, nvs_set_mode.mode). */
enum { NVS_MODE_OFF = 0, NVS_MODE_ON = 1, NVS_MODE_AUTO = 2 };

/* Memory backing (nvs_limits.backing). */
enum { NVS_BACKING_DEVICE = 0, NVS_BACKING_MANAGED = 1 };

/* nvs_limits.flags */
#define NVS_LIMIT_SINGLE_OVERSUB 0x1u /* managed backing may exceed the physical GPU for one process */
#define NVS_LIMIT_KNOWN_FLAGS NVS_LIMIT_SINGLE_OVERSUB

/* nvs_lock_released.reason; UNDRAINED: a stream capture outlived the quantum, so the GPU's queued
 * work was handed over without being synchronised (a capture must not be broken) */
enum { NVS_RELEASE_DROPPED = 0, NVS_RELEASE_IDLE = 1, NVS_RELEASE_EXIT = 2, NVS_RELEASE_UNDRAINED = 3 };

/* nvs_result.status (0 = ok) */
enum {
    NVS_OK = 0,
    NVS_ERR_BAD_VERSION = 1,
    NVS_ERR_UNKNOWN_TYPE = 2,
    NVS_ERR_BAD_BODY = 3,
    NVS_ERR_PERMISSION = 4,
    NVS_ERR_INVALID = 5,
    NVS_ERR_NOT_FOUND = 6,
    NVS_ERR_NOT_REGISTERED = 7,
};

/* nvs_limit_set.flags */
#define NVS_LIMIT_SET_CLEAR_MEM 0x1u  /* remove the override: back to the policy value */
#define NVS_LIMIT_SET_CLEAR_CORE 0x2u
#define NVS_LIMIT_SET_HAS_MEM 0x4u
#define NVS_LIMIT_SET_HAS_CORE 0x8u

/* nvs_set_tq.flags, nvs_set_mode.flags */
#define NVS_SET_FOLLOW_POLICY 0x1u /* drop the value nvsharectl set: the policy's applies again */

struct nvs_header {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint32_t flags;    /* reserved, 0 */
    uint32_t body_len;
    uint64_t seq;      /* request sequence; replies echo it; unsolicited daemon frames use 0 */
};

struct nvs_register {
    uint32_t pid;             /* hint only; the daemon uses SO_PEERCRED */
    uint32_t env_core_limit;  /* NVSHARE_GPU_CORE_LIMIT from the process, 0 = none */
    uint64_t gpu_total_mem;   /* bytes, as the real driver reports */
    uint64_t env_mem_limit;   /* NVSHARE_GPU_MEMORY_LIMIT from the process, 0 = none */
    char gpu_uuid[NVS_UUID_LEN];      /* "GPU-xxxxxxxx-..." */
    char pod_namespace[NVS_NAME_LEN]; /* client hint (NVSHARE_POD_NAMESPACE), may be empty */
    char pod_name[NVS_POD_NAME_LEN];  /* client hint (NVSHARE_POD_NAME), may be empty */
};

struct nvs_limits {
    uint64_t mem_limit;   /* bytes; 0 = no limit (the whole GPU) */
    uint32_t core_limit;  /* 1-100 percent; 100 = no quota */
    uint32_t mode;        /* NVS_MODE_* of the client's GPU */
    uint32_t backing;     /* NVS_BACKING_* */
    uint32_t flags;       /* NVS_LIMIT_* */
};

struct nvs_registered {
    uint64_t client_id;
    struct nvs_limits limits;
};

struct nvs_lock_grant {
    uint64_t tq_ms;           /* the quantum this grant runs for, informational */
    uint64_t idle_release_us; /* the idle window (scheduler.idleRelease, idleHandoff); 0 = the
                               * hook's default */
    uint64_t queue_us;        /* how much work to keep queued at most (scheduler.borrowerQueue,
                               * pace.h): told to a holder on a GPU a higher priority lent it;
                               * 0 = no bound */
};

struct nvs_lock_released {
    uint32_t reason;     /* NVS_RELEASE_* */
    uint32_t reserved;
};

struct nvs_set_tq {
    uint32_t seconds;  /* 1-86400 */
    uint32_t flags;    /* NVS_SET_* */
};

struct nvs_set_mode {
    uint32_t mode;                /* NVS_MODE_* */
    uint32_t flags;               /* NVS_SET_* */
    char gpu_uuid[NVS_UUID_LEN];  /* empty = every GPU */
};

struct nvs_result {
    int32_t status;              /* NVS_OK or NVS_ERR_* */
    uint32_t ref_type;           /* the type of the frame this answers */
    char message[NVS_MESSAGE_LEN];
};

struct nvs_mem_reserve {
    uint64_t bytes;   /* additional reservation wanted */
    uint64_t used;    /* bytes allocated now (usage report) */
};

struct nvs_mem_grant {
    uint64_t granted;   /* bytes added to the reservation; 0 = refused */
    uint64_t reserved;  /* the client's whole reservation after this grant */
};

struct nvs_mem_return {
    uint64_t bytes;   /* reservation given back */
    uint64_t used;    /* bytes allocated now (usage report) */
};

struct nvs_limit_set {
    uint32_t pid;        /* 0 = select by pod */
    uint32_t flags;      /* NVS_LIMIT_SET_* */
    uint64_t mem_limit;  /* bytes, with HAS_MEM */
    uint32_t core_limit; /* 1-100, with HAS_CORE */
    uint32_t reserved;
    char pod_namespace[NVS_NAME_LEN];
    char pod_name[NVS_POD_NAME_LEN];
};

/* What NVML says the client's process holds on its GPU; the hook counts the part its own ledger
 * does not explain (module globals, heaps, stacks) beyond `allowance` (the CUDA context). */
struct nvs_mem_observed {
    uint64_t nvml_used; /* bytes, nvmlDeviceGetComputeRunningProcesses for the client's pid */
    uint64_t allowance; /* bytes of it the daemon leaves uncounted (context overhead) */
};

/* How many processes share this client's memory ledger (its pod's, on its GPU), itself
 * included: while the daemon is unreachable each keeps what it reserved and may grow to an equal
 * share of the limit. Sent when the count changes; a hook assumes 1 until told. */
struct nvs_ledger_peers {
    uint32_t clients;
    uint32_t reserved;
};

/* Allocations the hook refused itself, without asking the daemon (over the limit it knows),
 * since its last report: sent at most once per service tick while there are any. The daemon's
 * own refusals (a reservation it answered with 0) are not in it. */
struct nvs_mem_refusals {
    uint32_t count;
    uint32_t reserved;
    uint64_t largest; /* bytes: the largest request among them */
};

/* A process asks how its GPU looks to it: its limit there, what its pod (or, outside pods, the
 * process itself) holds, and which processes hold it. Needs no REGISTER: nvidia-smi and
 * monitoring agents never initialise CUDA. */
struct nvs_view_request {
    char gpu_uuid[NVS_UUID_LEN];
    uint64_t gpu_total_mem; /* bytes, as NVML reports them */
    char pod_namespace[NVS_NAME_LEN]; /* client hints, as in nvs_register */
    char pod_name[NVS_POD_NAME_LEN];
};

#define NVS_VIEW_MAX_PROCESSES 16
#define NVS_VIEW_SELF 0x1u /* nvs_view_process.flags: the process that asked */

struct nvs_view_process {
    uint32_t pid;   /* as the asking process sees it (its PID namespace) */
    uint32_t flags; /* NVS_VIEW_* */
    uint64_t used;  /* bytes, as the ledger counts them */
};

struct nvs_view {
    uint64_t mem_limit;      /* bytes; 0 = no limit: the real GPU is shown */
    uint64_t used;           /* bytes the pod (or process) holds on the GPU, as its ledger counts */
    uint32_t process_count;  /* entries of processes[] in use; the asker first when it is one */
    uint32_t unlisted;       /* processes counted in `used` but not listed: past the array, or
                              * outside the asker's PID namespace */
    struct nvs_view_process processes[NVS_VIEW_MAX_PROCESSES];
};

/* The job a process belongs to outside pods: NVSHARE_GANG, else torch.distributed's rendezvous
 * (TORCHELASTIC_RUN_ID@MASTER_ADDR:MASTER_PORT). Only groups processes of one user. */
struct nvs_gang_hint {
    char name[NVS_GANG_LEN];
};

/* NVSHARE_GPU_PRIORITY: low (-100), normal (0), high (100) or a whole number in between the
 * bounds below, as the policy writes priorities (appliance/policy/model.py). */
#define NVS_MIN_PRIORITY (-1000)
#define NVS_MAX_PRIORITY 1000
struct nvs_priority_hint {
    int32_t priority;
    uint32_t reserved;
};

/* One gang drop: the daemon numbers it (cut_id); collectives are NCCL-style launches (the remote
 * memory-synchronisation domain) on this client's GPU, counted from the process's start. */
struct nvs_gang_cut {
    uint64_t cut_id;
    uint64_t collectives; /* GANG_DROP, GANG_CUT_OVER: 0 */
};

#define NVS_ASSERT_SIZE(t, n) _Static_assert(sizeof(t) == (n), #t " has the wrong size")
NVS_ASSERT_SIZE(struct nvs_header, 24);
NVS_ASSERT_SIZE(struct nvs_register, 392);
NVS_ASSERT_SIZE(struct nvs_limits, 24);
NVS_ASSERT_SIZE(struct nvs_registered, 32);
NVS_ASSERT_SIZE(struct nvs_lock_grant, 24);
NVS_ASSERT_SIZE(struct nvs_lock_released, 8);
NVS_ASSERT_SIZE(struct nvs_set_tq, 8);
NVS_ASSERT_SIZE(struct nvs_set_mode, 56);
NVS_ASSERT_SIZE(struct nvs_result, 256);
NVS_ASSERT_SIZE(struct nvs_mem_reserve, 16);
NVS_ASSERT_SIZE(struct nvs_mem_grant, 16);
NVS_ASSERT_SIZE(struct nvs_mem_return, 16);
NVS_ASSERT_SIZE(struct nvs_limit_set, 344);
NVS_ASSERT_SIZE(struct nvs_mem_observed, 16);
NVS_ASSERT_SIZE(struct nvs_ledger_peers, 8);
NVS_ASSERT_SIZE(struct nvs_mem_refusals, 16);
NVS_ASSERT_SIZE(struct nvs_view_request, 376);
NVS_ASSERT_SIZE(struct nvs_view_process, 16);
NVS_ASSERT_SIZE(struct nvs_view, 280);
NVS_ASSERT_SIZE(struct nvs_gang_hint, 128);
NVS_ASSERT_SIZE(struct nvs_gang_cut, 16);
NVS_ASSERT_SIZE(struct nvs_priority_hint, 8);

#endif /* NVSHARE_PROTO_H */
