/*
 * The allocation hooks (see alloc.h): every path is checked and charged before the real call,
 * rolled back if the driver fails it, and remembered in the allocation map so the matching free
 * is O(1). Charges are at driver granularity (2 MiB for linear memory; arrays from format,
 * channels and extent). The CUDA context itself is NOT charged (a project decision: its size
 * depends on the driver and the GPU, not on the program); what NVML shows beyond the allowance
 * is reconciled by the daemon (MEM_OBSERVED).
 */
#include "alloc.h"
#include "allocmap.h"
#include "contexts.h"
#include "dispatch.h"
#include "ledger.h"
#include "pools.h"

#define GRANULE (2ull << 20)

/* Refused? Pools may have shrunk since they were last read: settle them, and if that gave
 * memory back, ask once more (a second identical question would only be refused again). */
static CUresult charge(struct nvs_gpu *g, uint64_t bytes)
{
    CUresult r = nvs_ledger_charge(g, bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY && g != NULL && nvs_pools_settle(g))
        r = nvs_ledger_charge(g, bytes);
    return r;
}

/* After the real call: remember a success, roll the charge back on failure. */
static CUresult settle(struct nvs_gpu *g, CUresult r, uint32_t kind, uint64_t key, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return r;
    struct nvs_alloc e = {.key = key, .bytes = bytes, .kind = kind, .gpu = g->index, .refs = 1,
                          .ctx = kind == NVS_KIND_VMM ? 0 : (uint64_t)(uintptr_t)nvs_ctx_current()};
    if (r != CUDA_SUCCESS || key == 0 || nvs_allocmap_put(e) != 0) nvs_ledger_uncharge(g, bytes);
    return r;
}

static void uncharge_entry(const struct nvs_alloc *e)
{
    nvs_ledger_uncharge(nvs_gpu_at(e->gpu), e->bytes);
}

/* Forget `key` and release its charge once the real free succeeded. */
#define NVS_FREE(kind, key, call)                              \
    do {                                                       \
        struct nvs_alloc e_;                                   \
        int known_ = nvs_allocmap_take((key), (kind), &e_);    \
        CUresult r_ = (call);                                  \
        if (known_ && r_ == CUDA_SUCCESS)                      \
            uncharge_entry(&e_);                               \
        else if (known_)                                       \
            nvs_allocmap_put(e_);                              \
        return r_;                                             \
    } while (0)

static uint64_t round_up(uint64_t n, uint64_t to) { return n == 0 ? 0 : (n + to - 1) / to * to; }

static uint64_t linear(size_t bytes) { return round_up(bytes, GRANULE); }

/* Bytes per element of a CUarray_format; unknown (newer, block-compressed) formats charge 4. */
static uint64_t format_bytes(unsigned format)
{
    switch (format) {
    case 0x01: case 0x08: return 1;             /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;  /* (UN)SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: return 4;  /* (UN)SIGNED_INT32, FLOAT */
    default: return 4;
    }
}

static uint64_t extent_bytes(size_t w, size_t h, size_t d, unsigned format, unsigned channels)
{
    return (uint64_t)w * (h ? h : 1) * (d ? d : 1) * format_bytes(format) * (channels ? channels : 1);
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t total = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        total += extent_bytes(w, h, z, d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return total;
}

/* Linear memory and arrays belong to the calling thread's current context and its device. */
static struct nvs_gpu *memory_gpu(void) { return nvs_submit_gpu(NULL); }

NVS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = g != NULL && nvs_ledger_backing_managed(g)
                     ? NVS_CALL(cuMemAllocManaged, (p, bytes, CU_MEM_ATTACH_GLOBAL))
                     : NVS_CALL(cuMemAlloc_v2, (p, bytes));
    return settle(g, r, NVS_KIND_PTR, r == CUDA_SUCCESS ? *p : 0, c);
}

