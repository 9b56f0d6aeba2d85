/*
 * Process-level life of the hook: lazy start on the first cuInit (nothing at all happens in a
 * process that never touches CUDA), which GPU each thread submits to, the contexts to synchronise
 * on release, the background service thread (reconnects, idle release) and fork safety.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nvshare.h"

struct nvs_config nvs_cfg;
struct nvs_gpu nvs_gpus[NVS_MAX_GPUS];
atomic_int nvs_ngpus;
_Atomic(struct nvs_gpu *) nvs_single_gpu;
NVS_TLS int nvs_tls_dev = -1;

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int configured, started, atfork_registered;

uint64_t nvs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void copy_env(char *dst, size_t len, const char *name)
{
    const char *v = getenv(name);
    snprintf(dst, len, "%s", v != NULL ? v : "");
}

void nvs_early_init(void)
{
    if (atomic_load_explicit(&configured, memory_order_acquire)) return;
    pthread_mutex_lock(&start_mu);
    if (!atomic_load(&configured)) {
        const char *debug = getenv("NVSHARE_DEBUG");
        nvs_debug_on = debug != NULL && strcmp(debug, "1") == 0;
        const char *dir = getenv("NVSHARE_SOCKET_DIR");
        snprintf(nvs_cfg.socket_path, sizeof nvs_cfg.socket_path, "%s/scheduler.sock",
                 dir != NULL && *dir ? dir : "/var/run/nvshare");
        const char *limit = getenv("NVSHARE_GPU_MEMORY_LIMIT");
        nvs_cfg.env_mem_limit = 0;
        if (limit != NULL && *limit && nvs_parse_bytes(limit, &nvs_cfg.env_mem_limit) != 0) {
            nvs_cfg.env_mem_limit = 0;
            nvs_log("NVSHARE_GPU_MEMORY_LIMIT=%s is not a byte quantity (like 4Gi or 512Mi); "
                    "ignored, the scheduler's limit applies",
                    limit);
        }
        const char *core = getenv("NVSHARE_GPU_CORE_LIMIT");
        long c = core != NULL ? strtol(core, NULL, 10) : 0;
        nvs_cfg.env_core_limit = (c >= 1 && c <= 100) ? (uint32_t)c : 0;
        const char *idle = getenv("NVSHARE_IDLE_RELEASE_MS");
        long ms = idle != NULL ? strtol(idle, NULL, 10) : 0;
        nvs_cfg.idle_release_ms = ms > 0 ? (uint32_t)ms : 0;
        copy_env(nvs_cfg.pod_namespace, sizeof nvs_cfg.pod_namespace, "NVSHARE_POD_NAMESPACE");
        copy_env(nvs_cfg.pod_name, sizeof nvs_cfg.pod_name, "NVSHARE_POD_NAME");
        atomic_store_explicit(&configured, 1, memory_order_release);
    }
    pthread_mutex_unlock(&start_mu);
}

static void init_gpu(struct nvs_gpu *g, int index)
{
    memset(g, 0, sizeof *g);
    g->index = index;
    g->fd = -1;
    g->backoff_ms = 100;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &attr);
    pthread_condattr_destroy(&attr);
}

/* In the child of fork(): no threads, no connection, no lock, no allocations of its own. */
static void after_fork_child(void)
{
    nvs_client_after_fork();
    for (int i = 0; i < NVS_MAX_GPUS; i++) init_gpu(&nvs_gpus[i], i);
    nvs_memory_after_fork();
    pthread_mutex_init(&start_mu, NULL);
    atomic_store(&nvs_single_gpu, NULL);
    atomic_store(&nvs_ngpus, 0);
    atomic_store(&started, 0);
    nvs_tls_dev = -1;
    nvs_notice_reset();
}

static void *service_main(void *arg)
{
    (void)arg;
    for (;;) {
        /* A quarter of the idle window (the environment's, else 50 ms for the policy's). */
        uint32_t tick_ms = nvs_cfg.idle_release_ms ? nvs_cfg.idle_release_ms / 4 : 50;
        if (tick_ms < 5) tick_ms = 5;
        if (tick_ms > 100) tick_ms = 100;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)tick_ms * 1000000L};
        nanosleep(&ts, NULL);
        nvs_service_tick();
    }
    return NULL;
}

void nvs_start(void)
{
    if (atomic_load_explicit(&started, memory_order_acquire)) return;
    nvs_early_init();
    pthread_mutex_lock(&start_mu);
    if (!atomic_load(&started)) {
        int count = 0;
        __typeof__(&cuDeviceGetCount) get_count =
            (__typeof__(&cuDeviceGetCount))nvs_resolve_extra(0, "cuDeviceGetCount");
        if (get_count == NULL || get_count(&count) != CUDA_SUCCESS) count = 0;
        if (count > NVS_MAX_GPUS) count = NVS_MAX_GPUS;
        for (int i = 0; i < NVS_MAX_GPUS; i++) init_gpu(&nvs_gpus[i], i);
        if (!atomic_exchange(&atfork_registered, 1)) pthread_atfork(NULL, NULL, after_fork_child);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (count > 0 && pthread_create(&t, &attr, service_main, NULL) != 0)
            nvs_log("cannot start the service thread; idle release and reconnects are off");
        pthread_attr_destroy(&attr);
        atomic_store(&nvs_ngpus, count);
        if (count == 1) atomic_store(&nvs_single_gpu, &nvs_gpus[0]);
        NVS_DEBUG("started: %d GPU(s), scheduler %s", count, nvs_cfg.socket_path);
        atomic_store_explicit(&started, 1, memory_order_release);
    }
    pthread_mutex_unlock(&start_mu);
}

