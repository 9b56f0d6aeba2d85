/*
 * The GPU as this process is shown it (cuMemGetInfo, cuDeviceTotalMem, NVML's memory info and
 * process lists): its limit as the total, what its pod (outside pods: the process) holds as
 * used, and the pod's processes with their PIDs as this process sees them. The daemon knows the
 * pod; it is asked on a short connection of its own that needs no registration, since
 * nvidia-smi and monitoring agents never initialise CUDA. This process's own ledger is fresher
 * for its own figure and overrides the daemon's there. Without a daemon the process's own
 * knowledge stands: the limit its ledger applies (NVSHARE_GPU_MEMORY_LIMIT, the limit the
 * daemon published for its pod), and what it holds itself.
 */
#ifndef NVSHARE_SHOWN_H
#define NVSHARE_SHOWN_H

#include "gpus.h"

struct nvs_shown {
    uint64_t limit; /* the total shown, bytes */
    uint64_t used;  /* bytes */
    uint32_t count; /* entries of processes[] */
    struct nvs_view_process processes[NVS_VIEW_MAX_PROCESSES];
};

/* 1 when a limit applies on the GPU `uuid` (then *out is set); 0: show the real GPU.
 * real_total: its size as the driver or NVML reports it. No hook lock held by the caller. */
int nvs_shown_get(const char *uuid, uint64_t real_total, struct nvs_shown *out);
void nvs_shown_after_fork(void);

#endif
