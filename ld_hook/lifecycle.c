/*
 * The process's CUDA life as the hook follows it: lazy start on the first cuInit (nothing at all
 * happens in a process that never touches CUDA), contexts created, made current, destroyed and
 * reset (their allocations are gone with them), green contexts, streams going away, and fork
 * (the child starts with no threads, no connection, no lock and no allocations of its own).
 */
#include <pthread.h>
#include <stdatomic.h>

#include "alloc.h"
#include "allocmap.h"
#include "capture.h"
#include "config.h"
#include "conn.h"
#include "contexts.h"
#include "dispatch.h"
#include "fallback.h"
#include "gate.h"
#include "ledger.h"
#include "pace.h"
#include "log.h"
#include "pools.h"
#include "session.h"
#include "shown.h"

static atomic_int atfork_registered;

static void after_fork_child(void)
{
    nvs_config_after_fork();
    nvs_conn_after_fork();
    nvs_gpus_after_fork();
    nvs_gpus_init(0);
    nvs_contexts_after_fork();
    nvs_capture_after_fork();
    nvs_pace_after_fork();
    nvs_allocmap_after_fork();
    nvs_pools_after_fork();
    nvs_ledger_after_fork();
    nvs_shown_after_fork();
    nvs_fallback_after_fork();
    nvs_gate_after_fork();
    nvs_session_after_fork();
    nvs_notice_reset();
}

NVS_EXPORT CUresult cuInit(unsigned flags)
{
    nvs_config_load();
    if (nvs_cfg.refuse_cuda) return CUDA_ERROR_INVALID_VALUE; /* config.c said why, once */
    if (!atomic_exchange(&atfork_registered, 1)) pthread_atfork(NULL, NULL, after_fork_child);
    CUresult r = NVS_CALL(cuInit, (flags));
    if (r == CUDA_SUCCESS) nvs_start();
    return r;
}

/* After the thread's current context changed: learn its device and remember the context. */
static void now_current(CUcontext ctx)
{
    nvs_thread_ctx_changed();
    if (ctx == NULL) return;
    struct nvs_gpu *g = nvs_thread_gpu();
    if (g != NULL) nvs_ctx_note(ctx, g->index, NVS_CTX_PLAIN);
}

NVS_EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    CUresult r = NVS_CALL(cuCtxCreate_v2, (ctx, flags, dev));
    if (r == CUDA_SUCCESS) now_current(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *params, int n,
                                   unsigned flags, CUdevice dev)
{
    CUresult r = NVS_CALL(cuCtxCreate_v3, (ctx, params, n, flags, dev));
    if (r == CUDA_SUCCESS) now_current(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned flags,
                                   CUdevice dev)
{
    CUresult r = NVS_CALL(cuCtxCreate_v4, (ctx, params, flags, dev));
    if (r == CUDA_SUCCESS) now_current(*ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = NVS_CALL(cuCtxSetCurrent, (ctx));
    if (r == CUDA_SUCCESS) now_current(ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult r = NVS_CALL(cuCtxPushCurrent_v2, (ctx));
    if (r == CUDA_SUCCESS) now_current(ctx);
    return r;
}

NVS_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    CUresult r = NVS_CALL(cuCtxPopCurrent_v2, (ctx));
    nvs_thread_ctx_changed();
    return r;
}

NVS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    CUresult r = NVS_CALL(cuDevicePrimaryCtxRetain, (ctx, dev));
    if (r == CUDA_SUCCESS) nvs_ctx_note(*ctx, dev, NVS_CTX_PRIMARY);
    return r;
}

/* A context is gone: forget it, and the memory made in it is free again. */
static void context_gone(CUcontext ctx, int dev)
{
    if (ctx == NULL) return;
    nvs_ctx_forget(ctx);
    nvs_alloc_forget_ctx(ctx);
    nvs_pools_settle(nvs_gpu_at(dev));
    nvs_thread_ctx_changed();
}

NVS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    int dev = nvs_ctx_device(ctx);
    CUresult r = NVS_CALL(cuCtxDestroy_v2, (ctx));
    if (r == CUDA_SUCCESS) context_gone(ctx, dev);
    return r;
}

/* cudaDeviceReset comes here: every allocation of the primary context is freed. */
NVS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CUcontext primary = nvs_ctx_primary(dev);
    CUresult r = NVS_CALL(cuDevicePrimaryCtxReset_v2, (dev));
    if (r == CUDA_SUCCESS) context_gone(primary, dev);
    return r;
}

/* The last release destroys the primary context (and what was allocated in it). */
NVS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUcontext primary = nvs_ctx_primary(dev);
    CUresult r = NVS_CALL(cuDevicePrimaryCtxRelease_v2, (dev));
    unsigned flags = 0;
    int active = 1;
    if (r == CUDA_SUCCESS && NVS_CALL(cuDevicePrimaryCtxGetState, (dev, &flags, &active)) == CUDA_SUCCESS &&
        !active)
        context_gone(primary, dev);
    return r;
}

NVS_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *green, CUdevResourceDesc desc, CUdevice dev,
                                     unsigned flags)
{
    CUresult r = NVS_CALL(cuGreenCtxCreate, (green, desc, dev, flags));
    CUcontext ctx = NULL;
    if (r == CUDA_SUCCESS && NVS_CALL(cuCtxFromGreenCtx, (&ctx, *green)) == CUDA_SUCCESS)
        nvs_ctx_note(ctx, dev, NVS_CTX_GREEN);
    return r;
}

NVS_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx green)
{
    CUcontext ctx = NULL;
    if (NVS_CALL(cuCtxFromGreenCtx, (&ctx, green)) != CUDA_SUCCESS) ctx = NULL;
    int dev = nvs_ctx_device(ctx);
    CUresult r = NVS_CALL(cuGreenCtxDestroy, (green));
    if (r == CUDA_SUCCESS) context_gone(ctx, dev);
    return r;
}

NVS_EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    CUresult r = NVS_CALL(cuStreamDestroy_v2, (s));
    nvs_streams_changed();
    return r;
}
