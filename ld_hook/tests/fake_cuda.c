/*
 * A fake libcuda.so.1 for tests on machines without a GPU: in-memory devices that count bytes
 * against their size (fake_memory.c) and run "kernels" on a worker thread per context,
 * asynchronously, for NVSHARE_FAKE_LAUNCH_US each (stream-ordered copies, sets and waits queue
 * such a unit too; stream and event queries answer from what has run). With NVSHARE_FAKE_TRACE set, every kernel
 * appends "pid device start_ns end_ns" (CLOCK_MONOTONIC) to that file when it runs, in one
 * O_APPEND write so several processes can share the file.
 *
 * It keeps the rules the hook must respect: stream capture records work instead of running it,
 * and synchronising a context that is capturing (or, from a thread in global capture mode, any
 * synchronising call while a global capture runs) fails and breaks the capture; graphs reserve
 * their memory at upload or first launch; green contexts, primary-context reset and release are
 * real; contexts destroyed or reset free their memory.
 *
 * Environment: NVSHARE_FAKE_GPU_MEM (bytes, default 16 GiB), NVSHARE_FAKE_GPU_UUID (device 0;
 * device i adds i to the last byte), NVSHARE_FAKE_GPU_COUNT (default 1), NVSHARE_FAKE_LAUNCH_US
 * (default 1000), NVSHARE_FAKE_LAUNCH_JITTER_US (each kernel runs up to this much longer, drawn
 * at random, so work does not line up with the scheduler's deadlines; default 0),
 * NVSHARE_FAKE_SUBMIT_DELAY_US (time a launch spends inside the driver before its
 * kernel is queued, default 0), NVSHARE_FAKE_FAIL_ALLOC_SIZE (an allocation of exactly these
 * bytes fails with CUDA_ERROR_UNKNOWN, to test the hook's rollback).
 * Linked with -Bsymbolic-functions: like the real driver, its internal calls never reach the hook.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "fake_uuid.h"

#define STREAM_MAGIC 0x66616b6573747265ull
#define GREEN_MAGIC 0x66616b6567726565ull
#define MAX_STREAMS 4096

struct fake_device_table dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .trace_fd = -1};

struct fake_green {
    uint64_t magic;
    struct fake_ctx *ctx;
};

static struct fake_stream *streams[MAX_STREAMS];
static int nstreams;
static struct fake_green *greens[FAKE_MAX_CTX]; /* kept, like the contexts they hold */
static int ngreens;

#define CTX_STACK 64
static __thread struct fake_ctx *ctx_stack[CTX_STACK];
static __thread int ctx_depth;
static __thread int capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

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

static void sleep_us(long us)
{
    struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

uint64_t fake_rounded(uint64_t n) { return (n + FAKE_GRANULE - 1) / FAKE_GRANULE * FAKE_GRANULE; }

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
        if (dev.count > FAKE_MAX_DEVS) dev.count = FAKE_MAX_DEVS;
        dev.total = env_u64("NVSHARE_FAKE_GPU_MEM", 16ull << 30);
        dev.launch_us = (long)env_u64("NVSHARE_FAKE_LAUNCH_US", 1000);
        dev.launch_jitter_us = (long)env_u64("NVSHARE_FAKE_LAUNCH_JITTER_US", 0);
        dev.submit_delay_us = (long)env_u64("NVSHARE_FAKE_SUBMIT_DELAY_US", 0);
        dev.fail_size = env_u64("NVSHARE_FAKE_FAIL_ALLOC_SIZE", 0);
        dev.coll_dir = getenv("NVSHARE_FAKE_COLLECTIVE_DIR");
        dev.coll_ranks = env_u64("NVSHARE_FAKE_COLLECTIVE_RANKS", 1);
        const char *trace = getenv("NVSHARE_FAKE_TRACE");
        if (trace != NULL && *trace)
            dev.trace_fd = open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        unsigned char base[16];
        fake_uuid_bytes(base);
        for (int d = 0; d < dev.count; d++) {
            memcpy(dev.uuid[d], base, 16);
            dev.uuid[d][15] = (unsigned char)(base[15] + d);
        }
        fake_memory_init();
        dev.initialised = 1;
    }
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

int fake_ready(void)
{
    pthread_mutex_lock(&dev.mu);
    int ok = dev.initialised;
    pthread_mutex_unlock(&dev.mu);
    return ok;
}

EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }

EXPORT CUresult cuDeviceGetCount(int *count)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    *count = dev.count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(u->bytes, dev.uuid[d], 16);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
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
    if (dev.nctx < FAKE_MAX_CTX) dev.ctxs[dev.nctx++] = c;
    pthread_mutex_unlock(&dev.mu);
    return c;
}

int fake_valid_ctx(struct fake_ctx *c)
{
    int ok = 0;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < dev.nctx; i++) ok |= dev.ctxs[i] == c && c->alive;
    pthread_mutex_unlock(&dev.mu);
    return ok;
}

struct fake_ctx *fake_current(void) { return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL; }

static void set_current(struct fake_ctx *c)
{
    if (ctx_depth == 0) ctx_depth = 1;
    ctx_stack[ctx_depth - 1] = c;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d)
{
    (void)flags;
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    struct fake_ctx *c = new_ctx(d);
    if (ctx_depth < CTX_STACK) ctx_stack[ctx_depth++] = c;
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

static void drain(struct fake_ctx *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->pending > 0) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* The context and everything allocated in it are gone. */
static void destroy_ctx(struct fake_ctx *c)
{
    drain(c);
    pthread_mutex_lock(&dev.mu);
    c->alive = 0;
    pthread_mutex_unlock(&dev.mu);
    fake_free_ctx_memory(c);
    for (int i = 0; i < ctx_depth; i++)
        if (ctx_stack[i] == c) ctx_stack[i] = NULL;
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    destroy_ctx(c);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (c != NULL && !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    set_current(c);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = (CUcontext)fake_current();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth >= CTX_STACK) return CUDA_ERROR_INVALID_VALUE;
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
    struct fake_ctx *c = fake_current();
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice_v2(CUdevice *d, CUcontext ctx)
{
    struct fake_ctx *c = ctx != NULL ? (struct fake_ctx *)ctx : fake_current();
    if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
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
    pthread_mutex_lock(&dev.mu);
    dev.primary_refs[d]++;
    pthread_mutex_unlock(&dev.mu);
    *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

/* Reset destroys the primary context now; release does when the last reference goes. */
static CUresult end_primary(CUdevice d, int reset)
{
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&dev.mu);
    struct fake_ctx *c = dev.primary[d];
    if (!reset && dev.primary_refs[d] > 0) dev.primary_refs[d]--;
    int gone = c != NULL && (reset || dev.primary_refs[d] == 0);
    if (gone) {
        dev.primary[d] = NULL;
        dev.primary_refs[d] = 0;
    }
    pthread_mutex_unlock(&dev.mu);
    if (gone) destroy_ctx(c);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return end_primary(d, 0); }
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) { return end_primary(d, 1); }

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active)
{
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&dev.mu);
    *flags = 0;
    *active = dev.primary[d] != NULL;
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

/* Green contexts: a context of their own, never current, reached through their streams. */
EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *green, CUdevResourceDesc desc, CUdevice d,
                                 unsigned flags)
{
    (void)desc, (void)flags;
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    struct fake_green *g = calloc(1, sizeof *g);
    g->magic = GREEN_MAGIC;
    g->ctx = new_ctx(d);
    pthread_mutex_lock(&dev.mu);
    if (ngreens < FAKE_MAX_CTX) greens[ngreens++] = g;
    pthread_mutex_unlock(&dev.mu);
    *green = (CUgreenCtx)g;
    return CUDA_SUCCESS;
}

static struct fake_green *green_of(CUgreenCtx green)
{
    struct fake_green *g = (struct fake_green *)green;
    return g != NULL && g->magic == GREEN_MAGIC ? g : NULL;
}

EXPORT CUresult cuCtxFromGreenCtx(CUcontext *ctx, CUgreenCtx green)
{
    struct fake_green *g = green_of(green);
    if (g == NULL) return CUDA_ERROR_INVALID_HANDLE;
    *ctx = (CUcontext)g->ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx green)
{
    struct fake_green *g = green_of(green);
    if (g == NULL) return CUDA_ERROR_INVALID_HANDLE;
    destroy_ctx(g->ctx);
    g->magic = 0;
    return CUDA_SUCCESS;
}

