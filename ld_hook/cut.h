/*
 * The cut: how a gang of processes on several GPUs stops without leaving one of them waiting in
 * a collective for a peer that was stopped before it (appliance/core/gang.py says why).
 *
 * Per GPU, the hook counts the collectives it submits: NCCL's kernels, which NCCL launches with
 * cuLaunchKernelEx in the remote memory-synchronisation domain on Hopper and later. When its
 * gang drops (GANG_DROP) it tells the daemon how many it has begun (GANG_POSITION) and begins no
 * further one; the daemon answers with the gang's furthest count (GANG_CUT). A member that has
 * submitted that many releases like on LOCK_DROP; one behind it asks for its GPU with
 * GANG_CATCHUP until it gets there. GANG_CUT_OVER (every member released) frees collectives
 * again.
 */
#ifndef NVSHARE_CUT_H
#define NVSHARE_CUT_H

#include "gpus.h"

/* Whether a launch is a collective (a few loads; only cuLaunchKernelEx can be one). */
int nvs_is_collective(const CUlaunchConfig *cfg);

/* Around the submission of a collective on g. begin may wait while a drop holds collectives;
 * end returns 1 when this submission reached the cut: the caller then releases the lock. */
void nvs_cut_begin(struct nvs_gpu *g);
int nvs_cut_end(struct nvs_gpu *g);

/* Events from the daemon. on_drop sends GANG_POSITION; on_cut returns 1 when the cut is already
 * reached, 0 when this process is behind it, -1 for a stale cut. */
void nvs_cut_on_drop(struct nvs_gpu *g, uint64_t cut_id);
int nvs_cut_on_cut(struct nvs_gpu *g, uint64_t cut_id, uint64_t collectives);
void nvs_cut_on_over(struct nvs_gpu *g, uint64_t cut_id);
void nvs_cut_on_down(struct nvs_gpu *g); /* no daemon: nothing holds collectives */

/* A cut is known and this process has not submitted that many collectives yet. */
int nvs_cut_behind(struct nvs_gpu *g);
uint64_t nvs_cut_collectives(struct nvs_gpu *g); /* submitted so far (tests, debugging) */

void nvs_cut_start(void);

#endif
