/*
 * The memory ledger: every device allocation path is checked and charged before the real call,
 * rolled back if the driver fails it, and remembered in a hash map so the matching free is O(1).
 * Charges are at driver granularity (2 MiB for linear memory; arrays from format, channels and
 * extent). Usage is the bytes allocated through these paths: the CUDA context itself is NOT charged
 * (a project decision: its size depends on the driver and the GPU, not on the program).
 *
 * Two limits apply: the process's own view (min of NVSHARE_GPU_MEMORY_LIMIT and the daemon's
 * mem_limit) and a reservation against the pod-wide ledger kept by the daemon, taken in chunks so
 * that most allocations need no round trip.
 *
 * Known gap: stream-ordered allocations (cuMemAllocAsync, cuMemAllocFromPoolAsync) are charged per
 * allocation, but memory a pool keeps cached inside the driver after cuMemFreeAsync (up to its
 * release threshold) is invisible to the hook, as are graph memory nodes.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "nvshare.h"

#define GRANULE (2ull << 20)
#define RETURN_THRESHOLD (256ull << 20)
#define RESERVE_TIMEOUT_S 10

enum alloc_kind { KIND_PTR = 1, KIND_ARRAY, KIND_MIPMAP, KIND_VMM };

struct alloc_entry {
    uint64_t key; /* 0 = empty */
    uint64_t bytes;
    uint32_t kind;
    int32_t gpu;
};

