/*
 * The gate: per GPU, the lock state machine that decides whether this process may submit work,
 * and the hot path every submission passes.
 *
 * States (enum nvs_lock_state) and what moves them:
 *   UNUSED     -> first submission registers         -> IDLE (gated) / UNGATED (mode off)
 *   UNGATED    no scheduler gates this GPU (mode off, daemon gone, lock refused); open
 *   IDLE       -> a submission asks for the lock     -> REQUESTED
 *              -> LOCK_LENT                          -> LENT
 *   LENT       the idle GPU is lent to lower priorities, who give it back at once; closed
 *              -> a submission asks for the lock     -> TAKING (it does not wait)
 *              -> LOCK_UNLENT                        -> IDLE
 *   TAKING     open: asked, and submitting meanwhile
 *              -> LOCK_GRANT -> HELD;  LOCK_UNLENT (asked too late) -> REQUESTED
 *   REQUESTED  -> LOCK_GRANT                         -> HELD
 *   HELD       open; -> LOCK_DROP or idle            -> RELEASING
 *              (LOCK_TERMS changes how long idle is: short while others wait)
 *   RELEASING  still open while a stream capture on this GPU runs (at most one quantum)
 *              -> DRAINING
 *   DRAINING   closed; the drainer waits for submissions in flight, synchronises every context
 *              of the GPU, sends LOCK_RELEASED       -> IDLE
 * Any state -> daemon gone -> UNGATED; LIMIT_UPDATE switches between UNGATED and IDLE.
 *
 * In flight: every submitting thread marks the GPUs it is submitting to in its own slot (a
 * relaxed store, no fence) before it reads the gate, and clears the mark after the driver call
 * returns. The drainer closes the gate, issues one process-wide barrier (membarrier), and then
 * waits for the marks to clear: after that no submission that saw the gate open can still reach
 * the driver, and none that comes later passes. The hot path stays free of fences; the expensive
 * half of the handshake runs once per release.
 *
 * Idle (the early release; the drainer watches it): a holder is idle once, for its whole idle
 * window, none of these held on that GPU:
 *   - a submission passed the gate;
 *   - a thread of the process was inside a driver call on it: a submission (a copy to or from
 *     pageable memory, or a full queue, blocks inside one), or any call that waits for the GPU
 *     (marked in the thread's slot: context, stream and event synchronisation, synchronous
 *     copies and sets, waits.c);
 *   - a stream or event query answered "not ready" (a thread polling for its work is waiting);
 *   - work the process submitted was still running: after submissions stop, the drainer waits
 *     for every context of the GPU to finish (off the hot path, fenced against captures), and
 *     the window starts when that wait returns, not at the last submission; or, where the last
 *     sign of work was a thread's wait returning and the drainer's wait finds nothing left to
 *     run, when that thread's wait returned. The drainer looks again when the window ends.
 * So what decides is what the process submitted and what the driver says has completed, not
 * which call a thread happens to be in.
 */
#ifndef NVSHARE_GATE_H
#define NVSHARE_GATE_H

#include "gpus.h"
#include "marks.h"

enum nvs_lock_state {
    NVS_LOCK_UNUSED = 0,
    NVS_LOCK_UNGATED,
    NVS_LOCK_IDLE,
    NVS_LOCK_REQUESTED,
    NVS_LOCK_HELD,
    NVS_LOCK_RELEASING,
    NVS_LOCK_DRAINING,
    NVS_LOCK_LENT,
    NVS_LOCK_TAKING,
};

void nvs_gate_slow(struct nvs_gpu *g, struct nvs_thread *t, CUstream s);
/* For a launch on several GPUs: blocks until every gate in `mask` is open at once. */
struct nvs_thread *nvs_gate_enter_many(uint64_t mask);

/*
 * HOT PATH: before every submission. While the lock is held: a TLS load, one relaxed store (the
 * in-flight mark), one relaxed load of the gate and a load of the idle flag. No mutex, no
 * syscall, no getenv, no logging.
 */
static inline struct nvs_thread *nvs_gate_enter(struct nvs_gpu *g, CUstream s)
{
    if (NVS_UNLIKELY(g == NULL)) return NULL;
    struct nvs_thread *t = nvs_tls_thread;
    if (NVS_UNLIKELY(t == NULL)) t = nvs_thread_register();
    atomic_store_explicit(&t->inflight, g->bit, memory_order_relaxed);
    struct nvs_gate_hot *h = &nvs_gate_hot[g->index];
    if (NVS_LIKELY(atomic_load_explicit(&h->pass, memory_order_relaxed))) {
        if (NVS_UNLIKELY(!atomic_load_explicit(&h->touched, memory_order_relaxed)))
            atomic_store_explicit(&h->touched, 1, memory_order_relaxed);
        return t;
    }
    nvs_gate_slow(g, t, s);
    return t;
}

/* HOT PATH: after the driver call returned (release: the enqueue happened before the clear). */
static inline void nvs_gate_exit(struct nvs_thread *t)
{
    if (NVS_LIKELY(t != NULL)) atomic_store_explicit(&t->inflight, 0, memory_order_release);
}

/* Events from the session (no hook lock held by the caller). */
void nvs_gate_start(void);
void nvs_gate_on_registered(struct nvs_gpu *g, const struct nvs_limits *lim);
void nvs_gate_on_limits(struct nvs_gpu *g, const struct nvs_limits *lim);
void nvs_gate_on_grant(struct nvs_gpu *g, const struct nvs_lock_grant *grant);
void nvs_gate_on_terms(struct nvs_gpu *g, const struct nvs_lock_grant *terms);
void nvs_gate_on_drop(struct nvs_gpu *g);
void nvs_gate_on_lent(struct nvs_gpu *g, int lent);
void nvs_gate_on_refused(struct nvs_gpu *g);
/* The gang's cut (cut.h): reached, release as on a drop; behind it, ask to get there. */
void nvs_gate_on_cut_reached(struct nvs_gpu *g);
void nvs_gate_on_cut_behind(struct nvs_gpu *g);
void nvs_gate_on_down(struct nvs_gpu *g);
void nvs_gate_after_fork(void);

#endif
