/*
 * The fake driver's memory: every allocation takes bytes from its device (2 MiB granularity) and
 * gives them back when freed, when its context is destroyed or reset, or -- for VMM handles --
 * when the handle is released and its last mapping is gone. Stream-ordered pools behave like the
 * driver's: they grow to serve allocations, keep freed memory reserved, and shrink to their
 * release threshold (default 0) at a synchronisation or to a trim's target. Allocations on a
 * capturing stream become graph memory nodes and take nothing until the graph is uploaded or
 * launched.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "fake.h"

#define ALLOC_MAGIC 0x66616b65616c6c6full
#define POOL_MAGIC 0x66616b65706f6f6cull
#define MAX_POOLS 256
#define MAX_MAPPINGS 4096

struct fake_pool {
    uint64_t magic;
    int dev;
    uint64_t reserved, used, threshold;
};

struct fake_alloc {
    uint64_t magic, bytes;
    int dev, refs; /* refs: a VMM handle plus each mapping of it */
    struct fake_ctx *ctx;
    struct fake_pool *pool;
    struct fake_alloc *prev, *next;
};

struct mapping {
    uint64_t va, size;
    struct fake_alloc *handle;
};

static struct {
    pthread_mutex_t mu;
    struct fake_alloc *live;
    struct fake_pool *pools[MAX_POOLS];
    int npools;
    struct fake_pool *current_pool[FAKE_MAX_DEVS];
    struct mapping maps[MAX_MAPPINGS];
    int nmaps;
    uint64_t next_va;
} mem = {.mu = PTHREAD_MUTEX_INITIALIZER, .next_va = 0x7f0000000000ull};

static int cur_dev(void) { return fake_current() ? fake_current()->dev : -1; }

/* With mem.mu held: adjust the device's bytes in use. */
static int device_take(int d, uint64_t bytes)
{
    pthread_mutex_lock(&dev.mu);
    int ok = dev.used[d] + bytes <= dev.total;
    if (ok) dev.used[d] += bytes;
    pthread_mutex_unlock(&dev.mu);
    return ok;
}

static void device_give(int d, uint64_t bytes)
{
    pthread_mutex_lock(&dev.mu);
    dev.used[d] -= bytes;
    pthread_mutex_unlock(&dev.mu);
}

static struct fake_pool *new_pool(int d)
{
    struct fake_pool *p = calloc(1, sizeof *p);
    p->magic = POOL_MAGIC;
    p->dev = d;
    if (mem.npools < MAX_POOLS) mem.pools[mem.npools++] = p;
    return p;
}

/* Called once by cuInit with dev.mu held, before any allocation can be made. */
void fake_memory_init(void)
{
    for (int d = 0; d < dev.count; d++) mem.current_pool[d] = new_pool(d);
}

/* With mem.mu held. */
static struct fake_alloc *record(int d, uint64_t bytes, struct fake_ctx *c, struct fake_pool *pool)
{
    struct fake_alloc *a = calloc(1, sizeof *a);
    a->magic = ALLOC_MAGIC;
    a->bytes = bytes;
    a->dev = d;
    a->refs = 1;
    a->ctx = c;
    a->pool = pool;
    a->next = mem.live;
    if (mem.live != NULL) mem.live->prev = a;
    mem.live = a;
    return a;
}

/* With mem.mu held: the allocation is gone; its bytes go back to its pool or device. */
static void forget(struct fake_alloc *a)
{
    if (a->pool != NULL)
        a->pool->used -= a->bytes;
    else
        device_give(a->dev, a->bytes);
    if (a->prev != NULL) a->prev->next = a->next;
    if (a->next != NULL) a->next->prev = a->prev;
    if (mem.live == a) mem.live = a->next;
    a->magic = 0;
    free(a);
}

static struct fake_alloc *alloc_of(uint64_t handle)
{
    struct fake_alloc *a = (struct fake_alloc *)(uintptr_t)handle;
    return a != NULL && a->magic == ALLOC_MAGIC ? a : NULL;
}

