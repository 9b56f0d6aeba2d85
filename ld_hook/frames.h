/*
 * Frames in from the node scheduler: read one from a stream socket, and turn its body into a
 * typed event after checking it (version, length, enums, ranges). No state but the count of
 * malformed frames already reported; conn.c owns the sockets and the threads.
 */
#ifndef NVSHARE_FRAMES_H
#define NVSHARE_FRAMES_H

#include <stdint.h>

#include "gpus.h"
#include "nvshare_proto.h"

#define NVS_FRAME_BODY_CAP 512 /* larger than any frame the hook accepts */

/* What the daemon said, as the connection's handler hears it. */
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
    NVS_EV_MEM_RECLAIM,   /* give back the unused reservation */
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


/* One frame from fd: 0 = in *h and body (its first *kept bytes), 1 = skipped (already reported),
 * -1 = the stream is unusable (*why says why where it is not just EOF). */
int nvs_frame_read(const struct nvs_gpu *g, int fd, struct nvs_header *h, char *body,
                   uint32_t *kept, const char **why);

/* A frame's body as a typed event: 1 with *ev filled, 0 when there is nothing to deliver
 * (reported if malformed). */
int nvs_frame_decode(const struct nvs_gpu *g, const struct nvs_header *h, const char *body,
                     uint32_t len, struct nvs_event *ev);

/* In a forked child: report malformed frames afresh. */
void nvs_frames_after_fork(void);

#endif
