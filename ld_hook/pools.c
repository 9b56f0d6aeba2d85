/*
 * Pools (see pools.h). Each pool the process allocated from is listed with its
 * GPU and what is charged for it; the charge is set to the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_
 * CURRENT whenever it is read. An allocation is checked against the limit for the growth it needs
 * (used + size beyond reserved) before the real call, and for any further growth after it.
 */
#include <stdlib.h>

#include "allocmap.h"
#include "capture.h"
#include "contexts.h"
#include "dispatch.h"
#include "graphs.h"
#include "ledger.h"
#include "log.h"
#include "pools.h"

#define GRANULE (2ull << 20)

struct pool_rec {
    CUmemoryPool pool;
    int gpu;
    uint64_t charged;
};

static struct {
    pthread_mutex_t mu;
    struct pool_rec *list;
    int n, cap;
} pools = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t round_up(uint64_t n) { return (n + GRANULE - 1) / GRANULE * GRANULE; }

static int attr(CUmemoryPool pool, CUmemPool_attribute a, uint64_t *out)
{
    cuuint64_t v = 0;
    if (NVS_CALL(cuMemPoolGetAttribute, (pool, a, &v)) != CUDA_SUCCESS) return -1;
    *out = v;
    return 0;
}

/* With pools.mu held: the record of `pool`, added for GPU `gpu` if new (NULL without memory). */
static struct pool_rec *record(CUmemoryPool pool, int gpu)
{
    for (int i = 0; i < pools.n; i++)
        if (pools.list[i].pool == pool) return &pools.list[i];
    if (gpu < 0) return NULL;
    if (pools.n == pools.cap) {
        int cap = pools.cap ? pools.cap * 2 : 8;
        struct pool_rec *list = realloc(pools.list, (size_t)cap * sizeof *list);
        if (list == NULL) return NULL;
        pools.list = list;
        pools.cap = cap;
    }
    pools.list[pools.n] = (struct pool_rec){.pool = pool, .gpu = gpu, .charged = 0};
    return &pools.list[pools.n++];
}

/* Adjusts the charge of `pool` to what the driver reserves now; returns the growth charged. */
static int64_t settle_pool(CUmemoryPool pool)
{
    uint64_t reserved = 0;
    int readable = attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) == 0;
    nvs_mutex_lock(&pools.mu);
    struct pool_rec *rec = record(pool, -1);
    if (rec == NULL) {
        nvs_mutex_unlock(&pools.mu);
        return 0;
    }
    struct nvs_gpu *g = nvs_gpu_at(rec->gpu);
    if (!readable) reserved = 0; /* destroyed, or its device was reset */
    int64_t delta = (int64_t)reserved - (int64_t)rec->charged;
    rec->charged = reserved;
    if (!readable) *rec = pools.list[--pools.n];
    nvs_mutex_unlock(&pools.mu);
    if (delta > 0) nvs_ledger_force(g, (uint64_t)delta);
    if (delta < 0) nvs_ledger_uncharge(g, (uint64_t)-delta);
    return delta;
}

int nvs_pools_settle(struct nvs_gpu *g)
{
    if (g == NULL) return 0;
    CUmemoryPool mine[16];
    int n = 0;
    nvs_mutex_lock(&pools.mu);
    for (int i = 0; i < pools.n && n < 16; i++)
        if (pools.list[i].gpu == g->index) mine[n++] = pools.list[i].pool;
    nvs_mutex_unlock(&pools.mu);
    int shrank = 0;
    for (int i = 0; i < n; i++) shrank |= settle_pool(mine[i]) < 0;
    shrank |= nvs_graphs_settle(g);
    return shrank;
}

/* What the pool must grow by to serve `bytes` now (0 when its cached memory is enough). */
static uint64_t growth_needed(CUmemoryPool pool, uint64_t bytes)
{
    uint64_t reserved = 0, used = 0;
    if (attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != 0 ||
        attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != 0)
        return round_up(bytes);
    uint64_t want = used + round_up(bytes);
    return want > reserved ? want - reserved : 0;
}

