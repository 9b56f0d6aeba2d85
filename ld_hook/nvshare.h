/*
 * State shared by the hook's translation units: the dispatch table, the per-GPU gate and memory
 * ledger, and the connection to the node scheduler. Everything here is hidden (-fvisibility=hidden);
 * only the interposed driver symbols and dlsym are exported (libnvshare.map.in).
 */
#ifndef NVSHARE_H
#define NVSHARE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_api.h"
#include "nvshare_proto.h"

#define NVS_EXPORT __attribute__((visibility("default")))
#define NVS_LIKELY(x) __builtin_expect(!!(x), 1)
#define NVS_TLS __thread __attribute__((tls_model("initial-exec")))

/* ---- dispatch (dispatch.c) ---- */
enum nvs_hook_id {
#define NVS_CU(n) NVS_H_##n,
#define NVS_NVML(n) NVS_H_##n,
#include "hooks.def"
#undef NVS_CU
#undef NVS_NVML
    NVS_H_COUNT
};

extern _Atomic(void *) nvs_slots[NVS_H_COUNT];
void *nvs_resolve(int id);
void *nvs_resolve_extra(int nvml, const char *name); /* a real function we call but do not hook */

/* nvs_resolve_extra, remembered in a static slot: for driver calls made more than once. */
#define NVS_EXTRA(type_of, nvml, name)                                                   \
    ({                                                                                   \
        static _Atomic(void *) slot_;                                                    \
        void *p_ = atomic_load_explicit(&slot_, memory_order_relaxed);                   \
        if (p_ == NULL) {                                                                \
            p_ = nvs_resolve_extra((nvml), (name));                                      \
            atomic_store_explicit(&slot_, p_, memory_order_relaxed);                     \
        }                                                                                \
        (__typeof__(&type_of))p_;                                                        \
    })

static inline void *nvs_real(int id)
{
    void *p = atomic_load_explicit(&nvs_slots[id], memory_order_relaxed);
    return NVS_LIKELY(p != NULL) ? p : nvs_resolve(id);
}

