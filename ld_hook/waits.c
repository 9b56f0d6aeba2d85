/*
 * Every driver call that waits for the GPU without submitting to it. A thread inside one is
 * waiting for work its process queued, so the holder is not idle meanwhile (gate.h says what
 * idle is): context, stream and event synchronisation mark the thread as waiting on the GPU of
 * their context or stream (an event's GPU is not known: every GPU of the process). Queries that
 * answer "not ready" count as the GPU working for the process: a thread that polls them in a
 * loop waits as surely as one that synchronises. Synchronous copies and sets, stream-ordered
 * waits (cuStreamWaitEvent) and copies that block on pageable memory are submissions (submit.c):
 * their threads carry the in-flight mark instead.
 */
#include "contexts.h"
#include "dispatch.h"
#include "gate.h"

static uint64_t bit_or_all(const struct nvs_gpu *g) { return g != NULL ? g->bit : nvs_gpus_all(); }

static uint64_t ctx_gpus(CUcontext ctx)
{
    if (ctx == NULL) return bit_or_all(nvs_thread_gpu());
    return bit_or_all(nvs_gpu_at(nvs_ctx_device(ctx)));
}

#define NVS_WAIT(name, params, args, gpus)         \
    NVS_EXPORT CUresult name params                 \
    {                                               \
        uint64_t mask_ = (gpus);                    \
        uint64_t before_ = nvs_wait_begin(mask_);   \
        CUresult r_ = NVS_CALL(name, args);         \
        nvs_wait_end(before_, mask_);               \
        return r_;                                  \
    }
NVS_WAIT(cuCtxSynchronize, (void), (), ctx_gpus(NULL))
NVS_WAIT(cuCtxSynchronize_v2, (CUcontext ctx), (ctx), ctx_gpus(ctx))
NVS_WAIT(cuStreamSynchronize, (CUstream s), (s), bit_or_all(nvs_submit_gpu(s)))
NVS_WAIT(cuStreamSynchronize_ptsz, (CUstream s), (s), bit_or_all(nvs_submit_gpu(s)))
NVS_WAIT(cuEventSynchronize, (CUevent e), (e), nvs_gpus_all())

#define NVS_QUERY(name, params, args, gpus)                            \
    NVS_EXPORT CUresult name params                                    \
    {                                                                  \
        CUresult r_ = NVS_CALL(name, args);                            \
        if (r_ == CUDA_ERROR_NOT_READY) nvs_gpus_active(gpus);         \
        return r_;                                                     \
    }
NVS_QUERY(cuStreamQuery, (CUstream s), (s), bit_or_all(nvs_submit_gpu(s)))
NVS_QUERY(cuStreamQuery_ptsz, (CUstream s), (s), bit_or_all(nvs_submit_gpu(s)))
NVS_QUERY(cuEventQuery, (CUevent e), (e), nvs_gpus_all())