/* The stream-ordered allocation paths; `call` is the real one. */
static CUresult pool_alloc(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s,
                           CUresult (*call)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))
{
    struct nvs_gpu *g = nvs_submit_gpu(s);
    if (g == NULL || nvs_stream_capturing(s)) return call(p, bytes, pool, s); /* a graph node */
    if (pool == NULL && NVS_CALL(cuDeviceGetMemPool, (&pool, g->index)) != CUDA_SUCCESS)
        return call(p, bytes, pool, s);
    nvs_mutex_lock(&pools.mu);
    struct pool_rec *rec = record(pool, g->index);
    int known = rec != NULL;
    if (known) g = nvs_gpu_at(rec->gpu);
    nvs_mutex_unlock(&pools.mu);
    if (!known || g == NULL) return call(p, bytes, pool, s);
    uint64_t need = growth_needed(pool, bytes);
    if (nvs_ledger_charge(g, need) != CUDA_SUCCESS) {
        if (!nvs_pools_settle(g)) return CUDA_ERROR_OUT_OF_MEMORY; /* nothing shrank since */
        need = growth_needed(pool, bytes);
        if (nvs_ledger_charge(g, need) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    nvs_mutex_lock(&pools.mu);
    if ((rec = record(pool, -1)) != NULL) rec->charged += need;
    nvs_mutex_unlock(&pools.mu);
    if (rec == NULL) nvs_ledger_uncharge(g, need);
    CUresult r = call(p, bytes, pool, s);
    settle_pool(pool);
    return r;
}

static CUresult plain_async(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)pool;
    return NVS_CALL(cuMemAllocAsync, (p, n, s));
}
static CUresult plain_async_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)pool;
    return NVS_CALL(cuMemAllocAsync_ptsz, (p, n, s));
}
static CUresult from_pool(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    return NVS_CALL(cuMemAllocFromPoolAsync, (p, n, pool, s));
}
static CUresult from_pool_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    return NVS_CALL(cuMemAllocFromPoolAsync_ptsz, (p, n, pool, s));
}

NVS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s)
{
    return pool_alloc(p, bytes, NULL, s, plain_async);
}
NVS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t bytes, CUstream s)
{
    return pool_alloc(p, bytes, NULL, s, plain_async_ptsz);
}
NVS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, CUmemoryPool pool,
                                            CUstream s)
{
    return pool_alloc(p, bytes, pool, s, from_pool);
}
NVS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t bytes, CUmemoryPool pool,
                                                 CUstream s)
{
    return pool_alloc(p, bytes, pool, s, from_pool_ptsz);
}

/* A free returns memory to its pool, which keeps it until its release threshold says otherwise. */
NVS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    CUresult r = NVS_CALL(cuMemFreeAsync, (p, s));
    if (r == CUDA_SUCCESS && !nvs_stream_capturing(s)) nvs_pools_settle(nvs_submit_gpu(s));
    return r;
}

NVS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    CUresult r = NVS_CALL(cuMemFreeAsync_ptsz, (p, s));
    if (r == CUDA_SUCCESS && !nvs_stream_capturing(s)) nvs_pools_settle(nvs_submit_gpu(s));
    return r;
}

NVS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CUresult r = NVS_CALL(cuMemPoolCreate, (pool, props));
    if (r != CUDA_SUCCESS || props == NULL || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return r; /* host pools hold no device memory */
    nvs_mutex_lock(&pools.mu);
    if (nvs_gpu_at(props->location.id) != NULL) record(*pool, props->location.id);
    nvs_mutex_unlock(&pools.mu);
    return r;
}

NVS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = NVS_CALL(cuMemPoolDestroy, (pool));
    if (r == CUDA_SUCCESS) settle_pool(pool); /* no longer readable: its charge goes */
    return r;
}

NVS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    CUresult r = NVS_CALL(cuMemPoolTrimTo, (pool, keep));
    settle_pool(pool);
    return r;
}

void nvs_pools_after_fork(void)
{
    pthread_mutex_init(&pools.mu, NULL);
    pools.n = 0;
    nvs_graphs_after_fork();
}