CUresult fake_take(struct fake_ctx *c, int d, uint64_t requested, uint64_t charge,
                   unsigned long long *handle)
{
    if (!fake_ready()) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_CONTEXT;
    if (requested == 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev.fail_size != 0 && requested == dev.fail_size) return CUDA_ERROR_UNKNOWN;
    pthread_mutex_lock(&mem.mu);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (device_take(d, charge)) {
        *handle = (uint64_t)(uintptr_t)record(d, charge, c, NULL);
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&mem.mu);
    return r;
}

CUresult fake_give(uint64_t handle)
{
    pthread_mutex_lock(&mem.mu);
    struct fake_alloc *a = alloc_of(handle);
    if (a != NULL && --a->refs == 0) forget(a);
    pthread_mutex_unlock(&mem.mu);
    return a != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

void fake_free_ctx_memory(struct fake_ctx *c)
{
    pthread_mutex_lock(&mem.mu);
    for (struct fake_alloc *a = mem.live, *next; a != NULL; a = next) {
        next = a->next;
        if (a->ctx == c) forget(a);
    }
    pthread_mutex_unlock(&mem.mu);
}

/* With mem.mu held. */
static void shrink(struct fake_pool *p, uint64_t keep)
{
    uint64_t target = p->used > keep ? p->used : keep;
    if (p->reserved > target) {
        device_give(p->dev, p->reserved - target);
        p->reserved = target;
    }
}

void fake_release_pools(int d)
{
    pthread_mutex_lock(&mem.mu);
    for (int i = 0; i < mem.npools; i++)
        if (mem.pools[i]->magic == POOL_MAGIC && mem.pools[i]->dev == d)
            shrink(mem.pools[i], mem.pools[i]->threshold);
    pthread_mutex_unlock(&mem.mu);
}

/* ---- plain allocations ---- */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    CUresult r = fake_sync_allowed(NULL, NULL); /* cudaMalloc is unsafe during a global capture */
    if (r != CUDA_SUCCESS) return r;
    return fake_take(fake_current(), cur_dev(), bytes, fake_rounded(bytes), p);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
    (void)e;
    *pitch = (w + 511) / 512 * 512;
    return fake_take(fake_current(), cur_dev(), w * h, fake_rounded(*pitch * h), p);
}
/* Managed memory pages in and out on demand: it is not limited by the device size. */
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags)
{
    (void)flags;
    return fake_take(fake_current(), cur_dev(), bytes, 0, p);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return fake_give(p); }

static uint64_t elem(unsigned format)
{
    return format == 1 || format == 8 ? 1 : (format == 2 || format == 9 || format == 0x10) ? 2 : 4;
}
static uint64_t extent(size_t w, size_t h, size_t d, unsigned f, unsigned ch)
{
    return (uint64_t)w * (h ? h : 1) * (d ? d : 1) * elem(f) * (ch ? ch : 1);
}

EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    uint64_t bytes = extent(d->Width, d->Height, 0, d->Format, d->NumChannels);
    unsigned long long h = 0;
    CUresult r = fake_take(fake_current(), cur_dev(), bytes, fake_rounded(bytes), &h);
    *a = (CUarray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t bytes = extent(d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
    unsigned long long h = 0;
    CUresult r = fake_take(fake_current(), cur_dev(), bytes, fake_rounded(bytes), &h);
    *a = (CUarray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned levels)
{
    uint64_t bytes = 0;
    unsigned long long h = 0;
    size_t w = d->Width, hh = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        bytes += extent(w, hh, z, d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1;
        hh = hh > 1 ? hh / 2 : hh;
        z = z > 1 ? z / 2 : z;
    }
    CUresult r = fake_take(fake_current(), cur_dev(), bytes, fake_rounded(bytes), &h);
    *a = (CUmipmappedArray)(uintptr_t)h;
    return r;
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return fake_give((uint64_t)(uintptr_t)a); }
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    return fake_give((uint64_t)(uintptr_t)a);
}

/* ---- VMM: physical handles live while the handle or any mapping of it does ---- */

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    (void)flags;
    if (prop == NULL || bytes % FAKE_GRANULE != 0) return CUDA_ERROR_INVALID_VALUE;
    return fake_take(NULL, prop->location.id, bytes, bytes, h);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return fake_give(h); }

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags)
{
    (void)align, (void)addr, (void)flags;
    pthread_mutex_lock(&mem.mu);
    *ptr = mem.next_va;
    mem.next_va += fake_rounded(size) + FAKE_GRANULE;
    pthread_mutex_unlock(&mem.mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    (void)ptr, (void)size;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags)
{
    (void)offset, (void)flags;
    pthread_mutex_lock(&mem.mu);
    struct fake_alloc *a = alloc_of(h);
    CUresult r = a == NULL || mem.nmaps == MAX_MAPPINGS ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) {
        a->refs++;
        mem.maps[mem.nmaps++] = (struct mapping){.va = ptr, .size = size, .handle = a};
    }
    pthread_mutex_unlock(&mem.mu);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    pthread_mutex_lock(&mem.mu);
    int found = 0;
    for (int i = 0; i < mem.nmaps; i++) {
        struct mapping *m = &mem.maps[i];
        if (m->va < ptr || m->va >= ptr + size) continue;
        found = 1;
        if (--m->handle->refs == 0) forget(m->handle);
        mem.maps[i--] = mem.maps[--mem.nmaps];
    }
    pthread_mutex_unlock(&mem.mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    uint64_t va = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&mem.mu);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < mem.nmaps && r != CUDA_SUCCESS; i++) {
        struct mapping *m = &mem.maps[i];
        if (va >= m->va && va < m->va + m->size) {
            m->handle->refs++;
            *h = (uint64_t)(uintptr_t)m->handle;
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mem.mu);
    return r;
}

/* ---- stream-ordered pools ---- */

static struct fake_pool *pool_of(CUmemoryPool pool)
{
    struct fake_pool *p = (struct fake_pool *)pool;
    for (int i = 0; i < mem.npools; i++)
        if (mem.pools[i] == p && p->magic == POOL_MAGIC) return p;
    return NULL;
}

/* An allocation on a capturing stream: a graph allocation node, no memory until the graph runs
 * (fake_graph.c). Its address is a record of no bytes, freed by the matching free. */
static CUresult graph_node(struct fake_stream *fs, CUdeviceptr *p, size_t bytes)
{
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem.mu);
    *p = (uint64_t)(uintptr_t)record(fs->ctx->dev, 0, NULL, NULL);
    pthread_mutex_unlock(&mem.mu);
    pthread_mutex_lock(&dev.mu);
    CUresult r = fs->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        fake_graph_add(fs->graph, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                                                     .dev = fs->ctx->dev, .bytesize = bytes,
                                                     .dptr = *p});
    pthread_mutex_unlock(&dev.mu);
    if (r != CUDA_SUCCESS) fake_give(*p);
    return r;
}

