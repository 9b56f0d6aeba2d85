/*
 * Stream-ordered pools, charged by what the driver really reserves for them: a pool keeps freed
 * memory cached up to its release threshold (RMM and TensorRT set it to the maximum). Read back
 * from the pool's reserved-memory attribute after every pool allocation and free, before an
 * allocation is refused, and on every service tick, together with the graph pool (graphs.h).
 */
#ifndef NVSHARE_POOLS_H
#define NVSHARE_POOLS_H

#include "gpus.h"

/* Re-reads g's pools and graph memory and settles their charges (no limit check); 1 when a
 * charge went down. */
int nvs_pools_settle(struct nvs_gpu *g);
void nvs_pools_after_fork(void);

#endif
