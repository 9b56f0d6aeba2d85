/*
 * A fake libnvidia-ml.so.1 matching the fake driver's devices (same UUIDs, size and count), so
 * tests can check what NVML memory queries report under the hook, and so the node daemon's NVML
 * source (appliance/gpu/nvml.py, through the real pynvml) can be driven without a GPU.
 *
 * What the devices look like in use comes from the file named by NVSHARE_FAKE_NVML_STATE, read
 * at every query so a test can change it while a daemon runs: one line per device,
 * "INDEX USED_BYTES PROCESSES UTILIZATION_PERCENT [PID[:BYTES] ...]" ('#' starts a comment).
 * The compute-process list has PROCESSES entries: the PIDs given first (a test's real
 * processes, each holding BYTES or an equal share of USED_BYTES), then made-up PIDs
 * 40000 + 100 * INDEX + n. A device without a line, or no file at all, is idle: nothing used,
 * no processes, 0%.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda_api.h"
#include "fake_uuid.h"

#define EXPORT __attribute__((visibility("default")))

/* Return codes and structures beyond what the hook itself needs (nvml.h's values). */
#define FAKE_NVML_ERROR_INVALID_ARGUMENT 2
#define FAKE_NVML_ERROR_NOT_SUPPORTED 3
#define FAKE_NVML_ERROR_INSUFFICIENT_SIZE 7
#define FAKE_NVML_ERROR_NOT_FOUND 6
#define FAKE_NVML_ERROR_TIMEOUT 10
#define FAKE_NVML_DEVICE_NAME "NVIDIA Fake GPU"

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} fake_nvml_utilization_t;

#define FAKE_NVML_MAX_LISTED 16

struct fake_usage {
    unsigned long long used;
    unsigned processes;
    unsigned utilization;
    unsigned listed; /* how many of pids[] the line named */
    unsigned pids[FAKE_NVML_MAX_LISTED];
    unsigned long long held[FAKE_NVML_MAX_LISTED]; /* 0: an equal share of used */
};

/* The "PID[:BYTES]" words after the four counts, as many as fit. */
static void parse_listed(const char *rest, struct fake_usage *u)
{
    int consumed = 0;
    unsigned pid;
    while (u->listed < FAKE_NVML_MAX_LISTED && sscanf(rest, " %u%n", &pid, &consumed) == 1) {
        rest += consumed;
        unsigned long long bytes = 0;
        if (*rest == ':' && sscanf(rest + 1, "%llu%n", &bytes, &consumed) == 1) rest += 1 + consumed;
        u->pids[u->listed] = pid;
        u->held[u->listed] = bytes;
        u->listed++;
    }
}

static unsigned long long total(void)
{
    const char *v = getenv("NVSHARE_FAKE_GPU_MEM");
    return v != NULL && *v ? strtoull(v, NULL, 0) : 16ull << 30;
}

static unsigned count(void)
{
    const char *v = getenv("NVSHARE_FAKE_GPU_COUNT");
    unsigned n = v != NULL && *v ? (unsigned)strtoul(v, NULL, 0) : 1;
    return n > 0 && n <= 16 ? n : 1;
}

static unsigned device_index(nvmlDevice_t dev) { return (unsigned)((uintptr_t)dev - 1); }

static struct fake_usage usage(nvmlDevice_t dev)
{
    struct fake_usage u = {0};
    const char *path = getenv("NVSHARE_FAKE_NVML_STATE");
    FILE *f = path != NULL && *path ? fopen(path, "r") : NULL;
    if (f == NULL) return u;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned index, processes, utilization;
        unsigned long long used;
        int consumed = 0;
        if (line[0] == '#') continue;
        if (sscanf(line, "%u %llu %u %u%n", &index, &used, &processes, &utilization, &consumed) ==
                4 &&
            index == device_index(dev)) {
            u = (struct fake_usage){0};
            u.used = used < total() ? used : total();
            u.processes = processes;
            u.utilization = utilization <= 100 ? utilization : 100;
            parse_listed(line + consumed, &u);
            if (u.listed > u.processes) u.listed = u.processes;
        }
    }
    fclose(f);
    return u;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned flags)
{
    (void)flags;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case FAKE_NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case FAKE_NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case FAKE_NVML_ERROR_NOT_FOUND: return "Not Found";
    case FAKE_NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case FAKE_NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n)
{
    *n = count();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *dev)
{
    if (index >= count()) return FAKE_NVML_ERROR_INVALID_ARGUMENT;
    *dev = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned len)
{
    (void)dev;
    snprintf(name, len, "%s", FAKE_NVML_DEVICE_NAME);
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
    mem->total = total();
    mem->used = usage(dev).used;
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    mem->total = total();
    mem->reserved = 0;
    mem->used = usage(dev).used;
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev)
{
    char mine[96];
    for (unsigned i = 0; i < count(); i++) {
        nvmlDevice_t candidate = (nvmlDevice_t)(uintptr_t)(i + 1);
        nvmlDeviceGetUUID(candidate, mine, sizeof mine);
        if (strcmp(mine, uuid) == 0) {
            *dev = candidate;
            return NVML_SUCCESS;
        }
    }
    return FAKE_NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, fake_nvml_utilization_t *u)
{
    u->gpu = usage(dev).utilization;
    u->memory = 0;
    return NVML_SUCCESS;
}

/* As NVML: with too small a buffer (or none), say how many there are and fail with
 * INSUFFICIENT_SIZE; with none running, succeed with a count of 0. A _v1 entry is the first 16
 * bytes of a _v2/_v3 one. The fake's processes are all compute processes. */
static nvmlReturn_t list_processes(nvmlDevice_t dev, unsigned *n, void *infos, size_t entry_size,
                                   int compute)
{
    struct fake_usage u = usage(dev);
    unsigned count = compute ? u.processes : 0;
    if (count == 0) {
        *n = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *n < count) {
        *n = count;
        return FAKE_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < count; i++) {
        int listed = i < u.listed;
        nvmlProcessInfo_t e = {
            .pid = listed ? u.pids[i] : 40000 + 100 * device_index(dev) + i,
            .usedGpuMemory = listed && u.held[i] ? u.held[i] : u.used / count,
            .gpuInstanceId = 0xFFFFFFFFu,
            .computeInstanceId = 0xFFFFFFFFu,
        };
        memcpy((char *)infos + i * entry_size, &e, entry_size);
    }
    *n = count;
    return NVML_SUCCESS;
}

#define FAKE_LIST(name, info, compute)                                     \
    EXPORT nvmlReturn_t name(nvmlDevice_t dev, unsigned *n, info *infos)   \
    {                                                                      \
        return list_processes(dev, n, infos, sizeof(info), compute);       \
    }
NVS_NVML_PROCESS_LISTS(FAKE_LIST)

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned *current, unsigned *pending)
{
    (void)dev;
    (void)current;
    (void)pending;
    return FAKE_NVML_ERROR_NOT_SUPPORTED;
}

/* XID events: a set that never has one to report. */
EXPORT nvmlReturn_t nvmlEventSetCreate(void **set)
{
    static int the_set;
    *set = &the_set;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, void *set)
{
    (void)dev;
    (void)types;
    (void)set;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(void *set, void *data, unsigned timeout_ms)
{
    (void)set;
    (void)data;
    (void)timeout_ms;
    return FAKE_NVML_ERROR_TIMEOUT;
}

EXPORT nvmlReturn_t nvmlEventSetFree(void *set)
{
    (void)set;
    return NVML_SUCCESS;
}