struct nvs_gpu *nvs_gpu_by_index(int index)
{
    if (index < 0 || index >= atomic_load_explicit(&nvs_ngpus, memory_order_acquire)) return NULL;
    return &nvs_gpus[index];
}

/* Multi-GPU processes: the device of the calling thread's current context, cached per thread. */
struct nvs_gpu *nvs_thread_gpu(void)
{
    if (nvs_tls_dev < 0) {
        if (atomic_load_explicit(&nvs_ngpus, memory_order_acquire) == 0) return NULL;
        __typeof__(&cuCtxGetDevice) get_dev = NVS_EXTRA(cuCtxGetDevice, 0, "cuCtxGetDevice");
        CUdevice d = -1;
        if (get_dev == NULL || get_dev(&d) != CUDA_SUCCESS) return NULL;
        nvs_tls_dev = d;
    }
    return nvs_gpu_by_index(nvs_tls_dev);
}

void nvs_note_ctx(CUcontext ctx, int dev)
{
    struct nvs_gpu *g = nvs_gpu_by_index(dev);
    if (g == NULL || ctx == NULL) return;
    pthread_mutex_lock(&g->mu);
    int known = 0;
    for (int i = 0; i < g->nctx; i++) known |= g->ctxs[i] == ctx;
    if (!known && g->nctx < NVS_MAX_CTX) g->ctxs[g->nctx++] = ctx;
    pthread_mutex_unlock(&g->mu);
}

/* After the thread's current context changed: learn its device (and remember the context). */
void nvs_note_current_ctx(CUcontext ctx)
{
    nvs_tls_dev = -1;
    if (ctx == NULL) return;
    struct nvs_gpu *g = nvs_thread_gpu();
    if (g != NULL) nvs_note_ctx(ctx, g->index);
}

void nvs_forget_ctx(CUcontext ctx)
{
    int n = atomic_load(&nvs_ngpus);
    for (int i = 0; i < n; i++) {
        struct nvs_gpu *g = &nvs_gpus[i];
        pthread_mutex_lock(&g->mu);
        for (int k = 0; k < g->nctx; k++)
            if (g->ctxs[k] == ctx) g->ctxs[k--] = g->ctxs[--g->nctx];
        pthread_mutex_unlock(&g->mu);
    }
    nvs_tls_dev = -1;
}

NVS_EXPORT CUresult cuInit(unsigned flags)
{
    nvs_early_init();
    __typeof__(&cuInit) real = NVS_REAL(cuInit);
    if (real == NULL) return CUDA_ERROR_NOT_FOUND;
    CUresult r = real(flags);
    if (r == CUDA_SUCCESS) nvs_start();
    return r;
}

NVS_EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    CUresult r = NVS_REAL(cuCtxCreate_v2) ? NVS_REAL(cuCtxCreate_v2)(ctx, flags, dev)
                                          : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_current_ctx(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *params, int n,
                                   unsigned flags, CUdevice dev)
{
    CUresult r = NVS_REAL(cuCtxCreate_v3) ? NVS_REAL(cuCtxCreate_v3)(ctx, params, n, flags, dev)
                                          : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_current_ctx(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned flags,
                                   CUdevice dev)
{
    CUresult r = NVS_REAL(cuCtxCreate_v4) ? NVS_REAL(cuCtxCreate_v4)(ctx, params, flags, dev)
                                          : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_current_ctx(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    nvs_forget_ctx(ctx);
    NVS_TAIL(cuCtxDestroy_v2, (ctx));
}

NVS_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = NVS_REAL(cuCtxSetCurrent) ? NVS_REAL(cuCtxSetCurrent)(ctx) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_current_ctx(ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult r =
        NVS_REAL(cuCtxPushCurrent_v2) ? NVS_REAL(cuCtxPushCurrent_v2)(ctx) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_current_ctx(ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    CUresult r =
        NVS_REAL(cuCtxPopCurrent_v2) ? NVS_REAL(cuCtxPopCurrent_v2)(ctx) : CUDA_ERROR_NOT_FOUND;
    nvs_tls_dev = -1;
    return r;
}

NVS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    CUresult r = NVS_REAL(cuDevicePrimaryCtxRetain) ? NVS_REAL(cuDevicePrimaryCtxRetain)(ctx, dev)
                                                    : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) nvs_note_ctx(*ctx, dev);
    return r;
}
