/*
 * The copy and set entry points of the driver as X-macro lists: X(name, (params), (args)).
 * They are many and alike, so the prototypes, the gated hooks, the fake driver and the export list
 * are all generated from these two lists (SFX is "", _ptds or _ptsz). Macros only: this header
 * must expand to nothing, because the version script is made from it with cpp.
 */
#ifndef NVSHARE_COPIES_H
#define NVSHARE_COPIES_H

/* submissions: copies and sets, synchronous (legacy and _ptds) */
#define NVS_SYNC_COPIES(X, SFX)                                                                    \
    X(cuMemcpy##SFX, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                          \
    X(cuMemcpyPeer##SFX, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),     \
      (d, dc, s, sc, n))                                                                           \
    X(cuMemcpyHtoD_v2##SFX, (CUdeviceptr d, const void *s, size_t n), (d, s, n))                   \
    X(cuMemcpyDtoH_v2##SFX, (void *d, CUdeviceptr s, size_t n), (d, s, n))                         \
    X(cuMemcpyDtoD_v2##SFX, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                   \
    X(cuMemcpyDtoA_v2##SFX, (CUarray d, size_t o, CUdeviceptr s, size_t n), (d, o, s, n))          \
    X(cuMemcpyAtoD_v2##SFX, (CUdeviceptr d, CUarray s, size_t o, size_t n), (d, s, o, n))          \
    X(cuMemcpyHtoA_v2##SFX, (CUarray d, size_t o, const void *s, size_t n), (d, o, s, n))          \
    X(cuMemcpyAtoH_v2##SFX, (void *d, CUarray s, size_t o, size_t n), (d, s, o, n))                \
    X(cuMemcpyAtoA_v2##SFX, (CUarray d, size_t od, CUarray s, size_t os, size_t n),                \
      (d, od, s, os, n))                                                                           \
    X(cuMemcpy2D_v2##SFX, (const CUDA_MEMCPY2D *p), (p))                                           \
    X(cuMemcpy2DUnaligned_v2##SFX, (const CUDA_MEMCPY2D *p), (p))                                  \
    X(cuMemcpy3D_v2##SFX, (const CUDA_MEMCPY3D *p), (p))                                           \
    X(cuMemcpy3DPeer##SFX, (const CUDA_MEMCPY3D_PEER *p), (p))                                     \
    X(cuMemsetD8_v2##SFX, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                   \
    X(cuMemsetD16_v2##SFX, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                 \
    X(cuMemsetD32_v2##SFX, (CUdeviceptr d, unsigned v, size_t n), (d, v, n))                       \
    X(cuMemsetD2D8_v2##SFX, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),        \
      (d, p, v, w, h))                                                                             \
    X(cuMemsetD2D16_v2##SFX, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),      \
      (d, p, v, w, h))                                                                             \
    X(cuMemsetD2D32_v2##SFX, (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h),            \
      (d, p, v, w, h))

/* submissions: copies and sets on a stream (legacy and _ptsz) */
#define NVS_ASYNC_COPIES(X, SFX)                                                                   \
    X(cuMemcpyAsync##SFX, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))    \
    X(cuMemcpyPeerAsync##SFX,                                                                      \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),           \
      (d, dc, s, sc, n, st))                                                                       \
    X(cuMemcpyHtoDAsync_v2##SFX, (CUdeviceptr d, const void *s, size_t n, CUstream st),            \
      (d, s, n, st))                                                                               \
    X(cuMemcpyDtoHAsync_v2##SFX, (void *d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))   \
    X(cuMemcpyDtoDAsync_v2##SFX, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st),            \
      (d, s, n, st))                                                                               \
    X(cuMemcpyHtoAAsync_v2##SFX, (CUarray d, size_t o, const void *s, size_t n, CUstream st),      \
      (d, o, s, n, st))                                                                            \
    X(cuMemcpyAtoHAsync_v2##SFX, (void *d, CUarray s, size_t o, size_t n, CUstream st),            \
      (d, s, o, n, st))                                                                            \
    X(cuMemcpy2DAsync_v2##SFX, (const CUDA_MEMCPY2D *p, CUstream st), (p, st))                     \
    X(cuMemcpy3DAsync_v2##SFX, (const CUDA_MEMCPY3D *p, CUstream st), (p, st))                     \
    X(cuMemcpy3DPeerAsync##SFX, (const CUDA_MEMCPY3D_PEER *p, CUstream st), (p, st))               \
    X(cuMemsetD8Async##SFX, (CUdeviceptr d, unsigned char v, size_t n, CUstream st),               \
      (d, v, n, st))                                                                               \
    X(cuMemsetD16Async##SFX, (CUdeviceptr d, unsigned short v, size_t n, CUstream st),             \
      (d, v, n, st))                                                                               \
    X(cuMemsetD32Async##SFX, (CUdeviceptr d, unsigned v, size_t n, CUstream st), (d, v, n, st))    \
    X(cuMemsetD2D8Async##SFX,                                                                      \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream st),                 \
      (d, p, v, w, h, st))                                                                         \
    X(cuMemsetD2D16Async##SFX,                                                                     \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream st),                \
      (d, p, v, w, h, st))                                                                         \
    X(cuMemsetD2D32Async##SFX,                                                                     \
      (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h, CUstream st), (d, p, v, w, h, st))

#endif /* NVSHARE_COPIES_H */