/*
 * A collective (like NCCL's kernels) runs on every rank's GPU at once: the kernel of collective n
 * starts, then waits until every rank's kernel of collective n has started
 * (NVSHARE_FAKE_COLLECTIVE_DIR/n holds a byte per rank that got there).
 */
static void meet(uint64_t n)
{
    if (dev.coll_dir == NULL || *dev.coll_dir == '\0') return;
    char path[512];
    snprintf(path, sizeof path, "%s/%llu", dev.coll_dir, (unsigned long long)n);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, "x", 1);
    (void)w;
    close(fd);
    struct stat st;
    while (stat(path, &st) == 0 && (uint64_t)st.st_size < dev.coll_ranks) sleep_us(100);
}

/* With c->mu held: the number of the collective that the next kernel to run is, or 0. */
static uint64_t next_collective(struct fake_ctx *c)
{
    if (c->coll_head == c->coll_tail || c->coll_at[c->coll_head % FAKE_COLL_RING] != c->executed)
        return 0;
    return c->coll_num[c->coll_head++ % FAKE_COLL_RING];
}

static void *worker_main(void *arg)
{
    struct fake_ctx *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (c->pending == 0) pthread_cond_wait(&c->cv, &c->mu);
        uint64_t coll = next_collective(c);
        pthread_mutex_unlock(&c->mu);
        if (coll) meet(coll);
        uint64_t start = now_ns();
        long jitter = dev.launch_jitter_us > 0 ? (long)(start / 1000 % (uint64_t)dev.launch_jitter_us) : 0;
        if (dev.launch_us + jitter > 0) sleep_us(dev.launch_us + jitter);
        uint64_t end = now_ns();
        if (dev.trace_fd >= 0) {
            char line[96];
            int n = snprintf(line, sizeof line, "%d %d %llu %llu\n", (int)getpid(), c->dev,
                             (unsigned long long)start, (unsigned long long)end);
            ssize_t w = write(dev.trace_fd, line, (size_t)n);
            (void)w;
        }
        pthread_mutex_lock(&c->mu);
        c->executed++;
        c->pending--;
        pthread_cond_broadcast(&c->cv);
    }
    return NULL;
}

/* ---- streams and captures ---- */

struct fake_stream *fake_stream(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    if (v <= 2) return NULL; /* default, legacy and per-thread streams */
    struct fake_stream *fs = (struct fake_stream *)s;
    return fs->magic == STREAM_MAGIC ? fs : NULL;
}

struct fake_ctx *fake_stream_ctx(CUstream s)
{
    struct fake_stream *fs = fake_stream(s);
    return fs != NULL ? fs->ctx : fake_current();
}

static CUresult new_stream(CUstream *s, struct fake_ctx *c)
{
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_stream *st = calloc(1, sizeof *st);
    st->magic = STREAM_MAGIC;
    st->ctx = c;
    pthread_mutex_lock(&dev.mu);
    if (nstreams < MAX_STREAMS) streams[nstreams++] = st;
    pthread_mutex_unlock(&dev.mu);
    *s = (CUstream)st;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    (void)flags;
    return new_stream(s, fake_current());
}

EXPORT CUresult cuGreenCtxStreamCreate(CUstream *s, CUgreenCtx green, unsigned flags, int priority)
{
    (void)flags, (void)priority;
    struct fake_green *g = green_of(green);
    return g != NULL ? new_stream(s, g->ctx) : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    (void)s; /* streams are kept: a stale handle stays harmless in tests */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx)
{
    struct fake_ctx *c = fake_stream_ctx(s);
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

static CUresult begin_capture(CUstream s, CUstreamCaptureMode mode)
{
    struct fake_stream *fs = fake_stream(s);
    if (fs == NULL) return CUDA_ERROR_INVALID_VALUE; /* the legacy stream cannot be captured */
    pthread_mutex_lock(&dev.mu);
    CUresult r = CUDA_SUCCESS;
    if (fs->capturing) {
        r = 401; /* CUDA_ERROR_ILLEGAL_STATE */
    } else {
        fs->capturing = 1;
        fs->invalidated = 0;
        fs->mode = mode;
        fs->graph = fake_graph_new(fs->ctx->dev);
        fs->graph->captured = 1;
        if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) dev.global_captures++;
    }
    pthread_mutex_unlock(&dev.mu);
    return r;
}

EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, mode);
}
EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, mode);
}
EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph graph, const CUgraphNode *deps,
                                            const CUgraphEdgeData *edges, size_t n,
                                            CUstreamCaptureMode mode)
{
    (void)graph, (void)deps, (void)edges, (void)n;
    return begin_capture(s, mode);
}
EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph graph, const CUgraphNode *deps,
                                                 const CUgraphEdgeData *edges, size_t n,
                                                 CUstreamCaptureMode mode)
{
    return cuStreamBeginCaptureToGraph(s, graph, deps, edges, n, mode);
}

EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph)
{
    struct fake_stream *fs = fake_stream(s);
    if (fs == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    CUresult r = CUDA_SUCCESS;
    if (!fs->capturing) {
        r = 401;
    } else {
        fs->capturing = 0;
        if (fs->mode == CU_STREAM_CAPTURE_MODE_GLOBAL) dev.global_captures--;
        *graph = fs->invalidated ? NULL : (CUgraph)fs->graph;
        r = fs->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
        fs->graph = NULL;
    }
    pthread_mutex_unlock(&dev.mu);
    return r;
}
EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *graph)
{
    return cuStreamEndCapture(s, graph);
}

EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status)
{
    struct fake_stream *fs = fake_stream(s);
    pthread_mutex_lock(&dev.mu);
    *status = fs == NULL || !fs->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
              : fs->invalidated            ? 2 /* CU_STREAM_CAPTURE_STATUS_INVALIDATED */
                                           : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult fake_sync_allowed(struct fake_ctx *c, struct fake_stream *only)
{
    int broken = 0;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < nstreams; i++) {
        struct fake_stream *fs = streams[i];
        int own = only != NULL ? fs == only : fs->ctx == c;
        int global = fs->mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
                     capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED;
        if (fs->capturing && !fs->invalidated && (own || global)) {
            fs->invalidated = 1;
            broken = 1;
        }
    }
    pthread_mutex_unlock(&dev.mu);
    return broken ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* ---- work ---- */

/* Queue one kernel on s (or record it, when s is capturing); wait: return once it has run. */
static CUresult launch_kind(CUstream s, int collective, int wait)
{
    struct fake_ctx *c = fake_stream_ctx(s);
    if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_stream *fs = fake_stream(s);
    if (fs != NULL && fs->capturing) {
        pthread_mutex_lock(&dev.mu);
        CUresult r = fs->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
        if (r == CUDA_SUCCESS) fake_graph_add(fs->graph, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_KERNEL});
        pthread_mutex_unlock(&dev.mu);
        return r;
    }
    if (dev.submit_delay_us > 0) sleep_us(dev.submit_delay_us);
    if (dev.launch_us == 0 && dev.trace_fd < 0 && !collective) return CUDA_SUCCESS; /* nothing to wait for */
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
    if (collective) {
        while (c->coll_tail - c->coll_head >= FAKE_COLL_RING) pthread_cond_wait(&c->cv, &c->mu);
        c->coll_at[c->coll_tail % FAKE_COLL_RING] = c->launched;
        c->coll_num[c->coll_tail++ % FAKE_COLL_RING] = __atomic_add_fetch(&dev.collectives, 1, __ATOMIC_SEQ_CST);
    }
    uint64_t ticket = ++c->launched;
    if (fs != NULL) fs->last = ticket;
    c->pending++;
    pthread_cond_broadcast(&c->cv);
    while (wait && c->executed < ticket) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return CUDA_SUCCESS;
}

static CUresult launch(CUstream s) { return launch_kind(s, 0, 0); }
CUresult fake_run(CUstream s, int wait) { return launch_kind(s, 0, wait); }

/* A kernel in the remote memory-synchronisation domain is a collective, as NCCL's are. */
static int is_collective(const CUlaunchConfig *cfg)
{
    const CUlaunchAttribute *a = cfg != NULL ? cfg->attrs : NULL;
    for (unsigned i = 0; a != NULL && i < cfg->numAttrs; i++)
        if (a[i].id == CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN)
            return a[i].value.memSyncDomain == CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE;
    return 0;
}

static CUresult sync_ctx(struct fake_ctx *c, struct fake_stream *only)
{
    if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = fake_sync_allowed(c, only);
    if (r != CUDA_SUCCESS) return r;
    drain(c);
    fake_release_pools(c->dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) { return sync_ctx(fake_current(), NULL); }
EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) { return sync_ctx((struct fake_ctx *)ctx, NULL); }
EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    struct fake_stream *fs = fake_stream(s);
    return sync_ctx(fake_stream_ctx(s), fs);
}
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { return cuStreamSynchronize(s); }

