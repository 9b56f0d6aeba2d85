/*
 * Stream-ordered pools and graph memory, charged by what the driver really reserves for them:
 * a pool keeps freed memory cached up to its release threshold (RMM and TensorRT set it to the
 * maximum), and graphs reserve their memory nodes when they are uploaded or first launched, not
 * when they are captured. Both are read back from the driver's reserved-memory attributes after
 * every pool allocation and free, after a graph's first launch or upload, before an allocation
 * is refused, and on every service tick.
 */
#ifndef NVSHARE_POOLS_H
#define NVSHARE_POOLS_H

#include "gpus.h"

/* Re-reads g's pools and graph memory and settles their charges (no limit check); 1 when a
 * charge went down. */
int nvs_pools_settle(struct nvs_gpu *g);
/* After a graph launch or upload on g: measure its memory the first time this graph runs. */
void nvs_graph_ran(struct nvs_gpu *g, CUgraphExec exec);
void nvs_pools_after_fork(void);

#endif
