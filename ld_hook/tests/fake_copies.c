/*
 * Stream-ordered copies with a host side: to or from pageable memory (anything cuMemHostAlloc
 * did not give) the real driver stages the bytes and returns only once the copy has run, after
 * everything queued before it on the stream; to or from page-locked memory they return at once.
 * PyTorch's .item() and .cpu() are such copies. These replace the weak definitions in
 * fake_cuda.c.
 */
#include "fake.h"

#define HOST_COPIES(X, SFX)                                                                       \
    X(cuMemcpyHtoDAsync_v2##SFX, (CUdeviceptr d, const void *s, size_t n, CUstream st), s)        \
    X(cuMemcpyDtoHAsync_v2##SFX, (void *d, CUdeviceptr s, size_t n, CUstream st), d)              \
    X(cuMemcpyHtoAAsync_v2##SFX, (CUarray d, size_t o, const void *s, size_t n, CUstream st), s)  \
    X(cuMemcpyAtoHAsync_v2##SFX, (void *d, CUarray s, size_t o, size_t n, CUstream st), d)

#define HOST_COPY(name, params, host)                                                  \
    EXPORT CUresult name params                                                        \
    {                                                                                  \
        return fake_run(st, !fake_pinned(host));                                       \
    }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
HOST_COPIES(HOST_COPY, )
HOST_COPIES(HOST_COPY, _ptsz)
#pragma GCC diagnostic pop
