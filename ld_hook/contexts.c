/*
 * Contexts and streams (see contexts.h). The registry is a growable array: releases synchronise
 * every context it lists, so it has no fixed limit.
 */
#include <stdlib.h>
#include <string.h>

#include "contexts.h"
#include "dispatch.h"
#include "log.h"

NVS_TLS int nvs_tls_dev = -1;

struct ctx_entry {
    CUcontext ctx;
    int dev;
    enum nvs_ctx_kind kind;
};

static struct {
    pthread_mutex_t mu;
    struct ctx_entry *list;
    int n, cap;
} reg = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Streams are looked up once per thread and remembered until any stream or context goes away. */
static atomic_uint stream_epoch = 1;
static NVS_TLS struct {
    CUstream s;
    unsigned epoch;
    int dev;
} stream_cache;

void nvs_ctx_note(CUcontext ctx, int dev, enum nvs_ctx_kind kind)
{
    if (ctx == NULL || nvs_gpu_at(dev) == NULL) return;
    nvs_mutex_lock(&reg.mu);
    int i = 0;
    while (i < reg.n && reg.list[i].ctx != ctx) i++;
    if (i == reg.n && reg.n == reg.cap) {
        int cap = reg.cap ? reg.cap * 2 : 16;
        struct ctx_entry *list = realloc(reg.list, (size_t)cap * sizeof *list);
        if (list == NULL) {
            nvs_mutex_unlock(&reg.mu);
            NVS_DEBUG("out of memory noting a context; it will not be drained");
            return;
        }
        reg.list = list;
        reg.cap = cap;
    }
    if (i == reg.n) {
        reg.n++;
        reg.list[i] = (struct ctx_entry){.ctx = ctx, .dev = dev, .kind = kind};
    } else if (kind != NVS_CTX_PLAIN) {
        reg.list[i].kind = kind; /* made current later: still primary (or green) */
    }
    nvs_mutex_unlock(&reg.mu);
}

void nvs_ctx_forget(CUcontext ctx)
{
    nvs_mutex_lock(&reg.mu);
    for (int i = 0; i < reg.n; i++)
        if (reg.list[i].ctx == ctx) reg.list[i--] = reg.list[--reg.n];
    nvs_mutex_unlock(&reg.mu);
    nvs_streams_changed();
}

static int known_device(CUcontext ctx)
{
    int dev = -1;
    nvs_mutex_lock(&reg.mu);
    for (int i = 0; i < reg.n && dev < 0; i++)
        if (reg.list[i].ctx == ctx) dev = reg.list[i].dev;
    nvs_mutex_unlock(&reg.mu);
    return dev;
}

int nvs_ctx_device(CUcontext ctx)
{
    if (ctx == NULL) return -1;
    int dev = known_device(ctx);
    if (dev >= 0) return dev;
    CUdevice d = -1;
    if (NVS_CALL(cuCtxGetDevice_v2, (&d, ctx)) != CUDA_SUCCESS) {
        /* before CUDA 13: make it current for a moment to ask */
        CUcontext popped;
        if (NVS_CALL(cuCtxPushCurrent_v2, (ctx)) != CUDA_SUCCESS) return -1;
        if (NVS_CALL(cuCtxGetDevice, (&d)) != CUDA_SUCCESS) d = -1;
        NVS_CALL(cuCtxPopCurrent_v2, (&popped));
    }
    if (d >= 0) nvs_ctx_note(ctx, d, NVS_CTX_PLAIN);
    return d;
}

CUcontext nvs_ctx_current(void)
{
    CUcontext ctx = NULL;
    if (NVS_CALL(cuCtxGetCurrent, (&ctx)) != CUDA_SUCCESS) return NULL;
    return ctx;
}

CUcontext nvs_ctx_primary(int dev)
{
    CUcontext ctx = NULL;
    nvs_mutex_lock(&reg.mu);
    for (int i = 0; i < reg.n && ctx == NULL; i++)
        if (reg.list[i].dev == dev && reg.list[i].kind == NVS_CTX_PRIMARY) ctx = reg.list[i].ctx;
    nvs_mutex_unlock(&reg.mu);
    return ctx;
}

static void sync_one(CUcontext ctx)
{
    if (NVS_CALL(cuCtxSynchronize_v2, (ctx)) != CUDA_ERROR_NOT_FOUND) return;
    CUcontext popped;
    if (NVS_CALL(cuCtxPushCurrent_v2, (ctx)) != CUDA_SUCCESS) return;
    NVS_CALL(cuCtxSynchronize, ());
    NVS_CALL(cuCtxPopCurrent_v2, (&popped));
}

void nvs_ctx_sync_gpu(const struct nvs_gpu *g)
{
    nvs_mutex_lock(&reg.mu);
    int n = 0;
    CUcontext *ctxs = malloc((size_t)(reg.n ? reg.n : 1) * sizeof *ctxs);
    for (int i = 0; ctxs != NULL && i < reg.n; i++)
        if (reg.list[i].dev == g->index) ctxs[n++] = reg.list[i].ctx;
    nvs_mutex_unlock(&reg.mu);
    if (ctxs == NULL) {
        NVS_DEBUG("GPU %d: out of memory listing contexts; not drained", g->index);
        return;
    }
    for (int i = 0; i < n; i++) sync_one(ctxs[i]);
    free(ctxs);
}

/* Multi-GPU processes: the device of the calling thread's current context, cached per thread. */
struct nvs_gpu *nvs_thread_gpu(void)
{
    if (nvs_tls_dev < 0) {
        if (nvs_gpu_count() == 0) return NULL;
        CUdevice d = -1;
        if (NVS_CALL(cuCtxGetDevice, (&d)) != CUDA_SUCCESS) return NULL;
        nvs_tls_dev = d;
    }
    return nvs_gpu_at(nvs_tls_dev);
}

struct nvs_gpu *nvs_stream_gpu(CUstream s)
{
    if (s == NULL || s == NVS_STREAM_LEGACY || s == NVS_STREAM_PER_THREAD) return nvs_thread_gpu();
    unsigned epoch = atomic_load_explicit(&stream_epoch, memory_order_acquire);
    if (stream_cache.s == s && stream_cache.epoch == epoch) return nvs_gpu_at(stream_cache.dev);
    CUcontext ctx = NULL;
    if (NVS_CALL(cuStreamGetCtx, (s, &ctx)) != CUDA_SUCCESS) return nvs_thread_gpu();
    int dev = nvs_ctx_device(ctx);
    if (dev < 0) return nvs_thread_gpu();
    stream_cache.s = s;
    stream_cache.epoch = epoch;
    stream_cache.dev = dev;
    return nvs_gpu_at(dev);
}

void nvs_streams_changed(void) { atomic_fetch_add_explicit(&stream_epoch, 1, memory_order_acq_rel); }

void nvs_contexts_after_fork(void)
{
    pthread_mutex_init(&reg.mu, NULL);
    reg.n = 0;
    nvs_tls_dev = -1;
    nvs_streams_changed();
}
