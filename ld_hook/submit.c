/*
 * Every submission path: kernel launches, graph launches, copies and sets. Each passes the gate
 * of the GPU the calling thread submits to (nvs_gate, the hot path) and then goes to the driver.
 */
#include "nvshare.h"

#define NVS_GATED(name, params, args)                 \
    NVS_EXPORT CUresult name params                   \
    {                                                 \
        nvs_gate(nvs_current_gpu());                  \
        NVS_TAIL(name, args);                         \
    }

#define NVS_LAUNCH_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra)
#define NVS_COOP_CALL (f, gx, gy, gz, bx, by, bz, shmem, s, params)

NVS_GATED(cuLaunchKernel, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL)
NVS_GATED(cuLaunchKernel_ptsz, (NVS_LAUNCH_ARGS), NVS_LAUNCH_CALL)
NVS_GATED(cuLaunchKernelEx,
          (const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra),
          (cfg, f, params, extra))
NVS_GATED(cuLaunchKernelEx_ptsz,
          (const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra),
          (cfg, f, params, extra))
NVS_GATED(cuLaunchCooperativeKernel, (NVS_COOP_ARGS), NVS_COOP_CALL)
NVS_GATED(cuLaunchCooperativeKernel_ptsz, (NVS_COOP_ARGS), NVS_COOP_CALL)
NVS_GATED(cuGraphLaunch, (CUgraphExec g, CUstream s), (g, s))
NVS_GATED(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s))

NVS_SYNC_COPIES(NVS_GATED, )
NVS_SYNC_COPIES(NVS_GATED, _ptds)
NVS_ASYNC_COPIES(NVS_GATED, )
NVS_ASYNC_COPIES(NVS_GATED, _ptsz)

/* A launch across several GPUs: pass the gate of every GPU this process has used, in index order. */
NVS_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *p, unsigned n,
                                                         unsigned flags)
{
    int count = atomic_load_explicit(&nvs_ngpus, memory_order_acquire);
    for (int i = 0; i < count; i++) {
        struct nvs_gpu *g = &nvs_gpus[i];
        pthread_mutex_lock(&g->mu);
        int used = g->state != NVS_UNUSED || g->nctx > 0;
        pthread_mutex_unlock(&g->mu);
        if (used) nvs_gate(g);
    }
    NVS_TAIL(cuLaunchCooperativeKernelMultiDevice, (p, n, flags));
}
