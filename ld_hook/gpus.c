/* The GPU table (see gpus.h). */
#include <stdio.h>
#include <string.h>

#include "dispatch.h"
#include "gpus.h"
#include "log.h"

struct nvs_gpu nvs_gpu_table[NVS_MAX_GPUS];
_Atomic(struct nvs_gpu *) nvs_single_gpu;
static atomic_int gpu_count;

void nvs_gpus_init(int count)
{
    if (count > NVS_MAX_GPUS) {
        nvs_log("this process sees %d GPUs; only the first %d are shared", count, NVS_MAX_GPUS);
        count = NVS_MAX_GPUS;
    }
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        struct nvs_gpu *g = &nvs_gpu_table[i];
        memset(g, 0, sizeof *g);
        g->index = i;
        g->bit = 1ull << i;
        pthread_mutex_init(&g->mu, NULL);
    }
    atomic_store_explicit(&gpu_count, count < 0 ? 0 : count, memory_order_release);
    atomic_store(&nvs_single_gpu, count == 1 ? &nvs_gpu_table[0] : NULL);
}

int nvs_gpu_count(void) { return atomic_load_explicit(&gpu_count, memory_order_acquire); }

struct nvs_gpu *nvs_gpu_at(int index)
{
    return index >= 0 && index < nvs_gpu_count() ? &nvs_gpu_table[index] : NULL;
}

void nvs_gpu_identify(struct nvs_gpu *g)
{
    nvs_mutex_lock(&g->mu);
    if (!g->identified) {
        CUuuid u;
        memset(&u, 0, sizeof u);
        if (NVS_CALL(cuDeviceGetUuid_v2, (&u, g->index)) != CUDA_SUCCESS)
            NVS_CALL(cuDeviceGetUuid, (&u, g->index));
        const unsigned char *b = u.bytes;
        snprintf(g->uuid, sizeof g->uuid,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
        size_t total = 0;
        if (NVS_CALL(cuDeviceTotalMem_v2, (&total, g->index)) == CUDA_SUCCESS) g->total_mem = total;
        g->identified = 1;
    }
    nvs_mutex_unlock(&g->mu);
}

struct nvs_gpu *nvs_gpu_by_uuid(const char *uuid)
{
    for (int i = 0; i < nvs_gpu_count(); i++) {
        struct nvs_gpu *g = &nvs_gpu_table[i];
        nvs_mutex_lock(&g->mu);
        int same = g->identified && strcmp(g->uuid, uuid) == 0;
        nvs_mutex_unlock(&g->mu);
        if (same) return g;
    }
    return NULL;
}

void nvs_gpus_after_fork(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++) pthread_mutex_init(&nvs_gpu_table[i].mu, NULL);
}
