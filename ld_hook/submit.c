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

#define NVS_LAUNCH_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra)
#define NVS_COOP_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params)
#define NVS_EX_PARAMS (const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)

NVS_GATED_ON(cuLaunchKernel, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL, s)
NVS_GATED_ON(cuLaunchKernel_ptsz, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL, s)
/* A launch with attributes may be a collective (cut.h): counted, and held while a gang stops.
 * One recorded into a capture runs later, with its graph: not counted. */
#define NVS_LAUNCH_EX(name)                                                      \
    NVS_EXPORT CUresult name NVS_EX_PARAMS                                       \
    {                                                                            \
        CUstream s = cfg ? cfg->hStream : NULL;                                  \
        struct nvs_gpu *g = nvs_submit_gpu(s);                                   \
        int coll = g != NULL && nvs_is_collective(cfg) &&                     \
                   !(nvs_capture_active(g) > 0 && nvs_stream_capturing(s));     \
        if (NVS_UNLIKELY(coll)) nvs_cut_begin(g);                                \
        struct nvs_thread *t = nvs_gate_enter(g, s);                             \
        CUresult r = NVS_CALL(name, (cfg, f, params, extra));                    \
        nvs_gate_exit(t);                                                        \
        if (NVS_UNLIKELY(coll) && nvs_cut_end(g)) nvs_gate_on_cut_reached(g);    \
        return r;                                                                \
    }
NVS_LAUNCH_EX(cuLaunchKernelEx)
NVS_LAUNCH_EX(cuLaunchKernelEx_ptsz)
NVS_GATED_ON(cuLaunchCooperativeKernel, (NVS_COOP_ARGS), NVS_COOP_CALL, s)
NVS_GATED_ON(cuLaunchCooperativeKernel_ptsz, (NVS_COOP_ARGS), NVS_COOP_CALL, s)
NVS_GATED_ON(cuLaunch, (CUfunction f), (f), NULL)
NVS_GATED_ON(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h), NULL)
NVS_GATED_ON(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s), s)

NVS_SYNC_COPIES(NVS_GATED_SYNC, )
NVS_SYNC_COPIES(NVS_GATED_SYNC, _ptds)
NVS_ASYNC_COPIES(NVS_GATED_STREAM, )
NVS_ASYNC_COPIES(NVS_GATED_STREAM, _ptsz)
NVS_STREAM_OPS(NVS_GATED_STREAM, )
NVS_STREAM_OPS(NVS_GATED_STREAM, _ptsz)

/* An upload or launch may make the driver reserve the graph's memory (graphs.h): checked
 * against the limit before, settled after. */
#define NVS_GRAPH_RUN(name)                                              \
    NVS_EXPORT CUresult name(CUgraphExec g, CUstream s)                  \
    {                                                                    \
        if (nvs_graph_admit(g, s) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY; \
        struct nvs_thread *t = nvs_gate_enter(nvs_submit_gpu(s), s);     \
        CUresult r = NVS_CALL(name, (g, s));                             \
        nvs_gate_exit(t);                                                \
        nvs_graph_ran(g, s, r);                                          \
        return r;                                                        \
    }
NVS_GRAPH_RUN(cuGraphLaunch)
NVS_GRAPH_RUN(cuGraphLaunch_ptsz)
NVS_GRAPH_RUN(cuGraphUpload)
NVS_GRAPH_RUN(cuGraphUpload_ptsz)

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
