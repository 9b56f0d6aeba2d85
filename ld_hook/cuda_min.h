/*
 * The few CUDA driver and NVML types the hook and the fake driver need, written out by hand so that
 * libnvshare.so builds with gcc alone (no CUDA toolkit on build machines or in the image).
 * Only layouts the code reads are spelled out; everything else is an opaque pointer.
 */
#ifndef NVSHARE_CUDA_MIN_H
#define NVSHARE_CUDA_MIN_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUevent_st *CUevent;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUextSemaphore_st *CUexternalSemaphore;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;                  /* only passed through */
typedef struct CUarrayMapInfo_st CUarrayMapInfo;                    /* only passed through */
typedef union CUstreamBatchMemOpParams_union CUstreamBatchMemOpParams; /* only passed through */
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;            /* only passed through */
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;    /* only passed through */
typedef struct CUmemDecompressParams_st CUmemDecompressParams;      /* only passed through */
typedef struct CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS_st CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS;
typedef struct CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS_st CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS;
typedef void (*CUhostFn)(void *userData);
typedef void (*CUstreamCallback)(CUstream s, CUresult status, void *userData);
typedef int CUstreamCaptureMode;
typedef int CUstreamCaptureStatus;
typedef int CUmemPool_attribute;
typedef int CUgraphMem_attribute;
typedef uint32_t cuuint32_t;
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;             /* only passed through */
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;             /* only passed through */
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;   /* only passed through */
typedef struct CUctxCreateParams_st CUctxCreateParams;     /* only passed through */
typedef struct CUexecAffinityParam_st CUexecAffinityParam; /* only passed through */
typedef int CUdriverProcAddressQueryResult;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_UNKNOWN 999

#define CU_GET_PROC_ADDRESS_DEFAULT 0x0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 0x1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2

#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901

#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1

/* The special stream handles (cuda.h's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD). */
#define NVS_STREAM_LEGACY ((CUstream)0x1)
#define NVS_STREAM_PER_THREAD ((CUstream)0x2)

#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2

#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT 0
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2

/* Graph nodes: the hook reads the allocation nodes of a graph (and of its child graphs) before
 * the driver reserves their memory. */
typedef int CUgraphNodeType;
#define CU_GRAPH_NODE_TYPE_KERNEL 0
#define CU_GRAPH_NODE_TYPE_GRAPH 4
#define CU_GRAPH_NODE_TYPE_EVENT_RECORD 7
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_GRAPH_NODE_TYPE_MEM_FREE 11
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD 2
typedef struct CUmemAccessDesc_st CUmemAccessDesc; /* only passed through */

typedef struct {
    unsigned char bytes[16];
} CUuuid;

typedef struct {
    size_t Width;
    size_t Height;
    unsigned int Format; /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    unsigned int Format; /* CUarray_format */
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

/* A launch attribute, as cuda.h lays it out: an id, padding to 8 bytes, a 64-byte value. Read
 * for the one attribute that marks a collective (cut.h): NCCL launches its kernels in the remote
 * memory-synchronisation domain. */
#define CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN 10
#define CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE 1
typedef struct CUlaunchAttribute_st {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int memSyncDomain;
    } value;
} CUlaunchAttribute;

/* Read for the stream a launch goes to; the layout of cuda.h's CUlaunchConfig. */
typedef struct CUlaunchConfig_st {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

/* Read for the stream of every launch of a multi-device cooperative launch. */
typedef struct CUDA_LAUNCH_PARAMS_st {
    CUfunction function;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

/* Read for the pool's device (location); the rest is passed through. */
typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

/* cuda.h's CUDA_MEM_ALLOC_NODE_PARAMS(_v1): read for the size and the pool's device. */
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

/* Read for the upload flag: an instantiation that also uploads reserves the graph's memory. */
typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out; /* CUgraphInstantiateResult */
} CUDA_GRAPH_INSTANTIATE_PARAMS;

/* NVML */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
#define NVML_SUCCESS 0
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
/* the process lists: _v1 entry points fill the first two fields only, _v2 and _v3 all four */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

#endif /* NVSHARE_CUDA_MIN_H */
