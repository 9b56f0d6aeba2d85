/*
 * A fake libcuda.so.1 for tests on machines without a GPU: an in-memory device that tracks bytes
 * against its size (so real-driver out-of-memory can be simulated) and runs "kernels" on a worker
 * thread per context, asynchronously, for NVSHARE_FAKE_LAUNCH_US each. With NVSHARE_FAKE_TRACE set,
 * every kernel appends "pid device start_ns end_ns" (CLOCK_MONOTONIC) to that file when it runs,
 * in one O_APPEND write so several processes can share the file.
 *
 * Environment: NVSHARE_FAKE_GPU_MEM (bytes, default 16 GiB), NVSHARE_FAKE_GPU_UUID (device 0;
 * device i adds i to the last byte), NVSHARE_FAKE_GPU_COUNT (default 1), NVSHARE_FAKE_LAUNCH_US
 * (default 1000), NVSHARE_FAKE_FAIL_ALLOC_SIZE (an allocation of exactly these bytes fails with
 * CUDA_ERROR_UNKNOWN, to test the hook's rollback).
 * Linked with -Bsymbolic-functions: like the real driver, its internal calls never reach the hook.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../cuda_api.h"
#include "fake_uuid.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVS 8
#define MAX_CTX 256
#define GRANULE (2ull << 20)

struct fake_ctx {
    int dev, alive;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int worker_started;
    unsigned long pending; /* queued or running kernels */
};

struct fake_stream {
    struct fake_ctx *ctx;
};

struct fake_alloc {
    uint64_t magic, bytes;
    int dev;
};
#define ALLOC_MAGIC 0x66616b65616c6c6full

static struct {
    pthread_mutex_t mu;
    int initialised, count;
    uint64_t total, used[MAX_DEVS];
    unsigned char uuid[MAX_DEVS][16];
    long launch_us;
    int trace_fd;
    uint64_t fail_size;
    struct fake_ctx *ctxs[MAX_CTX];
    int nctx;
    struct fake_ctx *primary[MAX_DEVS];
} dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .trace_fd = -1};

static __thread struct fake_ctx *ctx_stack[16];
static __thread int ctx_depth;

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return v != NULL && *v ? strtoull(v, NULL, 0) : dflt;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A forked child has no worker threads: its contexts start with empty queues. */
static void fake_after_fork(void)
{
    pthread_mutex_init(&dev.mu, NULL);
    for (int i = 0; i < dev.nctx; i++) {
        struct fake_ctx *c = dev.ctxs[i];
        pthread_mutex_init(&c->mu, NULL);
        pthread_cond_init(&c->cv, NULL);
        c->worker_started = 0;
        c->pending = 0;
    }
}

EXPORT CUresult cuInit(unsigned flags)
{
    (void)flags;
    pthread_mutex_lock(&dev.mu);
    if (!dev.initialised) {
        pthread_atfork(NULL, NULL, fake_after_fork);
        dev.count = (int)env_u64("NVSHARE_FAKE_GPU_COUNT", 1);
        if (dev.count < 1) dev.count = 1;
        if (dev.count > MAX_DEVS) dev.count = MAX_DEVS;
        dev.total = env_u64("NVSHARE_FAKE_GPU_MEM", 16ull << 30);
        dev.launch_us = (long)env_u64("NVSHARE_FAKE_LAUNCH_US", 1000);
        dev.fail_size = env_u64("NVSHARE_FAKE_FAIL_ALLOC_SIZE", 0);
        const char *trace = getenv("NVSHARE_FAKE_TRACE");
        if (trace != NULL && *trace) dev.trace_fd = open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        unsigned char base[16];
        fake_uuid_bytes(base);
        for (int d = 0; d < dev.count; d++) {
            memcpy(dev.uuid[d], base, 16);
            dev.uuid[d][15] = (unsigned char)(base[15] + d);
        }
        dev.initialised = 1;
    }
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

static int ready(void)
{
    pthread_mutex_lock(&dev.mu);
    int ok = dev.initialised;
    pthread_mutex_unlock(&dev.mu);
    return ok;
}

EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }

EXPORT CUresult cuDeviceGetCount(int *count)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    *count = dev.count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(u->bytes, dev.uuid[d], 16);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = dev.total;
    return CUDA_SUCCESS;
}

/* ---- contexts and the kernel worker ---- */

static struct fake_ctx *new_ctx(int d)
{
    struct fake_ctx *c = calloc(1, sizeof *c);
    c->dev = d;
    c->alive = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_mutex_lock(&dev.mu);
    if (dev.nctx < MAX_CTX) dev.ctxs[dev.nctx++] = c;
    pthread_mutex_unlock(&dev.mu);
    return c;
}