/* Not ready while work queued on s (on a default stream: in its context) has not run. */
EXPORT CUresult cuStreamQuery(CUstream s)
{
    struct fake_ctx *c = fake_stream_ctx(s);
    if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_stream *fs = fake_stream(s);
    pthread_mutex_lock(&c->mu);
    int done = c->executed >= (fs != NULL ? fs->last : c->launched);
    pthread_mutex_unlock(&c->mu);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
EXPORT CUresult cuStreamQuery_ptsz(CUstream s) { return cuStreamQuery(s); }

/* An event completes when the kernels queued in its context before it was recorded have run. */
#define EVENT_MAGIC 0x66616b656576656eull
struct fake_event {
    uint64_t magic;
    struct fake_ctx *ctx;
    uint64_t after; /* the context's kernels launched when it was recorded */
};

static struct fake_event *fake_event(CUevent e)
{
    struct fake_event *fe = (struct fake_event *)e;
    return fe != NULL && fe->magic == EVENT_MAGIC ? fe : NULL;
}

EXPORT CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    struct fake_ctx *c = fake_current();
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_event *fe = calloc(1, sizeof *fe);
    if (fe == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *fe = (struct fake_event){.magic = EVENT_MAGIC, .ctx = c};
    *e = (CUevent)fe;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream s)
{
    struct fake_event *fe = fake_event(e);
    if (fe == NULL || fake_stream_ctx(s) != fe->ctx) return CUDA_ERROR_INVALID_HANDLE;
    struct fake_stream *fs = fake_stream(s);
    if (fs != NULL && fs->capturing) { /* recorded into the graph, as CUDA does */
        pthread_mutex_lock(&dev.mu);
        fake_graph_add(fs->graph, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_EVENT_RECORD});
        pthread_mutex_unlock(&dev.mu);
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&fe->ctx->mu);
    fe->after = fe->ctx->launched;
    pthread_mutex_unlock(&fe->ctx->mu);
    return CUDA_SUCCESS;
}

/* For the tests: the kernels the current context has queued that have not run yet. */
EXPORT unsigned long long fake_queued(void)
{
    struct fake_ctx *c = fake_current();
    if (c == NULL) return 0;
    pthread_mutex_lock(&c->mu);
    unsigned long long n = c->launched - c->executed;
    pthread_mutex_unlock(&c->mu);
    return n;
}

EXPORT CUresult cuEventSynchronize(CUevent e)
{
    struct fake_event *fe = fake_event(e);
    if (fe == NULL) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&fe->ctx->mu);
    while (fe->ctx->executed < fe->after) pthread_cond_wait(&fe->ctx->cv, &fe->ctx->mu);
    pthread_mutex_unlock(&fe->ctx->mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent e)
{
    struct fake_event *fe = fake_event(e);
    if (fe == NULL) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&fe->ctx->mu);
    int done = fe->ctx->executed >= fe->after;
    pthread_mutex_unlock(&fe->ctx->mu);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    struct fake_event *fe = fake_event(e);
    if (fe == NULL) return CUDA_ERROR_INVALID_HANDLE;
    fe->magic = 0;
    free(fe);
    return CUDA_SUCCESS;
}

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
    (void)f, (void)p, (void)e;
    return launch_kind(cfg != NULL ? cfg->hStream : NULL, is_collective(cfg), 0);
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
    (void)fl;
    for (unsigned i = 0; i < n; i++) {
        CUresult r = launch(p[i].hStream);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunch(CUfunction f)
{
    (void)f;
    return launch(NULL);
}
EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    (void)f, (void)w, (void)h;
    return launch(NULL);
}
EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    (void)f, (void)w, (void)h;
    return launch(s);
}

/* Copies and sets move no bytes. Synchronous ones wait for the context; stream-ordered ones
 * queue one unit of work on their stream (a kernel's time) and return, except those to or from
 * pageable host memory, which return once it has run (fake_copies.c: they replace these weak
 * definitions, as the real driver stages such copies). */
