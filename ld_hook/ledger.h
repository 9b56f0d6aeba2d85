/*
 * The memory ledger, per GPU: what this process holds (allocations, pool and graph reservations,
 * and memory NVML shows it holding beyond those), the limit that applies, and the reservation
 * against the pod-wide ledger the daemon keeps, taken in chunks so most allocations need no
 * round trip. Charges are checked and made before the real call (nvs_ledger_charge) and rolled
 * back on failure (nvs_ledger_uncharge).
 */
#ifndef NVSHARE_LEDGER_H
#define NVSHARE_LEDGER_H

#include "gpus.h"

/* CUDA_ERROR_OUT_OF_MEMORY when refused; a refusal decided here (not by the daemon) is counted
 * for the daemon (MEM_REFUSALS). */
CUresult nvs_ledger_charge(struct nvs_gpu *g, uint64_t bytes);
void nvs_ledger_force(struct nvs_gpu *g, uint64_t bytes);      /* already held: no check */
void nvs_ledger_uncharge(struct nvs_gpu *g, uint64_t bytes);
/* What this process alone knows of g, without registering: the limit that applies here
 * (0 = none) and what the process holds. */
void nvs_ledger_peek(struct nvs_gpu *g, uint64_t *limit, uint64_t *used);
int nvs_ledger_backing_managed(struct nvs_gpu *g);

/* Events from the session (no hook lock held by the caller). */
void nvs_ledger_start(void);
void nvs_ledger_on_registered(struct nvs_gpu *g, const struct nvs_limits *lim);
void nvs_ledger_on_limits(struct nvs_gpu *g, const struct nvs_limits *lim);
void nvs_ledger_on_grant(struct nvs_gpu *g, uint64_t seq, const struct nvs_mem_grant *grant);
void nvs_ledger_on_refused(struct nvs_gpu *g, uint64_t seq);
void nvs_ledger_on_observed(struct nvs_gpu *g, const struct nvs_mem_observed *obs);
void nvs_ledger_on_peers(struct nvs_gpu *g, const struct nvs_ledger_peers *peers);
void nvs_ledger_on_reclaim(struct nvs_gpu *g); /* a peer was refused: give back what is unused */
void nvs_ledger_on_down(struct nvs_gpu *g);
void nvs_ledger_tick(struct nvs_gpu *g, uint64_t now_ns); /* usage reports, idle surplus */
void nvs_ledger_after_fork(void);

#endif
