/*
 * The GPU table: one entry per device the process sees, with its identity (UUID and real size,
 * read from the driver on first use). Every per-GPU module (connection, gate, ledger, captures)
 * keeps its own state in an array indexed like this table.
 */
#ifndef NVSHARE_GPUS_H
#define NVSHARE_GPUS_H

#include <pthread.h>
#include <stdatomic.h>

#include "nvshare.h"

#define NVS_MAX_GPUS 64

struct nvs_gpu {
    int index;
    uint64_t bit; /* 1 << index: a GPU in the per-thread in-flight masks */
    pthread_mutex_t mu;
    int identified;
    char uuid[NVS_UUID_LEN];
    uint64_t total_mem;
};

extern struct nvs_gpu nvs_gpu_table[NVS_MAX_GPUS];
extern _Atomic(struct nvs_gpu *) nvs_single_gpu; /* set when the process sees exactly one GPU */

void nvs_gpus_init(int count);
int nvs_gpu_count(void);
struct nvs_gpu *nvs_gpu_at(int index); /* NULL when out of range or not started */
void nvs_gpu_identify(struct nvs_gpu *g);
struct nvs_gpu *nvs_gpu_by_uuid(const char *uuid); /* only GPUs already identified */
void nvs_gpus_after_fork(void);

#endif
