/*
 * Pacing: a holder told a queue bound with its grant (nvs_lock_grant.queue_us: it runs on a GPU
 * that a client of higher priority lent it and takes back at once, beside what the holder has
 * queued) keeps about that much of its work queued ahead of the GPU and no more, so that the
 * lender's next request shares the GPU with little of it. What a kernel or graph launch does:
 *   - before it, once `depth` of this process's launches on the GPU are unfinished, it waits
 *     for the oldest (a thread in that wait is busy, not idle: gate.h);
 *   - after it, it records an event behind it on its stream (a ring of 64 per GPU).
 * The depth is learned from those waits: each one measures how long the oldest launch took from
 * its submission to its completion (what was queued ahead of it, and itself), and the depth
 * moves halfway to the one that makes that time the bound, never under 2 (the GPU never runs dry
 * while the host wakes) nor over 64. Short kernels get a deep queue, long ones a shallow one;
 * a launch longer than the bound cannot be split: two of them may be queued.
 * Not while a stream capture runs on the GPU (a record would join the capture, a wait would break
 * it): the ring's driver calls run under the capture fence, in relaxed capture mode (a global
 * capture on another GPU is not broken either). Only the context the ring's events belong to is
 * paced (the primary context, in practice); a launch in another is not. Graph uploads are paced as
 * launches; copies are not.
 * No bound told (every grant but a borrower's): two relaxed loads per launch.
 */
#ifndef NVSHARE_PACE_H
#define NVSHARE_PACE_H

#include "gpus.h"

extern _Atomic uint64_t nvs_pace_bound_ns[NVS_MAX_GPUS]; /* 0: not paced */

/* HOT PATH: whether launches on g are paced now. */
static inline int nvs_paced(const struct nvs_gpu *g)
{
    return g != NULL &&
           NVS_UNLIKELY(atomic_load_explicit(&nvs_pace_bound_ns[g->index], memory_order_relaxed) != 0);
}

/* The bound the grant told (microseconds; 0: none), or 0 when the lock is not held. */
void nvs_pace_set(const struct nvs_gpu *g, uint64_t bound_us);
/* Around a launch on stream s of g, when nvs_paced(g): waits for room; records it (launched). */
void nvs_pace_before(const struct nvs_gpu *g);
void nvs_pace_after(const struct nvs_gpu *g, CUstream s);
/* In the child of fork(): the parent's events are not the child's. */
void nvs_pace_after_fork(void);

#endif
