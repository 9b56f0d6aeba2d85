/*
 * A fake libnvidia-ml.so.1 matching the fake driver's devices (same UUIDs and size), so tests can
 * check what NVML memory queries report under the hook.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda_api.h"
#include "fake_uuid.h"

#define EXPORT __attribute__((visibility("default")))

static unsigned long long total(void)
{
    const char *v = getenv("NVSHARE_FAKE_GPU_MEM");
    return v != NULL && *v ? strtoull(v, NULL, 0) : 16ull << 30;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *dev)
{
    *dev = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

/* Same bytes as the fake driver: NVSHARE_FAKE_GPU_UUID or 0x10..0x1f, last byte + index. */
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned len)
{
    unsigned char b[16];
    fake_uuid_bytes(b);
    b[15] = (unsigned char)(b[15] + (uintptr_t)dev - 1);
    snprintf(uuid, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    (void)dev;
    mem->total = total();
    mem->used = 0;
    mem->free = mem->total;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    (void)dev;
    mem->total = total();
    mem->reserved = 0;
    mem->used = 0;
    mem->free = mem->total;
    return NVML_SUCCESS;
}