NVS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height,
                                       unsigned elem)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t estimate = linear(round_up(width, 512) * height);
    if (charge(g, estimate) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuMemAllocPitch_v2, (p, pitch, width, height, elem));
    uint64_t actual = r == CUDA_SUCCESS ? linear((uint64_t)*pitch * height) : estimate;
    if (actual > estimate && charge(g, actual - estimate) != CUDA_SUCCESS) {
        NVS_CALL(cuMemFree_v2, (*p));
        nvs_ledger_uncharge(g, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) nvs_ledger_uncharge(g, estimate - actual);
    return settle(g, r, NVS_KIND_PTR, r == CUDA_SUCCESS ? *p : 0, actual);
}

NVS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuMemAllocManaged, (p, bytes, flags));
    return settle(g, r, NVS_KIND_PTR, r == CUDA_SUCCESS ? *p : 0, c);
}

/* ---- VMM: handles are charged while the handle or any mapping of it lives ---- */

NVS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    struct nvs_gpu *g = prop != NULL && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                            ? nvs_gpu_at(prop->location.id)
                            : NULL;
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuMemCreate, (h, bytes, prop, flags));
    return settle(g, r, NVS_KIND_VMM, r == CUDA_SUCCESS ? *h : 0, c);
}

/* Drops one reference of handle h; the last one takes its charge away. */
static void handle_unref(uint64_t h)
{
    struct nvs_alloc e;
    if (nvs_allocmap_unref(h, NVS_KIND_VMM, -1, &e)) uncharge_entry(&e);
}

NVS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    CUresult r = NVS_CALL(cuMemRelease, (h));
    if (r == CUDA_SUCCESS) handle_unref(h);
    return r;
}

NVS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle h, unsigned long long flags)
{
    CUresult r = NVS_CALL(cuMemMap, (ptr, size, offset, h, flags));
    struct nvs_alloc e;
    if (r != CUDA_SUCCESS || !nvs_allocmap_get(h, NVS_KIND_VMM, &e)) return r; /* imported: not ours */
    nvs_allocmap_unref(h, NVS_KIND_VMM, +1, &e);
    if (nvs_allocmap_put((struct nvs_alloc){.key = ptr, .bytes = size, .aux = h,
                                            .kind = NVS_KIND_MAPPING, .gpu = e.gpu, .refs = 1}) != 0)
        handle_unref(h); /* untracked mapping: at worst uncharged early */
    return r;
}

NVS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult r = NVS_CALL(cuMemUnmap, (ptr, size));
    if (r != CUDA_SUCCESS) return r;
    /* the range may span several mappings, back to back */
    for (uint64_t addr = ptr; addr < ptr + size;) {
        struct nvs_alloc m;
        if (!nvs_allocmap_take(addr, NVS_KIND_MAPPING, &m) || m.bytes == 0) break;
        handle_unref(m.aux);
        addr += m.bytes;
    }
    return r;
}

NVS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    CUresult r = NVS_CALL(cuMemRetainAllocationHandle, (h, addr));
    struct nvs_alloc e;
    if (r == CUDA_SUCCESS && h != NULL) nvs_allocmap_unref(*h, NVS_KIND_VMM, +1, &e);
    return r;
}

/* ---- arrays ---- */

NVS_EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = d ? linear(extent_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuArrayCreate_v2, (a, d));
    return settle(g, r, NVS_KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

NVS_EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c =
        d ? linear(extent_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuArray3DCreate_v2, (a, d));
    return settle(g, r, NVS_KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

NVS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned levels)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = d ? linear(mipmap_bytes(d, levels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_CALL(cuMipmappedArrayCreate, (a, d, levels));
    return settle(g, r, NVS_KIND_MIPMAP, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

/* ---- frees ---- */

NVS_EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    NVS_FREE(NVS_KIND_PTR, p, NVS_CALL(cuMemFree_v2, (p)));
}

NVS_EXPORT CUresult cuArrayDestroy(CUarray a)
{
    NVS_FREE(NVS_KIND_ARRAY, (uint64_t)(uintptr_t)a, NVS_CALL(cuArrayDestroy, (a)));
}

NVS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    NVS_FREE(NVS_KIND_MIPMAP, (uint64_t)(uintptr_t)a, NVS_CALL(cuMipmappedArrayDestroy, (a)));
}

void nvs_alloc_forget_ctx(CUcontext ctx)
{
    nvs_allocmap_take_ctx((uint64_t)(uintptr_t)ctx, uncharge_entry);
}