static int valid_ctx(struct fake_ctx *c)
{
    int ok = 0;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < dev.nctx; i++) ok |= dev.ctxs[i] == c && c->alive;
    pthread_mutex_unlock(&dev.mu);
    return ok;
}

static struct fake_ctx *current(void) { return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL; }

static void set_current(struct fake_ctx *c)
{
    if (ctx_depth == 0) ctx_depth = 1;
    ctx_stack[ctx_depth - 1] = c;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d)
{
    (void)flags;
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    struct fake_ctx *c = new_ctx(d);
    if (ctx_depth < 16) ctx_stack[ctx_depth++] = c;
    *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *p, int n, unsigned flags,
                               CUdevice d)
{
    (void)p, (void)n;
    return cuCtxCreate_v2(ctx, flags, d);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *p, unsigned flags, CUdevice d)
{
    (void)p;
    return cuCtxCreate_v2(ctx, flags, d);
}

EXPORT CUresult cuCtxSynchronize(void);

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&c->mu);
    while (c->pending > 0) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&dev.mu);
    c->alive = 0;
    pthread_mutex_unlock(&dev.mu);
    for (int i = 0; i < ctx_depth; i++)
        if (ctx_stack[i] == c) ctx_stack[i] = NULL;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (c != NULL && !valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    set_current(c);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = (CUcontext)current();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth >= 16) return CUDA_ERROR_INVALID_VALUE;
    ctx_stack[ctx_depth++] = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_ctx *c = ctx_stack[--ctx_depth];
    if (ctx != NULL) *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d)
{
    struct fake_ctx *c = current();
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&dev.mu);
    struct fake_ctx *c = dev.primary[d];
    pthread_mutex_unlock(&dev.mu);
    if (c == NULL) {
        c = new_ctx(d);
        pthread_mutex_lock(&dev.mu);
        if (dev.primary[d] == NULL) dev.primary[d] = c;
        c = dev.primary[d];
        pthread_mutex_unlock(&dev.mu);
    }
    *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    return d >= 0 && d < dev.count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static void *worker_main(void *arg)
{
    struct fake_ctx *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (c->pending == 0) pthread_cond_wait(&c->cv, &c->mu);
        pthread_mutex_unlock(&c->mu);
        uint64_t start = now_ns();
        struct timespec ts = {.tv_sec = dev.launch_us / 1000000,
                              .tv_nsec = (dev.launch_us % 1000000) * 1000};
        if (dev.launch_us > 0) nanosleep(&ts, NULL);
        uint64_t end = now_ns();
        if (dev.trace_fd >= 0) {
            char line[96];
            int n = snprintf(line, sizeof line, "%d %d %llu %llu\n", (int)getpid(), c->dev,
                             (unsigned long long)start, (unsigned long long)end);
            ssize_t w = write(dev.trace_fd, line, (size_t)n);
            (void)w;
        }
        pthread_mutex_lock(&c->mu);
        c->pending--;
        pthread_cond_broadcast(&c->cv);
    }
    return NULL;
}

static struct fake_ctx *stream_ctx(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    if (v == 0 || v == 1 || v == 2) return current(); /* default, legacy and per-thread streams */
    return ((struct fake_stream *)s)->ctx;
}

static CUresult launch(CUstream s)
{
    struct fake_ctx *c = stream_ctx(s);
    if (c == NULL || !valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (dev.launch_us == 0 && dev.trace_fd < 0) return CUDA_SUCCESS; /* nothing to wait for */
    pthread_mutex_lock(&c->mu);
    if (!c->worker_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_create(&t, &attr, worker_main, c);
        pthread_attr_destroy(&attr);
        c->worker_started = 1;
    }
    c->pending++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return CUDA_SUCCESS;
}

static CUresult sync_ctx(struct fake_ctx *c)
{
    if (c == NULL || !valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&c->mu);
    while (c->pending > 0) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) { return sync_ctx(current()); }

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    (void)flags;
    struct fake_ctx *c = current();
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_stream *st = calloc(1, sizeof *st);
    st->ctx = c;
    *s = (CUstream)st;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    (void)s; /* streams are kept: a stale handle stays harmless in tests */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream s) { return sync_ctx(stream_ctx(s)); }