#define FAKE_SYNC(name, params, args)                              \
    EXPORT CUresult name params                                    \
    {                                                              \
        (void)(sizeof #args);                                      \
        struct fake_ctx *c = fake_current();                       \
        if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT; \
        drain(c);                                                  \
        return CUDA_SUCCESS;                                       \
    }
#define FAKE_ASYNC(name, params, args) \
    EXPORT __attribute__((weak)) CUresult name params { return fake_run(st, 0); }
/* The other stream-ordered submissions queue one unit of work each. */
#define FAKE_STREAM_OP(name, params, args) \
    EXPORT CUresult name params { return launch(st); }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
NVS_SYNC_COPIES(FAKE_SYNC, )
NVS_SYNC_COPIES(FAKE_SYNC, _ptds)
NVS_ASYNC_COPIES(FAKE_ASYNC, )
NVS_ASYNC_COPIES(FAKE_ASYNC, _ptsz)
NVS_STREAM_OPS(FAKE_STREAM_OP, )
NVS_STREAM_OPS(FAKE_STREAM_OP, _ptsz)
#pragma GCC diagnostic pop

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
    P(cuDevicePrimaryCtxRetain) P(cuDevicePrimaryCtxRelease_v2) P(cuDevicePrimaryCtxReset_v2)
    P(cuStreamCreate) P(cuStreamDestroy_v2) P(cuStreamSynchronize) P(cuGetProcAddress)
    P(cuGetProcAddress_v2) P(cuStreamBeginCapture_v2) P(cuStreamEndCapture)
    P(cuStreamIsCapturing) P(cuGraphInstantiateWithFlags) P(cuEventCreate) P(cuEventRecord)
    P(cuEventSynchronize) P(cuEventDestroy_v2) P(cuCtxSynchronize_v2)
    P(cuStreamSynchronize_ptsz) P(cuStreamQuery) P(cuStreamQuery_ptsz) P(cuEventQuery)
    P(cuLaunchKernel) P(cuLaunchKernel_ptsz) P(cuLaunchKernelEx) P(cuLaunchKernelEx_ptsz)
    P(cuLaunchCooperativeKernel) P(cuLaunchCooperativeKernel_ptsz)
    P(cuLaunchCooperativeKernelMultiDevice) P(cuGraphLaunch) P(cuGraphLaunch_ptsz)
    P(cuGraphUpload) P(cuGraphUpload_ptsz) P(cuGraphInstantiate) P(cuGraphInstantiate_v2)
    P(cuGraphInstantiateWithParams) P(cuGraphInstantiateWithParams_ptsz) P(cuGraphExecDestroy)
    P(cuDeviceGraphMemTrim) P(cuDeviceGetGraphMemAttribute) P(cuGraphGetNodes)
    P(cuGraphNodeGetType) P(cuGraphMemAllocNodeGetParams) P(cuGraphChildGraphNodeGetGraph)
    P(cuGraphNodeGetDependencies) P(cuGraphMemFreeNodeGetParams)
    NVS_SYNC_COPIES(P_COPY, ) NVS_SYNC_COPIES(P_COPY, _ptds) NVS_ASYNC_COPIES(P_COPY, )
    NVS_ASYNC_COPIES(P_COPY, _ptsz) NVS_STREAM_OPS(P_COPY, ) NVS_STREAM_OPS(P_COPY, _ptsz)
    P(cuMemAlloc_v2) P(cuMemAllocPitch_v2) P(cuMemAllocManaged) P(cuMemAllocAsync)
    P(cuMemAllocAsync_ptsz) P(cuMemAllocFromPoolAsync) P(cuMemAllocFromPoolAsync_ptsz)
    P(cuMemCreate) P(cuMemRelease) P(cuMemMap) P(cuMemUnmap) P(cuMemRetainAllocationHandle)
    P(cuArrayCreate_v2) P(cuArray3DCreate_v2)
    P(cuMipmappedArrayCreate) P(cuArrayDestroy) P(cuMipmappedArrayDestroy) P(cuMemFree_v2)
    P(cuMemFreeAsync) P(cuMemFreeAsync_ptsz) P(cuMemGetInfo_v2) P(cuMemHostAlloc)
    P(cuMemFreeHost) P(cuMemPoolCreate) P(cuMemPoolDestroy)
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
    if (version >= 12000 && strcmp(symbol, "cuGraphInstantiate") == 0) /* cuda.h 12's mapping */
        symbol = "cuGraphInstantiateWithFlags";
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
