/*
 * Prototypes of the driver (and NVML) entry points that libnvshare.so interposes or calls, and that
 * the fake driver implements. Keeping them in one header lets the compiler check that every hook has
 * exactly the driver's signature.
 */
#ifndef NVSHARE_CUDA_API_H
#define NVSHARE_CUDA_API_H

#include "copies.h"
#include "cuda_min.h"

#define NVS_LAUNCH_ARGS                                                                        \
    CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
        unsigned shmem, CUstream s, void **params, void **extra
#define NVS_COOP_ARGS                                                                          \
    CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
        unsigned shmem, CUstream s, void **params

/* initialisation, devices, contexts */
CUresult cuInit(unsigned flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *params, int n, unsigned flags,
                        CUdevice dev);
CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *ctx);
CUresult cuCtxGetDevice(CUdevice *dev);
CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuCtxSynchronize_v2(CUcontext ctx);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuStreamSynchronize_ptsz(CUstream s);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventQuery(CUevent e);
CUresult cuStreamQuery(CUstream s);
CUresult cuStreamQuery_ptsz(CUstream s);
CUresult cuEventCreate(CUevent *e, unsigned int flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventDestroy_v2(CUevent e);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active);
CUresult cuGreenCtxCreate(CUgreenCtx *green, CUdevResourceDesc desc, CUdevice dev, unsigned flags);
CUresult cuGreenCtxDestroy(CUgreenCtx green);
CUresult cuCtxFromGreenCtx(CUcontext *ctx, CUgreenCtx green);
CUresult cuGreenCtxStreamCreate(CUstream *s, CUgreenCtx green, unsigned flags, int priority);
CUresult cuStreamCreate(CUstream *s, unsigned flags);
CUresult cuStreamDestroy_v2(CUstream s);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status);

/* stream capture and graphs */
CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode);
CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode);
CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph graph, const CUgraphNode *deps,
                                     const CUgraphEdgeData *edges, size_t n,
                                     CUstreamCaptureMode mode);
CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph graph, const CUgraphNode *deps,
                                          const CUgraphEdgeData *edges, size_t n,
                                          CUstreamCaptureMode mode);
CUresult cuStreamEndCapture(CUstream s, CUgraph *graph);
CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *graph);
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status);
CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode);
CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log,
                            size_t log_size);
CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log,
                               size_t log_size);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags);
CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph,
                                      CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *n);
CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type);
CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params);
CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *child);
CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr);
/* the CUDA 10-12 signature, which every driver since keeps under this name */
CUresult cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode *deps, size_t *n);
/* building graphs (the probe and the fake driver) */
CUresult cuGraphCreate(CUgraph *graph, unsigned flags);
CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *params);
CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                               size_t ndeps, CUdeviceptr dptr);
CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                  size_t ndeps, CUgraph child);
CUresult cuGraphExecDestroy(CUgraphExec exec);
CUresult cuGraphDestroy(CUgraph graph);
CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void *value);
CUresult cuDeviceGraphMemTrim(CUdevice dev);

/* submissions: launches */
CUresult cuLaunchKernel(NVS_LAUNCH_ARGS);
CUresult cuLaunchKernel_ptsz(NVS_LAUNCH_ARGS);
CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params,
                               void **extra);
CUresult cuLaunchCooperativeKernel(NVS_COOP_ARGS);
CUresult cuLaunchCooperativeKernel_ptsz(NVS_COOP_ARGS);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *p, unsigned n, unsigned flags);
CUresult cuLaunch(CUfunction f);
CUresult cuLaunchGrid(CUfunction f, int width, int height);
CUresult cuLaunchGridAsync(CUfunction f, int width, int height, CUstream s);
CUresult cuGraphLaunch(CUgraphExec g, CUstream s);
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s);
CUresult cuGraphUpload(CUgraphExec g, CUstream s);
CUresult cuGraphUpload_ptsz(CUgraphExec g, CUstream s);

#define NVS_DECLARE(name, params, args) CUresult name params;
NVS_SYNC_COPIES(NVS_DECLARE, )
NVS_SYNC_COPIES(NVS_DECLARE, _ptds)
NVS_ASYNC_COPIES(NVS_DECLARE, )
NVS_ASYNC_COPIES(NVS_DECLARE, _ptsz)
NVS_STREAM_OPS(NVS_DECLARE, )
NVS_STREAM_OPS(NVS_DECLARE, _ptsz)

/* memory */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes);
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height,
                            unsigned elem);
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t bytes, CUstream s);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d);
CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned levels);
CUresult cuArrayDestroy(CUarray a);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray a);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags);
CUresult cuMemFreeHost(void *p);
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);

/* NVML */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned len);
#define NVS_NVML_PROCESS_LISTS(X)                                                   \
    X(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, 1)                \
    X(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t, 1)                \
    X(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, 1)                \
    X(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, 0)               \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t, 0)               \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, 0)               \
    X(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, 0)             \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t, 0)             \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, 0)
#define NVS_NVML_PROCESS_LIST_PROTO(name, info, compute) \
    nvmlReturn_t name(nvmlDevice_t dev, unsigned *count, info *infos);
NVS_NVML_PROCESS_LISTS(NVS_NVML_PROCESS_LIST_PROTO)

#endif /* NVSHARE_CUDA_API_H */
