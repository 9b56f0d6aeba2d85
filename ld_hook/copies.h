/*
 * The copy, set and other stream-ordered submission entry points of the driver as X-macro lists:
 * X(name, (params), (args)). They are many and alike, so the prototypes, the gated hooks, the fake
 * driver and the export list are all generated from these lists (SFX is "", _ptds or _ptsz).
 * In the stream-ordered lists the stream parameter is always called `st`. Macros only: this header
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

/*
 * Other stream-ordered submissions: batched and attributed copies (CUDA 12.8 / 13), prefetch and
 * discard, stream memory operations, sparse array mapping, external semaphores, batch
 * decompression, host functions and waits on events (a stream held behind another's work is work
 * in flight). The _v2 names are the ABI that newer cuda.h headers select.
 */
#define NVS_STREAM_OPS(X, SFX)                                                                     \
    X(cuMemcpyBatchAsync##SFX,                                                                     \
      (CUdeviceptr * d, CUdeviceptr * s, size_t * n, size_t count, CUmemcpyAttributes * a,         \
       size_t * ai, size_t na, size_t * fail, CUstream st),                                        \
      (d, s, n, count, a, ai, na, fail, st))                                                       \
    X(cuMemcpyBatchAsync_v2##SFX,                                                                  \
      (CUdeviceptr * d, CUdeviceptr * s, size_t * n, size_t count, CUmemcpyAttributes * a,         \
       size_t * ai, size_t na, CUstream st),                                                       \
      (d, s, n, count, a, ai, na, st))                                                             \
    X(cuMemcpy3DBatchAsync##SFX,                                                                   \
      (size_t n, CUDA_MEMCPY3D_BATCH_OP * ops, size_t * fail, unsigned long long flags,            \
       CUstream st),                                                                               \
      (n, ops, fail, flags, st))                                                                   \
    X(cuMemcpy3DBatchAsync_v2##SFX,                                                                \
      (size_t n, CUDA_MEMCPY3D_BATCH_OP * ops, unsigned long long flags, CUstream st),             \
      (n, ops, flags, st))                                                                         \
    X(cuMemcpyWithAttributesAsync##SFX,                                                            \
      (CUdeviceptr d, CUdeviceptr s, size_t n, CUmemcpyAttributes * a, CUstream st),              \
      (d, s, n, a, st))                                                                            \
    X(cuMemcpy3DWithAttributesAsync##SFX,                                                          \
      (CUDA_MEMCPY3D_BATCH_OP * op, unsigned long long flags, CUstream st), (op, flags, st))       \
    X(cuMemPrefetchAsync##SFX, (CUdeviceptr p, size_t n, CUdevice dev, CUstream st),               \
      (p, n, dev, st))                                                                             \
    X(cuMemPrefetchAsync_v2##SFX,                                                                  \
      (CUdeviceptr p, size_t n, CUmemLocation loc, unsigned flags, CUstream st),                   \
      (p, n, loc, flags, st))                                                                      \
    X(cuMemPrefetchBatchAsync##SFX,                                                                \
      (CUdeviceptr * p, size_t * n, size_t count, CUmemLocation * locs, size_t * li, size_t nl,    \
       unsigned long long flags, CUstream st),                                                     \
      (p, n, count, locs, li, nl, flags, st))                                                      \
    X(cuMemDiscardBatchAsync##SFX,                                                                 \
      (CUdeviceptr * p, size_t * n, size_t count, unsigned long long flags, CUstream st),          \
      (p, n, count, flags, st))                                                                    \
    X(cuMemDiscardAndPrefetchBatchAsync##SFX,                                                      \
      (CUdeviceptr * p, size_t * n, size_t count, CUmemLocation * locs, size_t * li, size_t nl,    \
       unsigned long long flags, CUstream st),                                                     \
      (p, n, count, locs, li, nl, flags, st))                                                      \
    X(cuStreamWaitValue32##SFX, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f),           \
      (st, a, v, f))                                                                               \
    X(cuStreamWaitValue64##SFX, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f),           \
      (st, a, v, f))                                                                               \
    X(cuStreamWriteValue32##SFX, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f),          \
      (st, a, v, f))                                                                               \
    X(cuStreamWriteValue64##SFX, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f),          \
      (st, a, v, f))                                                                               \
    X(cuStreamBatchMemOp##SFX,                                                                     \
      (CUstream st, unsigned count, CUstreamBatchMemOpParams * p, unsigned f), (st, count, p, f))  \
    X(cuStreamWaitValue32_v2##SFX, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f),        \
      (st, a, v, f))                                                                               \
    X(cuStreamWaitValue64_v2##SFX, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f),        \
      (st, a, v, f))                                                                               \
    X(cuStreamWriteValue32_v2##SFX, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f),       \
      (st, a, v, f))                                                                               \
    X(cuStreamWriteValue64_v2##SFX, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f),       \
      (st, a, v, f))                                                                               \
    X(cuStreamBatchMemOp_v2##SFX,                                                                  \
      (CUstream st, unsigned count, CUstreamBatchMemOpParams * p, unsigned f), (st, count, p, f))  \
    X(cuMemMapArrayAsync##SFX, (CUarrayMapInfo * m, unsigned count, CUstream st), (m, count, st))  \
    X(cuSignalExternalSemaphoresAsync##SFX,                                                        \
      (const CUexternalSemaphore *e, const CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS *p, unsigned n,   \
       CUstream st),                                                                               \
      (e, p, n, st))                                                                               \
    X(cuWaitExternalSemaphoresAsync##SFX,                                                          \
      (const CUexternalSemaphore *e, const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *p, unsigned n,     \
       CUstream st),                                                                               \
      (e, p, n, st))                                                                               \
    X(cuMemBatchDecompressAsync##SFX,                                                              \
      (CUmemDecompressParams * p, size_t count, unsigned f, size_t * err, CUstream st),            \
      (p, count, f, err, st))                                                                      \
    X(cuLaunchHostFunc##SFX, (CUstream st, CUhostFn fn, void *data), (st, fn, data))              \
    X(cuStreamAddCallback##SFX, (CUstream st, CUstreamCallback cb, void *data, unsigned f),       \
      (st, cb, data, f))                                                                           \
    X(cuLaunchHostFunc_v2##SFX, (CUstream st, CUhostFn fn, void *data, unsigned mode),            \
      (st, fn, data, mode))                                                                        \
    X(cuStreamWaitEvent##SFX, (CUstream st, CUevent e, unsigned f), (st, e, f))

#endif /* NVSHARE_COPIES_H */
