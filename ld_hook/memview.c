/*
 * Memory as the program sees it: cuMemGetInfo, cuDeviceTotalMem, NVML's memory info (every
 * version) and NVML's process lists show the GPU of shown.c wherever a limit applies: the limit
 * as the total, what the pod holds as used, free the difference (never negative), and the pod's
 * own processes. Without a limit the real answers pass through untouched. A CUDA memory query
 * registers the process on that GPU; an NVML query never does (nvidia-smi, a monitoring thread
 * looking at every GPU).
 */
#include <string.h>

#include "conn.h"
#include "contexts.h"
#include "dispatch.h"
#include "shown.h"

/* The view of a GPU this process uses through CUDA (registering it there). */
static int cuda_shown(struct nvs_gpu *g, struct nvs_shown *v)
{
    if (g == NULL) return 0;
    nvs_conn_use(g);
    return nvs_shown_get(g->uuid, g->total_mem, v);
}

NVS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult r = NVS_CALL(cuMemGetInfo_v2, (free_bytes, total_bytes));
    struct nvs_shown v;
    if (r == CUDA_SUCCESS && cuda_shown(nvs_submit_gpu(NULL), &v)) {
        if (total_bytes) *total_bytes = v.limit;
        if (free_bytes) *free_bytes = v.used < v.limit ? v.limit - v.used : 0;
    }
    return r;
}

NVS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r = NVS_CALL(cuDeviceTotalMem_v2, (bytes, dev));
    struct nvs_shown v;
    if (r == CUDA_SUCCESS && bytes != NULL && cuda_shown(nvs_gpu_at(dev), &v)) *bytes = v.limit;
    return r;
}

/* NVML's device, by UUID (a process that never initialised CUDA has no GPU table). */
static int nvml_shown(nvmlDevice_t dev, uint64_t real_total, struct nvs_shown *v)
{
    char uuid[NVS_UUID_LEN];
    if (NVS_CALL(nvmlDeviceGetUUID, (dev, uuid, sizeof uuid)) != NVML_SUCCESS) return 0;
    return nvs_shown_get(uuid, real_total, v);
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    nvmlReturn_t r = NVS_CALL(nvmlDeviceGetMemoryInfo, (dev, mem));
    struct nvs_shown v;
    if (r == NVML_SUCCESS && mem != NULL && nvml_shown(dev, mem->total, &v)) {
        mem->total = v.limit;
        mem->used = v.used;
        mem->free = v.used < v.limit ? v.limit - v.used : 0;
    }
    return r;
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    nvmlReturn_t r = NVS_CALL(nvmlDeviceGetMemoryInfo_v2, (dev, mem));
    struct nvs_shown v;
    if (r == NVML_SUCCESS && mem != NULL && nvml_shown(dev, mem->total, &v)) {
        mem->total = v.limit;
        mem->reserved = 0; /* the driver's reservation is not the pod's to see */
        mem->used = v.used;
        mem->free = v.used < v.limit ? v.limit - v.used : 0;
    }
    return r;
}

/*
 * The process lists, as NVML answers them: with too small a buffer (or none) the count and
 * INSUFFICIENT_SIZE, with none running a count of 0. The pod's processes are compute processes;
 * its graphics and MPS lists are empty. A _v1 entry is the first 16 bytes of a _v2/_v3 one.
 */
static nvmlReturn_t list_shown(const struct nvs_shown *v, int compute, unsigned *count,
                               void *infos, size_t entry_size)
{
    unsigned n = compute ? v->count : 0;
    if (n > 0 && (infos == NULL || *count < n)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        nvmlProcessInfo_t e = {.pid = v->processes[i].pid,
                               .usedGpuMemory = v->processes[i].used,
                               .gpuInstanceId = 0xFFFFFFFFu, /* no MIG instance, as NVML says */
                               .computeInstanceId = 0xFFFFFFFFu};
        memcpy((char *)infos + i * entry_size, &e, entry_size);
    }
    *count = n;
    return NVML_SUCCESS;
}

#define NVS_LIST_HOOK(name, info, compute)                                                  \
    NVS_EXPORT nvmlReturn_t name(nvmlDevice_t dev, unsigned *count, info *infos)            \
    {                                                                                       \
        struct nvs_shown v;                                                                 \
        if (count == NULL || !nvml_shown(dev, 0, &v)) return NVS_CALL(name, (dev, count, infos)); \
        return list_shown(&v, compute, count, infos, sizeof(info));                         \
    }
NVS_NVML_PROCESS_LISTS(NVS_LIST_HOOK)