/* Call the real driver function `name` with `args` and return its result. */
#define NVS_TAIL(name, args)                                                       \
    do {                                                                           \
        __typeof__(&name) real_ = (__typeof__(&name))nvs_real(NVS_H_##name);       \
        return real_ != NULL ? real_ args : CUDA_ERROR_NOT_FOUND;                  \
    } while (0)
#define NVS_REAL(name) ((__typeof__(&name))nvs_real(NVS_H_##name))

/* ---- logging (log.c) ---- */
extern int nvs_debug_on;
void nvs_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void nvs_notice_once(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void nvs_notice_reset(void);
#define NVS_DEBUG(...)                  \
    do {                                \
        if (nvs_debug_on) nvs_log(__VA_ARGS__); \
    } while (0)

/* ---- configuration from the environment (runtime.c) ---- */
struct nvs_config {
    char socket_path[108];
    uint64_t env_mem_limit; /* 0 = none */
    uint32_t env_core_limit;
    uint32_t idle_release_ms; /* NVSHARE_IDLE_RELEASE_MS; 0 = unset (the daemon's policy decides) */
    char pod_namespace[NVS_NAME_LEN];
    char pod_name[NVS_NAME_LEN];
};
extern struct nvs_config nvs_cfg;
/* A size as the whole project writes it ("4Gi", "1.5G", "512" = 512 MiB; size.c says how):
 * NVS_SIZE_OK with *out in bytes, or why not. */
enum { NVS_SIZE_OK = 0, NVS_SIZE_SYNTAX = -1, NVS_SIZE_TOO_LARGE = -2 };
int nvs_parse_bytes(const char *text, uint64_t *out);
uint64_t nvs_now_ns(void);

/* ---- per-GPU state (runtime.c, client.c) ---- */
#define NVS_MAX_GPUS 16
#define NVS_DEFAULT_IDLE_RELEASE_MS 1000u
#define NVS_MAX_CTX 32

enum nvs_conn_state { NVS_UNUSED = 0, NVS_CONNECTED, NVS_DISCONNECTED };

struct nvs_gpu {
    /* Read by the hot path: 1 = submissions pass straight to the driver. */
    _Alignas(64) atomic_int pass;
    /* Written by the hot path while the lock is held; read and cleared by the idle check. */
    _Alignas(64) atomic_int touched;
    _Alignas(64) pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;
    int index;
    enum nvs_conn_state state;
    int fd;
    unsigned generation; /* bumped per connection so a stale reader thread leaves quietly */
    uint64_t seq;
    uint64_t client_id;
    uint64_t backoff_ms, next_retry_ns;
    /* identity, filled at first use from the real driver */
    char uuid[NVS_UUID_LEN];
    uint64_t total_mem;
    /* limits: the daemon's last word (kept when it goes away) */
    struct nvs_limits limits;
    int have_limits;
    /* lock */
    int gating, held, requested, releasing;
    uint32_t idle_release_ms; /* from the last grant, unless NVSHARE_IDLE_RELEASE_MS is set */
    uint64_t last_active_ns;
    /* memory ledger */
    uint64_t usage, reserved;
    uint64_t reported; /* usage as the daemon last heard it; UINT64_MAX = never told */
    int reserving, mem_replied, mem_error;
    uint64_t mem_wait_seq;
    struct nvs_mem_grant mem_reply;
    /* contexts this process created or made current on this GPU (synchronised on release) */
    CUcontext ctxs[NVS_MAX_CTX];
    int nctx;
};

extern struct nvs_gpu nvs_gpus[NVS_MAX_GPUS];
extern atomic_int nvs_ngpus;
extern _Atomic(struct nvs_gpu *) nvs_single_gpu; /* set when the process sees exactly one GPU */
extern NVS_TLS int nvs_tls_dev;                  /* the calling thread's current device, -1 unknown */

void nvs_early_init(void);      /* environment only; no thread, no socket */
void nvs_start(void);           /* after a successful real cuInit */
struct nvs_gpu *nvs_thread_gpu(void);
struct nvs_gpu *nvs_gpu_by_index(int index);
void nvs_note_current_ctx(CUcontext ctx);
void nvs_note_ctx(CUcontext ctx, int dev);
void nvs_forget_ctx(CUcontext ctx);

/* The GPU the calling thread submits to, or NULL when the hook is not active. */
static inline struct nvs_gpu *nvs_current_gpu(void)
{
    struct nvs_gpu *g = atomic_load_explicit(&nvs_single_gpu, memory_order_relaxed);
    return NVS_LIKELY(g != NULL) ? g : nvs_thread_gpu();
}

/* ---- client connection and lock (client.c) ---- */
void nvs_gpu_use(struct nvs_gpu *g); /* with g->mu held: connect and register on first use */
void nvs_gate_slow(struct nvs_gpu *g);
void nvs_release_lock(struct nvs_gpu *g, uint32_t reason);
int nvs_send(struct nvs_gpu *g, uint16_t type, uint64_t seq, const void *body, uint32_t len);
void nvs_apply_limits(struct nvs_gpu *g, const struct nvs_limits *lim);
void nvs_service_tick(void);
void nvs_client_after_fork(void);

/*
 * HOT PATH: called before every kernel launch, graph launch, copy and set. While the lock is held
 * this is one relaxed load, a branch and one relaxed store (activity for the idle release): no
 * mutex, no syscall, no getenv, no logging.
 */
static inline void nvs_gate(struct nvs_gpu *g)
{
    if (g == NULL) return;
    if (NVS_LIKELY(atomic_load_explicit(&g->pass, memory_order_relaxed))) {
        atomic_store_explicit(&g->touched, 1, memory_order_relaxed);
        return;
    }
    nvs_gate_slow(g);
}

/* ---- memory ledger (memory.c) ---- */
uint64_t nvs_effective_limit(const struct nvs_gpu *g); /* with g->mu held; 0 = none */
void nvs_memory_after_fork(void);
void nvs_return_unused(struct nvs_gpu *g); /* with g->mu held */
void nvs_report_usage(struct nvs_gpu *g);  /* with g->mu held */

#endif /* NVSHARE_H */