/* Open addressing with linear probing and backward-shift deletion; grows at half load. */
static struct {
    pthread_mutex_t mu;
    struct alloc_entry *slots;
    size_t cap, used;
} live = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t slot_of(uint64_t key, uint32_t kind, size_t cap)
{
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int map_grow(void)
{
    size_t cap = live.cap ? live.cap * 2 : 1024;
    struct alloc_entry *slots = calloc(cap, sizeof *slots);
    if (slots == NULL) return -1;
    for (size_t i = 0; i < live.cap; i++) {
        struct alloc_entry e = live.slots[i];
        if (e.key == 0) continue;
        size_t s = slot_of(e.key, e.kind, cap);
        while (slots[s].key != 0) s = (s + 1) & (cap - 1);
        slots[s] = e;
    }
    free(live.slots);
    live.slots = slots;
    live.cap = cap;
    return 0;
}

static int map_put(struct alloc_entry e)
{
    pthread_mutex_lock(&live.mu);
    if ((live.used + 1) * 2 > live.cap && map_grow() != 0) {
        pthread_mutex_unlock(&live.mu);
        return -1;
    }
    size_t s = slot_of(e.key, e.kind, live.cap);
    while (live.slots[s].key != 0 && !(live.slots[s].key == e.key && live.slots[s].kind == e.kind))
        s = (s + 1) & (live.cap - 1);
    if (live.slots[s].key == 0) live.used++;
    live.slots[s] = e;
    pthread_mutex_unlock(&live.mu);
    return 0;
}

static int map_take(uint64_t key, uint32_t kind, struct alloc_entry *out)
{
    int found = 0;
    pthread_mutex_lock(&live.mu);
    if (live.cap > 0 && key != 0) {
        size_t mask = live.cap - 1, s = slot_of(key, kind, live.cap);
        while (live.slots[s].key != 0 && !(live.slots[s].key == key && live.slots[s].kind == kind))
            s = (s + 1) & mask;
        if (live.slots[s].key != 0) {
            *out = live.slots[s];
            found = 1;
            live.used--;
            /* backward-shift: pull later members of the probe run into the hole */
            size_t hole = s;
            for (size_t j = (s + 1) & mask; live.slots[j].key != 0; j = (j + 1) & mask) {
                size_t home = slot_of(live.slots[j].key, live.slots[j].kind, live.cap);
                if (((j - home) & mask) >= ((j - hole) & mask)) {
                    live.slots[hole] = live.slots[j];
                    hole = j;
                }
            }
            live.slots[hole].key = 0;
        }
    }
    pthread_mutex_unlock(&live.mu);
    return found;
}

void nvs_memory_after_fork(void)
{
    pthread_mutex_init(&live.mu, NULL);
    free(live.slots);
    live.slots = NULL;
    live.cap = live.used = 0;
}

static uint64_t min_limit(uint64_t a, uint64_t b)
{
    if (a == 0) return b;
    if (b == 0) return a;
    return a < b ? a : b;
}

uint64_t nvs_effective_limit(const struct nvs_gpu *g)
{
    uint64_t limit = min_limit(nvs_cfg.env_mem_limit, g->have_limits ? g->limits.mem_limit : 0);
    if (g->have_limits && g->limits.backing == NVS_BACKING_MANAGED &&
        !(g->limits.flags & NVS_LIMIT_SINGLE_OVERSUB))
        limit = min_limit(limit, g->total_mem);
    return limit;
}

static int backing_managed(struct nvs_gpu *g)
{
    pthread_mutex_lock(&g->mu);
    int managed = g->have_limits && g->limits.backing == NVS_BACKING_MANAGED;
    pthread_mutex_unlock(&g->mu);
    return managed;
}

/* With g->mu held: give back every byte of reservation not backing an allocation. */
void nvs_return_unused(struct nvs_gpu *g)
{
    if (g->state != NVS_CONNECTED || g->reserving || g->reserved <= g->usage) return;
    struct nvs_mem_return body = {.bytes = g->reserved - g->usage, .used = g->usage};
    g->reserved = g->usage;
    g->reported = g->usage;
    nvs_send(g, NVS_MSG_MEM_RETURN, ++g->seq, &body, sizeof body);
}

/* With g->mu held: tell the daemon our usage if it changed since it last heard it (status and
 * metrics show it; after a reconnect the new daemon's ledger counts it). A MEM_RETURN of 0 bytes. */
void nvs_report_usage(struct nvs_gpu *g)
{
    if (g->state != NVS_CONNECTED || g->reserving || g->reported == g->usage) return;
    struct nvs_mem_return body = {.bytes = 0, .used = g->usage};
    g->reported = g->usage;
    nvs_send(g, NVS_MSG_MEM_RETURN, ++g->seq, &body, sizeof body);
}

/* With g->mu held: ask the daemon for `need` more bytes of reservation. 0 = we have them. */
static int reserve(struct nvs_gpu *g, uint64_t need)
{
    struct nvs_mem_reserve body = {.bytes = need, .used = g->usage};
    g->reported = g->usage;
    uint64_t seq = ++g->seq;
    g->reserving = 1;
    g->mem_replied = g->mem_error = 0;
    g->mem_wait_seq = seq;
    if (nvs_send(g, NVS_MSG_MEM_RESERVE, seq, &body, sizeof body) != 0) g->mem_replied = g->mem_error = 1;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += RESERVE_TIMEOUT_S;
    while (!g->mem_replied)
        if (pthread_cond_timedwait(&g->cv, &g->mu, &deadline) != 0 && !g->mem_replied) {
            NVS_DEBUG("GPU %d: no answer to a memory reservation; deciding locally", g->index);
            g->mem_error = 1;
            break;
        }
    g->reserving = 0;
    pthread_cond_broadcast(&g->cv);
    if (g->mem_error) return 0; /* fail-soft: the local limit alone decides */
    g->reserved += g->mem_reply.granted;
    return g->mem_reply.granted == 0 ? -1 : 0;
}

/* Check and charge `bytes` on g before the real call. Returns 0 or CUDA_ERROR_OUT_OF_MEMORY. */
static CUresult charge(struct nvs_gpu *g, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return CUDA_SUCCESS;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g->mu);
    nvs_gpu_use(g);
    while (g->reserving) pthread_cond_wait(&g->cv, &g->mu);
    uint64_t limit = nvs_effective_limit(g);
    if (limit != 0 && (g->usage > limit || bytes > limit - g->usage)) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (g->state == NVS_CONNECTED && g->usage + bytes > g->reserved) {
        if (reserve(g, g->usage + bytes - g->reserved) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
        limit = nvs_effective_limit(g); /* may have changed while we waited */
        if (limit != 0 && (g->usage > limit || bytes > limit - g->usage)) r = CUDA_ERROR_OUT_OF_MEMORY;
        if (g->state == NVS_CONNECTED && r == CUDA_SUCCESS && g->usage + bytes > g->reserved)
            r = CUDA_ERROR_OUT_OF_MEMORY; /* granted less than asked */
    }
    if (r == CUDA_SUCCESS) g->usage += bytes;
    NVS_DEBUG("GPU %d: charge %llu -> %s (usage %llu, limit %llu, reserved %llu)", g->index,
              (unsigned long long)bytes, r == CUDA_SUCCESS ? "ok" : "refused",
              (unsigned long long)g->usage, (unsigned long long)limit,
              (unsigned long long)g->reserved);
    pthread_mutex_unlock(&g->mu);
    return r;
}

static void uncharge(struct nvs_gpu *g, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return;
    pthread_mutex_lock(&g->mu);
    g->usage = bytes > g->usage ? 0 : g->usage - bytes;
    if (g->reserved > g->usage && g->reserved - g->usage > RETURN_THRESHOLD) nvs_return_unused(g);
    pthread_mutex_unlock(&g->mu);
}

/* After the real call: remember a success, roll the charge back on failure. */
static CUresult settle(struct nvs_gpu *g, CUresult r, uint32_t kind, uint64_t key, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return r;
    if (r != CUDA_SUCCESS || key == 0 ||
        map_put((struct alloc_entry){.key = key, .bytes = bytes, .kind = kind, .gpu = g->index}) != 0)
        uncharge(g, bytes);
    return r;
}

/* Forget `key` and release its charge once the real free succeeded. */
#define NVS_FREE(kind, key, call)                                                    \
    do {                                                                             \
        struct alloc_entry e_;                                                       \
        int known_ = map_take((key), (kind), &e_);                                   \
        CUresult r_ = (call);                                                        \
        if (known_ && r_ == CUDA_SUCCESS) uncharge(nvs_gpu_by_index(e_.gpu), e_.bytes); \
        else if (known_) map_put(e_);                                                \
        return r_;                                                                   \
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

static struct nvs_gpu *memory_gpu(void) { return nvs_current_gpu(); }

NVS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r;
    if (g != NULL && backing_managed(g) && NVS_REAL(cuMemAllocManaged) != NULL)
        r = NVS_REAL(cuMemAllocManaged)(p, bytes, CU_MEM_ATTACH_GLOBAL);
    else
        r = NVS_REAL(cuMemAlloc_v2) ? NVS_REAL(cuMemAlloc_v2)(p, bytes) : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_PTR, r == CUDA_SUCCESS ? *p : 0, c);
}

