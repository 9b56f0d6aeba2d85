/*
 * One connection per (process, GPU) to the node scheduler: registration, the reader thread that
 * handles the daemon's frames, the lock (request, grant, drop, idle release) and fail-soft
 * behaviour. Without a daemon the program runs ungated with its last known limits; the service
 * thread reconnects with backoff and gating resumes once it registers again.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "nvshare.h"

#define NVS_MAX_BACKOFF_MS 5000

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

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

static int send_frame(int fd, uint16_t type, uint64_t seq, const void *body, uint32_t len)
{
    char buf[sizeof(struct nvs_header) + 256];
    struct nvs_header h = {.magic = NVS_MAGIC, .version = NVS_PROTO_VERSION, .type = type,
                           .flags = 0, .body_len = len, .seq = seq};
    if (len > 256) return -1;
    memcpy(buf, &h, sizeof h);
    if (len > 0) memcpy(buf + sizeof h, body, len);
    return write_all(fd, buf, sizeof h + len);
}

/* Reads one frame; the body is truncated to `cap` bytes (the rest is consumed). */
static int read_frame(int fd, struct nvs_header *h, void *body, uint32_t cap)
{
    if (read_all(fd, h, sizeof *h) != 0) return -1;
    if (h->magic != NVS_MAGIC || h->body_len > NVS_MAX_BODY) return -1;
    uint32_t keep = h->body_len < cap ? h->body_len : cap;
    memset(body, 0, cap);
    if (keep > 0 && read_all(fd, body, keep) != 0) return -1;
    char sink[256];
    for (uint32_t left = h->body_len - keep; left > 0;) {
        uint32_t n = left < sizeof sink ? left : (uint32_t)sizeof sink;
        if (read_all(fd, sink, n) != 0) return -1;
        left -= n;
    }
    return 0;
}

/* With g->mu held. Returns 0 when the frame went out. */
int nvs_send(struct nvs_gpu *g, uint16_t type, uint64_t seq, const void *body, uint32_t len)
{
    if (g->state != NVS_CONNECTED || g->fd < 0) return -1;
    return send_frame(g->fd, type, seq, body, len);
}

