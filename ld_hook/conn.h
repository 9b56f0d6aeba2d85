/*
 * One connection per (process, GPU) to the node scheduler. This module only moves frames: it
 * connects and registers, reads frames on its own thread and checks every one (version, length,
 * enums, ranges) before handing a typed event to the handler the session installed, and sends
 * frames from an outbox without ever blocking. It also decides when the daemon is gone: EOF, a
 * frame it cannot parse, or no answer to a request (heartbeats included) within
 * NVSHARE_DAEMON_TIMEOUT_MS.
 * Lock order: a caller may hold its own module's mutex while queueing, never while calling
 * nvs_conn_use or nvs_conn_flush.
 */
#ifndef NVSHARE_CONN_H
#define NVSHARE_CONN_H

#include "gpus.h"

enum nvs_event_kind {
    NVS_EV_REGISTERED,    /* u.registered */
    NVS_EV_DOWN,          /* the daemon is gone, or never answered: u.why */
    NVS_EV_LIMITS,        /* u.limits */
    NVS_EV_LOCK_GRANT,    /* u.grant */
    NVS_EV_LOCK_TERMS,    /* u.grant: new terms for the grant held */
    NVS_EV_LOCK_DROP,
    NVS_EV_LOCK_LENT,
    NVS_EV_LOCK_UNLENT,
    NVS_EV_MEM_GRANT,     /* u.mem */
    NVS_EV_MEM_OBSERVED,  /* u.observed */
    NVS_EV_LEDGER_PEERS,  /* u.peers */
    NVS_EV_ERROR,         /* u.error: the daemon refused a request of type u.error.ref_type */
    NVS_EV_GANG_DROP,     /* u.cut */
    NVS_EV_GANG_CUT,      /* u.cut */
    NVS_EV_GANG_CUT_OVER, /* u.cut */
};

struct nvs_event {
    enum nvs_event_kind kind;
    uint64_t seq;
    union {
        struct nvs_registered registered;
        struct nvs_limits limits;
        struct nvs_lock_grant grant;
        struct nvs_mem_grant mem;
        struct nvs_mem_observed observed;
        struct nvs_ledger_peers peers;
        struct nvs_result error;
        struct nvs_gang_cut cut;
        const char *why;
    } u;
};

typedef void (*nvs_event_handler)(struct nvs_gpu *g, const struct nvs_event *e);

void nvs_conn_init(nvs_event_handler handler);
/* First use of g: connect and register, waiting at most the daemon timeout. No locks held. */
void nvs_conn_use(struct nvs_gpu *g);
/* Appends a frame to g's outbox (no syscall); *seq gets its sequence number. 0 when queued. */
int nvs_conn_queue(struct nvs_gpu *g, uint16_t type, const void *body, uint32_t len, uint64_t *seq);
void nvs_conn_flush(struct nvs_gpu *g); /* no locks held */
void nvs_conn_fail(struct nvs_gpu *g, const char *why); /* treat the daemon as gone */
void nvs_conn_tick(struct nvs_gpu *g, uint64_t now_ns); /* heartbeat, liveness, reconnect */
void nvs_conn_after_fork(void);
/* One request and its one reply (of reply_type, exactly reply_len bytes) on a connection of its
 * own, needing no registration: 0 when answered, -1 when the daemon is absent, refused it or did
 * not answer within the daemon timeout (at most 2 s). Never waits on a full backlog. */
int nvs_conn_ask(uint16_t type, const void *body, uint32_t len, uint16_t reply_type, void *reply,
                 uint32_t reply_len);

#endif