NVS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height,
                                       unsigned elem)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t estimate = linear(round_up(width, 512) * height);
    if (charge(g, estimate) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_REAL(cuMemAllocPitch_v2)
                     ? NVS_REAL(cuMemAllocPitch_v2)(p, pitch, width, height, elem)
                     : CUDA_ERROR_NOT_FOUND;
    uint64_t actual = r == CUDA_SUCCESS ? linear((uint64_t)*pitch * height) : estimate;
    if (actual > estimate && charge(g, actual - estimate) != CUDA_SUCCESS) {
        NVS_REAL(cuMemFree_v2)(*p);
        uncharge(g, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) uncharge(g, estimate - actual);
    return settle(g, r, KIND_PTR, r == CUDA_SUCCESS ? *p : 0, actual);
}

NVS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_REAL(cuMemAllocManaged) ? NVS_REAL(cuMemAllocManaged)(p, bytes, flags)
                                             : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_PTR, r == CUDA_SUCCESS ? *p : 0, c);
}

#define NVS_ALLOC_ASYNC(name, params, call_args)                                               \
    NVS_EXPORT CUresult name params                                                            \
    {                                                                                          \
        struct nvs_gpu *g = memory_gpu();                                                      \
        uint64_t c = linear(bytes);                                                            \
        if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;                     \
        CUresult r = NVS_REAL(name) ? NVS_REAL(name) call_args : CUDA_ERROR_NOT_FOUND;         \
        return settle(g, r, KIND_PTR, r == CUDA_SUCCESS ? *p : 0, c);                          \
    }
NVS_ALLOC_ASYNC(cuMemAllocAsync, (CUdeviceptr * p, size_t bytes, CUstream s), (p, bytes, s))
NVS_ALLOC_ASYNC(cuMemAllocAsync_ptsz, (CUdeviceptr * p, size_t bytes, CUstream s), (p, bytes, s))
NVS_ALLOC_ASYNC(cuMemAllocFromPoolAsync,
                (CUdeviceptr * p, size_t bytes, CUmemoryPool pool, CUstream s), (p, bytes, pool, s))
NVS_ALLOC_ASYNC(cuMemAllocFromPoolAsync_ptsz,
                (CUdeviceptr * p, size_t bytes, CUmemoryPool pool, CUstream s), (p, bytes, pool, s))

NVS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    struct nvs_gpu *g = prop != NULL && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                            ? nvs_gpu_by_index(prop->location.id)
                            : NULL;
    uint64_t c = linear(bytes);
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_REAL(cuMemCreate) ? NVS_REAL(cuMemCreate)(h, bytes, prop, flags)
                                       : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_VMM, r == CUDA_SUCCESS ? *h : 0, c);
}

