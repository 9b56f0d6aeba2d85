/*
 * Every submission path: kernel launches (current, cooperative, legacy), graph launches and
 * uploads, copies and sets, and the other stream-ordered work (batched copies, prefetch, stream
 * memory operations, sparse mapping, external semaphores, host functions). Each passes the gate
 * of the GPU its stream belongs to (the calling thread's current device for the default
 * streams), and stays marked in flight until the driver call returns.
 */
#include "capture.h"
#include "contexts.h"
#include "cut.h"
#include "dispatch.h"
#include "gate.h"
#include "graphs.h"
#include "pace.h"

#define NVS_GATED_ON(name, params, args, stream)              \
    NVS_EXPORT CUresult name params                           \
    {                                                         \
        CUstream s_ = (stream);                               \
        struct nvs_thread *t_ = nvs_gate_enter(nvs_submit_gpu(s_), s_); \
        CUresult r_ = NVS_CALL(name, args);                   \
        nvs_gate_exit(t_);                                    \
        return r_;                                            \
    }
/* Synchronous copies and sets use the current context's default stream, and wait for the work
 * queued before them: a holder inside one is busy (its in-flight mark says so, gate.h). So does
 * a stream-ordered copy to or from pageable memory, which blocks the same way. */
#define NVS_GATED_SYNC(name, params, args) NVS_GATED_ON(name, params, args, NULL)
/* stream-ordered ones name their stream `st` */
#define NVS_GATED_STREAM(name, params, args) NVS_GATED_ON(name, params, args, st)

/* Kernel and graph launches are paced besides (pace.h): the event behind one goes on the stream
 * it went to, `on` (a _ptsz entry point's default stream is the thread's own). */
#define NVS_PACED(g, s, on, call)                                   \
    ({                                                              \
        if (nvs_paced(g)) nvs_pace_before(g);                       \
        struct nvs_thread *t_ = nvs_gate_enter((g), (s));           \
        CUresult r_ = (call);                                       \
        nvs_gate_exit(t_);                                          \
        if (nvs_paced(g) && r_ == CUDA_SUCCESS) nvs_pace_after((g), (on)); \
        r_;                                                         \
    })
#define NVS_PACED_ON(name, params, args, stream, on)                \
    NVS_EXPORT CUresult name params                                 \
    {                                                               \
        CUstream s_ = (stream);                                     \
        struct nvs_gpu *g_ = nvs_submit_gpu(s_);                    \
        return NVS_PACED(g_, s_, (on), NVS_CALL(name, args));       \
    }
static inline CUstream nvs_ptsz(CUstream s) { return s != NULL ? s : NVS_STREAM_PER_THREAD; }

#define NVS_LAUNCH_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra)
#define NVS_COOP_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params)
#define NVS_EX_PARAMS (const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)

NVS_PACED_ON(cuLaunchKernel, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL, s, s)
NVS_PACED_ON(cuLaunchKernel_ptsz, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL, s, nvs_ptsz(s))
/* A launch with attributes may be a collective (cut.h): counted, and held while a gang stops.
 * One recorded into a capture runs later, with its graph: not counted. */
#define NVS_LAUNCH_EX(name, on)                                                  \
    NVS_EXPORT CUresult name NVS_EX_PARAMS                                       \
    {                                                                            \
        CUstream s = cfg ? cfg->hStream : NULL;                                  \
        struct nvs_gpu *g = nvs_submit_gpu(s);                                   \
        int coll = g != NULL && nvs_is_collective(cfg) &&                     \
                   !(nvs_capture_active(g) > 0 && nvs_stream_capturing(s));     \
        if (NVS_UNLIKELY(coll)) nvs_cut_begin(g);                                \
        CUresult r = NVS_PACED(g, s, (on), NVS_CALL(name, (cfg, f, params, extra))); \
        if (NVS_UNLIKELY(coll) && nvs_cut_end(g)) nvs_gate_on_cut_reached(g);    \
        return r;                                                                \
    }
NVS_LAUNCH_EX(cuLaunchKernelEx, s)
NVS_LAUNCH_EX(cuLaunchKernelEx_ptsz, nvs_ptsz(s))
NVS_PACED_ON(cuLaunchCooperativeKernel, (NVS_COOP_ARGS), NVS_COOP_CALL, s, s)
NVS_PACED_ON(cuLaunchCooperativeKernel_ptsz, (NVS_COOP_ARGS), NVS_COOP_CALL, s, nvs_ptsz(s))
NVS_PACED_ON(cuLaunch, (CUfunction f), (f), NULL, NULL)
NVS_PACED_ON(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h), NULL, NULL)
NVS_PACED_ON(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s), s, s)

NVS_SYNC_COPIES(NVS_GATED_SYNC, )
NVS_SYNC_COPIES(NVS_GATED_SYNC, _ptds)
NVS_ASYNC_COPIES(NVS_GATED_STREAM, )
NVS_ASYNC_COPIES(NVS_GATED_STREAM, _ptsz)
NVS_STREAM_OPS(NVS_GATED_STREAM, )
NVS_STREAM_OPS(NVS_GATED_STREAM, _ptsz)

/* An upload or launch may make the driver reserve the graph's memory (graphs.h): checked
 * against the limit before, settled after. */
#define NVS_GRAPH_RUN(name, on)                                          \
    NVS_EXPORT CUresult name(CUgraphExec g, CUstream s)                  \
    {                                                                    \
        if (nvs_graph_admit(g, s) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY; \
        struct nvs_gpu *gpu = nvs_submit_gpu(s);                         \
        CUresult r = NVS_PACED(gpu, s, (on), NVS_CALL(name, (g, s)));    \
        nvs_graph_ran(g, s, r);                                          \
        return r;                                                        \
    }
NVS_GRAPH_RUN(cuGraphLaunch, s)
NVS_GRAPH_RUN(cuGraphLaunch_ptsz, nvs_ptsz(s))
NVS_GRAPH_RUN(cuGraphUpload, s)
NVS_GRAPH_RUN(cuGraphUpload_ptsz, nvs_ptsz(s))

/* A launch across several GPUs: every gate it touches must be open at once. */
NVS_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *p, unsigned n,
                                                         unsigned flags)
{
    uint64_t mask = 0;
    for (unsigned i = 0; p != NULL && i < n; i++) {
        struct nvs_gpu *g = nvs_stream_gpu(p[i].hStream);
        if (g != NULL) mask |= g->bit;
    }
    struct nvs_thread *t = mask ? nvs_gate_enter_many(mask) : NULL;
    CUresult r = NVS_CALL(cuLaunchCooperativeKernelMultiDevice, (p, n, flags));
    nvs_gate_exit(t);
    return r;
}