static CUresult pool_alloc(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s)
{
    struct fake_ctx *c = fake_stream_ctx(s);
    if (c == NULL || !fake_valid_ctx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    struct fake_stream *fs = fake_stream(s);
    if (fs != NULL && fs->capturing) return graph_node(fs, p, bytes);
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev.fail_size != 0 && bytes == dev.fail_size) return CUDA_ERROR_UNKNOWN;
    uint64_t want = fake_rounded(bytes);
    pthread_mutex_lock(&mem.mu);
    struct fake_pool *fp = pool != NULL ? pool_of(pool) : mem.current_pool[c->dev];
    CUresult r = fp == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS && fp->used + want > fp->reserved) {
        uint64_t grow = fp->used + want - fp->reserved;
        if (device_take(fp->dev, grow))
            fp->reserved += grow;
        else
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        fp->used += want;
        *p = (uint64_t)(uintptr_t)record(fp->dev, want, c, fp);
    }
    pthread_mutex_unlock(&mem.mu);
    return r;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s)
{
    return pool_alloc(p, bytes, NULL, s);
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t bytes, CUstream s)
{
    return pool_alloc(p, bytes, NULL, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, CUmemoryPool pool, CUstream s)
{
    return pool == NULL ? CUDA_ERROR_INVALID_VALUE : pool_alloc(p, bytes, pool, s);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t bytes, CUmemoryPool pool,
                                             CUstream s)
{
    return cuMemAllocFromPoolAsync(p, bytes, pool, s);
}

/* The bytes go back to the pool (in stream order, which the fake does not model: at once); on a
 * capturing stream, a graph free node. */
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    struct fake_stream *fs = fake_stream(s);
    pthread_mutex_lock(&dev.mu);
    if (fs != NULL && fs->capturing && !fs->invalidated)
        fake_graph_add(fs->graph, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_MEM_FREE, .dptr = p});
    pthread_mutex_unlock(&dev.mu);
    return fake_give(p);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d)
{
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mem.mu);
    *pool = (CUmemoryPool)mem.current_pool[d];
    pthread_mutex_unlock(&mem.mu);
    return *pool != NULL ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    return cuDeviceGetMemPool(pool, d);
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    if (props == NULL || props->location.id < 0 || props->location.id >= dev.count)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem.mu);
    *pool = (CUmemoryPool)new_pool(props->location.id);
    pthread_mutex_unlock(&mem.mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    pthread_mutex_lock(&mem.mu);
    struct fake_pool *p = pool_of(pool);
    if (p != NULL) {
        shrink(p, 0);
        p->magic = 0;
    }
    pthread_mutex_unlock(&mem.mu);
    return p != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    pthread_mutex_lock(&mem.mu);
    struct fake_pool *p = pool_of(pool);
    if (p != NULL) shrink(p, keep);
    pthread_mutex_unlock(&mem.mu);
    return p != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    pthread_mutex_lock(&mem.mu);
    struct fake_pool *p = pool_of(pool);
    CUresult r = p == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (p != NULL) {
        uint64_t v = attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD     ? p->threshold
                     : attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? p->reserved
                     : attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT     ? p->used
                                                                     : 0;
        *(cuuint64_t *)value = v;
    }
    pthread_mutex_unlock(&mem.mu);
    return r;
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    pthread_mutex_lock(&mem.mu);
    struct fake_pool *p = pool_of(pool);
    if (p != NULL && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) p->threshold = *(cuuint64_t *)value;
    pthread_mutex_unlock(&mem.mu);
    return p != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- what the program sees ---- */

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    int d = cur_dev();
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&dev.mu);
    *free_bytes = dev.total - dev.used[d];
    *total_bytes = dev.total;
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

/* Page-locked host memory, as cuMemHostAlloc gave it: copies to and from it do not block. */
#define MAX_PINNED 256
static void *pinned[MAX_PINNED];

int fake_pinned(const void *p)
{
    int found = 0;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < MAX_PINNED && !found && p != NULL; i++) found = pinned[i] == p;
    pthread_mutex_unlock(&dev.mu);
    return found;
}

EXPORT CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    *p = malloc(bytes ? bytes : 1);
    if (*p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < MAX_PINNED; i++)
        if (pinned[i] == NULL) {
            pinned[i] = *p;
            break;
        }
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemFreeHost(void *p)
{
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < MAX_PINNED && p != NULL; i++)
        if (pinned[i] == p) pinned[i] = NULL;
    pthread_mutex_unlock(&dev.mu);
    free(p);
    return CUDA_SUCCESS;
}