static void fill_identity(struct nvs_gpu *g)
{
    if (g->uuid[0] != '\0') return;
    CUuuid u;
    memset(&u, 0, sizeof u);
    __typeof__(&cuDeviceGetUuid_v2) get_uuid =
        (__typeof__(&cuDeviceGetUuid_v2))nvs_resolve_extra(0, "cuDeviceGetUuid_v2");
    if (get_uuid == NULL)
        get_uuid = (__typeof__(&cuDeviceGetUuid_v2))nvs_resolve_extra(0, "cuDeviceGetUuid");
    if (get_uuid != NULL) get_uuid(&u, g->index);
    const unsigned char *b = u.bytes;
    snprintf(g->uuid, sizeof g->uuid,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    size_t total = 0;
    __typeof__(&cuDeviceTotalMem_v2) real_total = NVS_REAL(cuDeviceTotalMem_v2);
    if (real_total != NULL && real_total(&total, g->index) == CUDA_SUCCESS) g->total_mem = total;
}

/* Connect and register (blocking, at most a few seconds); -1 when no daemon answers. */
static int connect_and_register(struct nvs_gpu *g, uint64_t seq, struct nvs_registered *out)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", nvs_cfg.socket_path);
    struct timeval tv = {.tv_sec = 5, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct nvs_register reg;
    memset(&reg, 0, sizeof reg);
    reg.pid = (uint32_t)getpid();
    reg.env_core_limit = nvs_cfg.env_core_limit;
    reg.gpu_total_mem = g->total_mem;
    reg.env_mem_limit = nvs_cfg.env_mem_limit;
    memcpy(reg.gpu_uuid, g->uuid, sizeof reg.gpu_uuid);
    memcpy(reg.pod_namespace, nvs_cfg.pod_namespace, sizeof reg.pod_namespace);
    memcpy(reg.pod_name, nvs_cfg.pod_name, sizeof reg.pod_name);
    struct nvs_header h;
    struct nvs_registered body;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        send_frame(fd, NVS_MSG_REGISTER, seq, &reg, sizeof reg) != 0 ||
        read_frame(fd, &h, &body, sizeof body) != 0 || h.type != NVS_MSG_REGISTERED ||
        h.seq != seq) {
        close(fd);
        return -1;
    }
    struct timeval none = {0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
    *out = body;
    return fd;
}

/* With g->mu held: the daemon is gone (or never came). Run ungated; retry in the background. */
static void mark_disconnected(struct nvs_gpu *g, const char *why)
{
    if (g->fd >= 0) close(g->fd);
    g->fd = -1;
    g->state = NVS_DISCONNECTED;
    g->generation++;
    g->held = g->requested = 0;
    g->reserved = 0;
    if (g->reserving) g->mem_replied = g->mem_error = 1;
    g->next_retry_ns = nvs_now_ns() + g->backoff_ms * 1000000ull;
    atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
    pthread_cond_broadcast(&g->cv);
    nvs_notice_once("%s (%s); GPU %d runs without sharing, keeping its last known limits, and "
                    "reconnects in the background",
                    why, nvs_cfg.socket_path, g->index);
    NVS_DEBUG("GPU %d: %s; ungated until the scheduler is back", g->index, why);
}

/* With g->mu held: a new or changed set of limits from the daemon. */
void nvs_apply_limits(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    g->limits = *lim;
    g->have_limits = 1;
    g->gating = lim->mode != NVS_MODE_OFF;
    int pass = !g->gating || g->state != NVS_CONNECTED || (g->held && !g->releasing);
    atomic_store_explicit(&g->pass, pass, memory_order_relaxed);
    pthread_cond_broadcast(&g->cv);
    NVS_DEBUG("GPU %d: limits mem=%llu core=%u mode=%u backing=%u flags=%u", g->index,
              (unsigned long long)lim->mem_limit, lim->core_limit, lim->mode, lim->backing,
              lim->flags);
}

struct reader_arg {
    struct nvs_gpu *g;
    int fd;
    unsigned generation;
};

static void handle_frame(struct nvs_gpu *g, const struct nvs_header *h, const void *body)
{
    switch (h->type) {
    case NVS_MSG_LOCK_GRANT:
        if (g->requested) {
            struct nvs_lock_grant grant;
            memcpy(&grant, body, sizeof grant);
            g->idle_release_ms = nvs_cfg.idle_release_ms   ? nvs_cfg.idle_release_ms
                                 : grant.idle_release_ms ? grant.idle_release_ms
                                                         : NVS_DEFAULT_IDLE_RELEASE_MS;
            g->requested = 0;
            g->held = 1;
            g->last_active_ns = nvs_now_ns();
            atomic_store_explicit(&g->touched, 0, memory_order_relaxed);
            atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
            NVS_DEBUG("GPU %d: lock granted", g->index);
        }
        break;
    case NVS_MSG_MEM_GRANT:
        if (g->reserving && h->seq == g->mem_wait_seq) {
            memcpy(&g->mem_reply, body, sizeof g->mem_reply);
            g->mem_replied = 1;
        }
        break;
    case NVS_MSG_LIMIT_UPDATE: {
        struct nvs_limits lim;
        memcpy(&lim, body, sizeof lim);
        nvs_apply_limits(g, &lim);
        nvs_return_unused(g);
        break;
    }
    case NVS_MSG_ERROR: {
        struct nvs_result res;
        memcpy(&res, body, sizeof res);
        res.message[NVS_MESSAGE_LEN - 1] = '\0';
        NVS_DEBUG("GPU %d: scheduler error %d answering type %u: %s", g->index, res.status,
                  res.ref_type, res.message);
        if (res.ref_type == NVS_MSG_MEM_RESERVE && g->reserving && h->seq == g->mem_wait_seq)
            g->mem_replied = g->mem_error = 1;
        if (res.ref_type == NVS_MSG_LOCK_REQUEST && g->requested) {
            /* The scheduler cannot gate us; run ungated rather than hang. */
            g->requested = 0;
            atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
        }
        break;
    }
    default:
        NVS_DEBUG("GPU %d: ignoring frame type %u", g->index, h->type);
    }
    pthread_cond_broadcast(&g->cv);
}

static void *reader_main(void *p)
{
    struct reader_arg a = *(struct reader_arg *)p;
    free(p);
    struct nvs_gpu *g = a.g;
    for (;;) {
        struct nvs_header h;
        _Alignas(8) char body[256];
        int bad = read_frame(a.fd, &h, body, sizeof body) != 0;
        if (!bad && h.type == NVS_MSG_LOCK_DROP) {
            NVS_DEBUG("GPU %d: lock drop requested", g->index);
            nvs_release_lock(g, NVS_RELEASE_DROPPED);
            continue;
        }
        pthread_mutex_lock(&g->mu);
        if (g->generation != a.generation) {
            pthread_mutex_unlock(&g->mu);
            return NULL;
        }
        if (bad) {
            mark_disconnected(g, "lost the connection to the nvshare scheduler");
            pthread_mutex_unlock(&g->mu);
            return NULL;
        }
        handle_frame(g, &h, body);
        pthread_mutex_unlock(&g->mu);
    }
}

/* With g->mu held: install a registered connection and its reader thread. */
static void install(struct nvs_gpu *g, int fd, const struct nvs_registered *reg)
{
    struct reader_arg *a = malloc(sizeof *a);
    if (a == NULL) {
        close(fd);
        return;
    }
    g->fd = fd;
    g->state = NVS_CONNECTED;
    g->generation++;
    g->client_id = reg->client_id;
    g->backoff_ms = 100;
    g->held = g->requested = g->releasing = 0;
    g->reserved = 0;
    g->reported = UINT64_MAX; /* a new daemon learns our usage at the next service tick */
    *a = (struct reader_arg){.g = g, .fd = fd, .generation = g->generation};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    if (pthread_create(&t, &attr, reader_main, a) != 0) {
        free(a);
        mark_disconnected(g, "cannot start the reader thread");
    }
    pthread_attr_destroy(&attr);
    nvs_apply_limits(g, &reg->limits);
    NVS_DEBUG("GPU %d (%s): registered as client %llu", g->index, g->uuid,
              (unsigned long long)reg->client_id);
}

void nvs_gpu_use(struct nvs_gpu *g)
{
    if (g->state != NVS_UNUSED) return;
    fill_identity(g);
    struct nvs_registered reg;
    int fd = connect_and_register(g, ++g->seq, &reg);
    if (fd >= 0)
        install(g, fd, &reg);
    else
        mark_disconnected(g, "cannot reach the nvshare scheduler");
}

void nvs_gate_slow(struct nvs_gpu *g)
{
    pthread_mutex_lock(&g->mu);
    nvs_gpu_use(g);
    for (;;) {
        if (g->state != NVS_CONNECTED || !g->gating) {
            if (!g->releasing) atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
            break;
        }
        if (atomic_load_explicit(&g->pass, memory_order_relaxed)) break;
        if (!g->releasing && g->held) {
            atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
            break;
        }
        if (!g->releasing && !g->requested) {
            g->requested = 1;
            NVS_DEBUG("GPU %d: requesting the lock", g->index);
            if (nvs_send(g, NVS_MSG_LOCK_REQUEST, ++g->seq, NULL, 0) != 0) g->requested = 0;
        }
        pthread_cond_wait(&g->cv, &g->mu);
    }
    atomic_store_explicit(&g->touched, 1, memory_order_relaxed);
    pthread_mutex_unlock(&g->mu);
}

static void sync_contexts(CUcontext *ctxs, int n)
{
    __typeof__(&cuCtxPushCurrent_v2) push = NVS_REAL(cuCtxPushCurrent_v2);
    __typeof__(&cuCtxPopCurrent_v2) pop = NVS_REAL(cuCtxPopCurrent_v2);
    __typeof__(&cuCtxSynchronize) sync = NVS_EXTRA(cuCtxSynchronize, 0, "cuCtxSynchronize");
    if (push == NULL || pop == NULL || sync == NULL) return;
    for (int i = 0; i < n; i++) {
        if (push(ctxs[i]) != CUDA_SUCCESS) continue;
        sync();
        CUcontext popped;
        pop(&popped);
    }
}

/* Block new submissions, wait for the GPU work already queued, then hand the lock back. */
void nvs_release_lock(struct nvs_gpu *g, uint32_t reason)
{
    pthread_mutex_lock(&g->mu);
    if (!g->held || g->releasing) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    g->releasing = 1;
    atomic_store_explicit(&g->pass, 0, memory_order_relaxed);
    CUcontext ctxs[NVS_MAX_CTX];
    int n = g->nctx;
    memcpy(ctxs, g->ctxs, sizeof(CUcontext) * (size_t)n);
    unsigned generation = g->generation;
    pthread_mutex_unlock(&g->mu);

    sync_contexts(ctxs, n);

    pthread_mutex_lock(&g->mu);
    g->releasing = 0;
    if (g->generation == generation && g->held) {
        g->held = 0;
        struct nvs_lock_released body = {.reason = reason, .reserved = 0};
        nvs_send(g, NVS_MSG_LOCK_RELEASED, ++g->seq, &body, sizeof body);
        NVS_DEBUG("GPU %d: lock released (%s)", g->index, reason == NVS_RELEASE_IDLE ? "idle" : "dropped");
    }
    if (g->state != NVS_CONNECTED || !g->gating)
        atomic_store_explicit(&g->pass, 1, memory_order_relaxed);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void try_reconnect(struct nvs_gpu *g)
{
    uint64_t seq = ++g->seq;
    unsigned generation = g->generation;
    pthread_mutex_unlock(&g->mu);
    struct nvs_registered reg;
    int fd = connect_and_register(g, seq, &reg);
    pthread_mutex_lock(&g->mu);
    if (fd >= 0 && g->generation == generation && g->state == NVS_DISCONNECTED) {
        install(g, fd, &reg);
        NVS_DEBUG("GPU %d: reconnected to the scheduler; gating resumes", g->index);
        return;
    }
    if (fd >= 0) close(fd);
    g->backoff_ms = g->backoff_ms * 2 > NVS_MAX_BACKOFF_MS ? NVS_MAX_BACKOFF_MS : g->backoff_ms * 2;
    g->next_retry_ns = nvs_now_ns() + g->backoff_ms * 1000000ull;
}

/* Service thread: reconnect lost GPUs, hand the lock back after the idle-release window. */
void nvs_service_tick(void)
{
    int n = atomic_load(&nvs_ngpus);
    uint64_t now = nvs_now_ns();
    for (int i = 0; i < n; i++) {
        struct nvs_gpu *g = &nvs_gpus[i];
        int idle = 0;
        pthread_mutex_lock(&g->mu);
        if (g->state == NVS_DISCONNECTED && now >= g->next_retry_ns) try_reconnect(g);
        nvs_report_usage(g);
        if (g->state == NVS_CONNECTED && g->held && !g->releasing) {
            if (atomic_exchange_explicit(&g->touched, 0, memory_order_relaxed))
                g->last_active_ns = now;
            else if (now - g->last_active_ns >= (uint64_t)g->idle_release_ms * 1000000ull)
                idle = 1;
        }
        pthread_mutex_unlock(&g->mu);
        if (idle) nvs_release_lock(g, NVS_RELEASE_IDLE);
    }
}

void nvs_client_after_fork(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++)
        if (nvs_gpus[i].fd >= 0) close(nvs_gpus[i].fd);
}
