/*
 * Memory as the program sees it: cuMemGetInfo, cuDeviceTotalMem and NVML's memory info report
 * the limit as the total and the limit minus what this process holds as free (never negative),
 * wherever a limit applies. A query registers the process on that GPU.
 */
#include "contexts.h"
#include "dispatch.h"
#include "ledger.h"

NVS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult r = NVS_CALL(cuMemGetInfo_v2, (free_bytes, total_bytes));
    uint64_t limit, used;
    if (r == CUDA_SUCCESS && nvs_ledger_view(nvs_submit_gpu(NULL), &limit, &used)) {
        if (total_bytes) *total_bytes = limit;
        if (free_bytes) *free_bytes = used < limit ? limit - used : 0;
    }
    return r;
}

NVS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r = NVS_CALL(cuDeviceTotalMem_v2, (bytes, dev));
    uint64_t limit, used;
    if (r == CUDA_SUCCESS && bytes != NULL && nvs_ledger_view(nvs_gpu_at(dev), &limit, &used))
        *bytes = limit;
    return r;
}

/* NVML: our GPU by UUID (only GPUs this process uses have one). */
static struct nvs_gpu *nvml_gpu(nvmlDevice_t dev)
{
    char uuid[96];
    if (NVS_CALL(nvmlDeviceGetUUID, (dev, uuid, sizeof uuid)) != NVML_SUCCESS) return NULL;
    return nvs_gpu_by_uuid(uuid);
}

/* Replace what NVML reported with the limit-sized view, where this process has a limit. */
static int nvml_view(nvmlDevice_t dev, unsigned long long *total, unsigned long long *used,
                     unsigned long long *free_bytes)
{
    uint64_t limit, mine;
    if (!nvs_ledger_view(nvml_gpu(dev), &limit, &mine)) return 0;
    *total = limit;
    *used = mine;
    *free_bytes = mine < limit ? limit - mine : 0;
    return 1;
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    nvmlReturn_t r = NVS_CALL(nvmlDeviceGetMemoryInfo, (dev, mem));
    if (r == NVML_SUCCESS && mem != NULL) nvml_view(dev, &mem->total, &mem->used, &mem->free);
    return r;
}

NVS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    nvmlReturn_t r = NVS_CALL(nvmlDeviceGetMemoryInfo_v2, (dev, mem));
    if (r == NVML_SUCCESS && mem != NULL && nvml_view(dev, &mem->total, &mem->used, &mem->free))
        mem->reserved = 0;
    return r;
}
