/*
 * Frames from the node scheduler, read and checked (see frames.h): the header, the body up to
 * NVS_FRAME_BODY_CAP, every enum and range of the bodies the hook accepts. What is wrong with a
 * frame is logged (the first few times) and the frame dropped; a stream that cannot be read
 * on is the caller's to close.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>

#include "frames.h"
#include "log.h"

#define MAX_REPORTED_MALFORMED 5

static atomic_int malformed_reported;

static const char WHY_GARBAGE[] = "the nvshare scheduler sent something that is not an nvshare frame";

static int read_all(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void report_malformed(const struct nvs_gpu *g, unsigned type, const char *what)
{
    int n = atomic_fetch_add(&malformed_reported, 1);
    if (n < MAX_REPORTED_MALFORMED)
        nvs_log("GPU %d: ignored a frame of type %u from the scheduler: %s%s", g->index, type, what,
                n == MAX_REPORTED_MALFORMED - 1 ? " (further ones are not reported)" : "");
}

int nvs_frame_read(const struct nvs_gpu *g, int fd, struct nvs_header *h, char *body,
                   uint32_t *kept, const char **why)
{
    if (read_all(fd, h, sizeof *h) != 0) return -1;
    if (h->magic != NVS_MAGIC || h->body_len > NVS_MAX_BODY) {
        *why = WHY_GARBAGE;
        return -1;
    }
    *kept = h->body_len < NVS_FRAME_BODY_CAP ? h->body_len : NVS_FRAME_BODY_CAP;
    if (*kept > 0 && read_all(fd, body, *kept) != 0) return -1;
    char sink[256];
    for (uint32_t left = h->body_len - *kept; left > 0;) {
        uint32_t n = left < sizeof sink ? left : (uint32_t)sizeof sink;
        if (read_all(fd, sink, n) != 0) return -1;
        left -= n;
    }
    if (h->version != NVS_PROTO_VERSION) {
        report_malformed(g, h->type, "protocol version not spoken here");
        return 1;
    }
    if (h->body_len > NVS_FRAME_BODY_CAP) {
        report_malformed(g, h->type, "body too long");
        return 1;
    }
    return 0;
}

static const char *check_limits(const struct nvs_limits *l)
{
    if (l->core_limit < 1 || l->core_limit > 100) return "core limit outside 1-100";
    if (l->mode > NVS_MODE_AUTO) return "unknown mode";
    if (l->backing > NVS_BACKING_MANAGED) return "unknown memory backing";
    if (l->flags & ~NVS_LIMIT_KNOWN_FLAGS) return "unknown limit flags";
    return NULL;
}

int nvs_frame_decode(const struct nvs_gpu *g, const struct nvs_header *h, const char *body,
                     uint32_t len, struct nvs_event *ev)
{
    static const struct {
        uint16_t type;
        uint32_t len;
        enum nvs_event_kind kind;
    } shapes[] = {
        {NVS_MSG_REGISTERED, sizeof(struct nvs_registered), NVS_EV_REGISTERED},
        {NVS_MSG_LIMIT_UPDATE, sizeof(struct nvs_limits), NVS_EV_LIMITS},
        {NVS_MSG_LOCK_GRANT, sizeof(struct nvs_lock_grant), NVS_EV_LOCK_GRANT},
        {NVS_MSG_LOCK_TERMS, sizeof(struct nvs_lock_grant), NVS_EV_LOCK_TERMS},
        {NVS_MSG_LOCK_DROP, 0, NVS_EV_LOCK_DROP},
        {NVS_MSG_LOCK_LENT, 0, NVS_EV_LOCK_LENT},
        {NVS_MSG_LOCK_UNLENT, 0, NVS_EV_LOCK_UNLENT},
        {NVS_MSG_MEM_GRANT, sizeof(struct nvs_mem_grant), NVS_EV_MEM_GRANT},
        {NVS_MSG_MEM_OBSERVED, sizeof(struct nvs_mem_observed), NVS_EV_MEM_OBSERVED},
        {NVS_MSG_LEDGER_PEERS, sizeof(struct nvs_ledger_peers), NVS_EV_LEDGER_PEERS},
        {NVS_MSG_MEM_RECLAIM, 0, NVS_EV_MEM_RECLAIM},
        {NVS_MSG_ERROR, sizeof(struct nvs_result), NVS_EV_ERROR},
        {NVS_MSG_GANG_DROP, sizeof(struct nvs_gang_cut), NVS_EV_GANG_DROP},
        {NVS_MSG_GANG_CUT, sizeof(struct nvs_gang_cut), NVS_EV_GANG_CUT},
        {NVS_MSG_GANG_CUT_OVER, sizeof(struct nvs_gang_cut), NVS_EV_GANG_CUT_OVER},
        {NVS_MSG_HEARTBEAT_ACK, 0, NVS_EV_ERROR /* not delivered */},
    };
    size_t i = 0;
    while (i < sizeof shapes / sizeof shapes[0] && shapes[i].type != h->type) i++;
    if (i == sizeof shapes / sizeof shapes[0]) {
        NVS_DEBUG("GPU %d: ignoring frame type %u", g->index, h->type);
        return 0;
    }
    if (len != shapes[i].len) {
        report_malformed(g, h->type, "wrong body length");
        return 0;
    }
    if (h->type == NVS_MSG_HEARTBEAT_ACK) return 0;
    memset(ev, 0, sizeof *ev);
    ev->kind = shapes[i].kind;
    ev->seq = h->seq;
    memcpy(&ev->u, body, len);
    const char *bad = NULL;
    if (ev->kind == NVS_EV_REGISTERED) bad = check_limits(&ev->u.registered.limits);
    if (ev->kind == NVS_EV_LIMITS) bad = check_limits(&ev->u.limits);
    if (ev->kind == NVS_EV_MEM_GRANT && ev->u.mem.granted > ev->u.mem.reserved)
        bad = "grant larger than the reservation it reports";
    if (ev->kind == NVS_EV_LEDGER_PEERS && (ev->u.peers.clients < 1 || ev->u.peers.clients > 65536))
        bad = "process count outside 1-65536";
    if (ev->kind == NVS_EV_ERROR && ev->u.error.status == NVS_OK) bad = "an error with status 0";
    if (bad != NULL) {
        report_malformed(g, h->type, bad);
        return 0;
    }
    if (ev->kind == NVS_EV_ERROR) ev->u.error.message[NVS_MESSAGE_LEN - 1] = '\0';
    return 1;
}

void nvs_frames_after_fork(void) { atomic_store(&malformed_reported, 0); }