NVS_EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = d ? linear(extent_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_REAL(cuArrayCreate_v2) ? NVS_REAL(cuArrayCreate_v2)(a, d) : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

NVS_EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c =
        d ? linear(extent_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r =
        NVS_REAL(cuArray3DCreate_v2) ? NVS_REAL(cuArray3DCreate_v2)(a, d) : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

NVS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned levels)
{
    struct nvs_gpu *g = memory_gpu();
    uint64_t c = d ? linear(mipmap_bytes(d, levels)) : 0;
    if (charge(g, c) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NVS_REAL(cuMipmappedArrayCreate) ? NVS_REAL(cuMipmappedArrayCreate)(a, d, levels)
                                                  : CUDA_ERROR_NOT_FOUND;
    return settle(g, r, KIND_MIPMAP, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*a : 0, c);
}

static CUresult missing(void) { return CUDA_ERROR_NOT_FOUND; }
#define NVS_CALL(name, args) (NVS_REAL(name) ? NVS_REAL(name) args : missing())

NVS_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { NVS_FREE(KIND_PTR, p, NVS_CALL(cuMemFree_v2, (p))); }

NVS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    NVS_FREE(KIND_PTR, p, NVS_CALL(cuMemFreeAsync, (p, s)));
}

NVS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    NVS_FREE(KIND_PTR, p, NVS_CALL(cuMemFreeAsync_ptsz, (p, s)));
}

NVS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    NVS_FREE(KIND_VMM, h, NVS_CALL(cuMemRelease, (h)));
}

NVS_EXPORT CUresult cuArrayDestroy(CUarray a)
{
    NVS_FREE(KIND_ARRAY, (uint64_t)(uintptr_t)a, NVS_CALL(cuArrayDestroy, (a)));
}

NVS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    NVS_FREE(KIND_MIPMAP, (uint64_t)(uintptr_t)a, NVS_CALL(cuMipmappedArrayDestroy, (a)));
}

/* What the program sees: the limit as the total, the limit minus usage as free (never negative). */
static int view(struct nvs_gpu *g, uint64_t *limit, uint64_t *usage)
{
    if (g == NULL) return 0;
    pthread_mutex_lock(&g->mu);
    nvs_gpu_use(g);
    *limit = nvs_effective_limit(g);
    *usage = g->usage;
    pthread_mutex_unlock(&g->mu);
    return *limit != 0;
}

NVS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult r = NVS_CALL(cuMemGetInfo_v2, (free_bytes, total_bytes));
    uint64_t limit, usage;
    if (r == CUDA_SUCCESS && view(memory_gpu(), &limit, &usage)) {
        if (total_bytes) *total_bytes = limit;
        if (free_bytes) *free_bytes = usage < limit ? limit - usage : 0;
    }
    return r;
}

NVS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r = NVS_CALL(cuDeviceTotalMem_v2, (bytes, dev));
    uint64_t limit, usage;
    if (r == CUDA_SUCCESS && bytes != NULL && view(nvs_gpu_by_index(dev), &limit, &usage))
        *bytes = limit;
    return r;
}

/* NVML: find our GPU by UUID (only GPUs this process uses have one). */
static struct nvs_gpu *nvml_gpu(nvmlDevice_t dev)
{
    __typeof__(&nvmlDeviceGetUUID) get_uuid = NVS_EXTRA(nvmlDeviceGetUUID, 1, "nvmlDeviceGetUUID");
    char uuid[96];
    if (get_uuid == NULL || get_uuid(dev, uuid, sizeof uuid) != NVML_SUCCESS) return NULL;
    int n = atomic_load(&nvs_ngpus);
    for (int i = 0; i < n; i++) {
        struct nvs_gpu *g = &nvs_gpus[i];
        pthread_mutex_lock(&g->mu);
        int same = g->state != NVS_UNUSED && strcmp(g->uuid, uuid) == 0;
        pthread_mutex_unlock(&g->mu);
        if (same) return g;
    }
    return NULL;
}

/* Replace what NVML reported with the limit-sized view, where this process has a limit. */
static int nvml_view(nvmlDevice_t dev, unsigned long long *total, unsigned long long *used,
                     unsigned long long *free_bytes)
{
    uint64_t limit, usage;
    if (!view(nvml_gpu(dev), &limit, &usage)) return 0;
    *total = limit;
    *used = usage;
    *free_bytes = usage < limit ? limit - usage : 0;
    return 1;
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    __typeof__(&nvmlDeviceGetMemoryInfo) real = NVS_REAL(nvmlDeviceGetMemoryInfo);
    if (real == NULL) return 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    nvmlReturn_t r = real(dev, mem);
    if (r == NVML_SUCCESS && mem != NULL) nvml_view(dev, &mem->total, &mem->used, &mem->free);
    return r;
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) real = NVS_REAL(nvmlDeviceGetMemoryInfo_v2);
    if (real == NULL) return 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    nvmlReturn_t r = real(dev, mem);
    if (r == NVML_SUCCESS && mem != NULL && nvml_view(dev, &mem->total, &mem->used, &mem->free))
        mem->reserved = 0;
    return r;
}
