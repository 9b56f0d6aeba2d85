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
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUlaunchConfig_st CUlaunchConfig;           /* only passed through */
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;             /* only passed through */
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;             /* only passed through */
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;   /* only passed through */
typedef struct CUDA_LAUNCH_PARAMS_st CUDA_LAUNCH_PARAMS;   /* only passed through */
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
#define CUDA_ERROR_UNKNOWN 999

#define CU_GET_PROC_ADDRESS_DEFAULT 0x0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 0x1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2

#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1

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

#endif /* NVSHARE_CUDA_MIN_H */