EXPORT CUresult cuLaunchKernel(NVS_LAUNCH_ARGS)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)params,
        (void)extra;
    return launch(s);
}
EXPORT CUresult cuLaunchKernel_ptsz(NVS_LAUNCH_ARGS)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **p, void **e)
{
    (void)cfg, (void)f, (void)p, (void)e;
    return launch(NULL);
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **p, void **e)
{
    return cuLaunchKernelEx(cfg, f, p, e);
}
EXPORT CUresult cuLaunchCooperativeKernel(NVS_COOP_ARGS)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(NVS_COOP_ARGS)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *p, unsigned n, unsigned fl)
{
    (void)p, (void)n, (void)fl;
    return launch(NULL);
}
EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    (void)g;
    return launch(s);
}
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return cuGraphLaunch(g, s); }

/* Copies and sets move no bytes: synchronous ones wait for the context, async ones return. */
#define FAKE_SYNC(name, params, args) \
    EXPORT CUresult name params       \
    {                                 \
        (void)(sizeof #args);         \
        return sync_ctx(current());   \
    }
#define FAKE_ASYNC(name, params, args) \
    EXPORT CUresult name params        \
    {                                  \
        return current() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; \
    }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
NVS_SYNC_COPIES(FAKE_SYNC, )
NVS_SYNC_COPIES(FAKE_SYNC, _ptds)
NVS_ASYNC_COPIES(FAKE_ASYNC, )
NVS_ASYNC_COPIES(FAKE_ASYNC, _ptsz)
#pragma GCC diagnostic pop

/* ---- memory: virtual, but counted against the device size at 2 MiB granularity ---- */

static CUresult take(int d, uint64_t requested, uint64_t charge, unsigned long long *handle)
{
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_CONTEXT;
    if (requested == 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev.fail_size != 0 && requested == dev.fail_size) return CUDA_ERROR_UNKNOWN;
    pthread_mutex_lock(&dev.mu);
    if (dev.used[d] + charge > dev.total) {
        pthread_mutex_unlock(&dev.mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    dev.used[d] += charge;
    pthread_mutex_unlock(&dev.mu);
    struct fake_alloc *a = malloc(sizeof *a);
    a->magic = ALLOC_MAGIC;
    a->bytes = charge;
    a->dev = d;
    *handle = (uint64_t)(uintptr_t)a;
    return CUDA_SUCCESS;
}

static CUresult give(uint64_t handle)
{
    struct fake_alloc *a = (struct fake_alloc *)(uintptr_t)handle;
    if (a == NULL || a->magic != ALLOC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    dev.used[a->dev] -= a->bytes;
    pthread_mutex_unlock(&dev.mu);
    a->magic = 0;
    free(a);
    return CUDA_SUCCESS;
}

static int cur_dev(void) { return current() ? current()->dev : -1; }
static uint64_t rounded(uint64_t n) { return (n + GRANULE - 1) / GRANULE * GRANULE; }

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    return take(cur_dev(), bytes, rounded(bytes), p);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
    (void)e;
    *pitch = (w + 511) / 512 * 512;
    return take(cur_dev(), w * h, rounded(*pitch * h), p);
}
/* Managed memory pages in and out on demand: it is not limited by the device size. */
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags)
{
    (void)flags;
    return take(cur_dev(), bytes, 0, p);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s)
{
    struct fake_ctx *c = stream_ctx(s);
    return take(c ? c->dev : -1, bytes, rounded(bytes), p);
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t bytes, CUstream s)
{
    return cuMemAllocAsync(p, bytes, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s)
{
    (void)pool;
    return cuMemAllocAsync(p, bytes, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t bytes, CUmemoryPool pool,
                                             CUstream s)
{
    (void)pool;
    return cuMemAllocAsync(p, bytes, s);
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    (void)flags;
    if (prop == NULL || bytes % GRANULE != 0) return CUDA_ERROR_INVALID_VALUE;
    return take(prop->location.id, bytes, bytes, h);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return give(h); }

static uint64_t elem(unsigned format)
{
    return format == 1 || format == 8 ? 1 : (format == 2 || format == 9 || format == 0x10) ? 2 : 4;
}
static uint64_t extent(size_t w, size_t h, size_t d, unsigned f, unsigned ch)
{
    return (uint64_t)w * (h ? h : 1) * (d ? d : 1) * elem(f) * (ch ? ch : 1);
}

EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    uint64_t bytes = extent(d->Width, d->Height, 0, d->Format, d->NumChannels);
    unsigned long long h = 0;
    CUresult r = take(cur_dev(), bytes, rounded(bytes), &h);
    *a = (CUarray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t bytes = extent(d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
    unsigned long long h = 0;
    CUresult r = take(cur_dev(), bytes, rounded(bytes), &h);
    *a = (CUarray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned levels)
{
    uint64_t bytes = 0;
    unsigned long long h = 0;
    size_t w = d->Width, hh = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        bytes += extent(w, hh, z, d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1;
        hh = hh > 1 ? hh / 2 : hh;
        z = z > 1 ? z / 2 : z;
    }
    CUresult r = take(cur_dev(), bytes, rounded(bytes), &h);
    *a = (CUmipmappedArray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return give((uint64_t)(uintptr_t)a); }
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { return give((uint64_t)(uintptr_t)a); }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return give(p); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    (void)s;
    return give(p);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    int d = cur_dev();
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&dev.mu);
    *free_bytes = dev.total - dev.used[d];
    *total_bytes = dev.total;
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    *p = malloc(bytes ? bytes : 1);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
EXPORT CUresult cuMemFreeHost(void *p)
{
    free(p);
    return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress: a table of our own (dlsym would be answered by the hook) ---- */

struct proc {
    const char *name;
    void *fn;
};
#define P(n) {#n, (void *)&n},
#define P_COPY(n, params, args) P(n)
static const struct proc procs[] = {
    P(cuInit) P(cuDriverGetVersion) P(cuDeviceGetCount) P(cuDeviceGet) P(cuDeviceGetUuid)
    P(cuDeviceGetUuid_v2) P(cuDeviceTotalMem_v2) P(cuCtxCreate_v2) P(cuCtxCreate_v3)
    P(cuCtxCreate_v4) P(cuCtxDestroy_v2) P(cuCtxSetCurrent) P(cuCtxGetCurrent)
    P(cuCtxPushCurrent_v2) P(cuCtxPopCurrent_v2) P(cuCtxGetDevice) P(cuCtxSynchronize)
    P(cuDevicePrimaryCtxRetain) P(cuDevicePrimaryCtxRelease_v2) P(cuStreamCreate)
    P(cuStreamDestroy_v2) P(cuStreamSynchronize) P(cuGetProcAddress) P(cuGetProcAddress_v2)
    P(cuLaunchKernel) P(cuLaunchKernel_ptsz) P(cuLaunchKernelEx) P(cuLaunchKernelEx_ptsz)
    P(cuLaunchCooperativeKernel) P(cuLaunchCooperativeKernel_ptsz)
    P(cuLaunchCooperativeKernelMultiDevice) P(cuGraphLaunch) P(cuGraphLaunch_ptsz)
    NVS_SYNC_COPIES(P_COPY, ) NVS_SYNC_COPIES(P_COPY, _ptds) NVS_ASYNC_COPIES(P_COPY, )
    NVS_ASYNC_COPIES(P_COPY, _ptsz)
    P(cuMemAlloc_v2) P(cuMemAllocPitch_v2) P(cuMemAllocManaged) P(cuMemAllocAsync)
    P(cuMemAllocAsync_ptsz) P(cuMemAllocFromPoolAsync) P(cuMemAllocFromPoolAsync_ptsz)
    P(cuMemCreate) P(cuMemRelease) P(cuArrayCreate_v2) P(cuArray3DCreate_v2)
    P(cuMipmappedArrayCreate) P(cuArrayDestroy) P(cuMipmappedArrayDestroy) P(cuMemFree_v2)
    P(cuMemFreeAsync) P(cuMemFreeAsync_ptsz) P(cuMemGetInfo_v2) P(cuMemHostAlloc)
    P(cuMemFreeHost)
};

static void *find_proc(const char *name)
{
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++)
        if (strcmp(procs[i].name, name) == 0) return procs[i].fn;
    return NULL;
}

/* Like the driver: the newest version of `symbol` (and its per-thread form when asked for). */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    static const char *const plain[] = {"_v4", "_v3", "_v2", ""};
    static const char *const per_thread[] = {"_v2_ptds", "_v2_ptsz", "_ptds", "_ptsz"};
    char name[128];
    void *fn = NULL;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        for (size_t i = 0; i < 4 && fn == NULL; i++) {
            snprintf(name, sizeof name, "%s%s", symbol, per_thread[i]);
            fn = find_proc(name);
        }
    for (size_t i = 0; i < 4 && fn == NULL; i++) {
        if (i < 2 && version < 11040) continue;
        snprintf(name, sizeof name, "%s%s", symbol, plain[i]);
        fn = find_proc(name);
    }
    if (status != NULL) *status = fn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *pfn = fn;
    return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
