/*
 * What the submission hot path marks, and the gate and the idle watch read: per thread, the GPUs
 * it is submitting to or waiting for (struct nvs_thread, one per thread, registered on its first
 * submission); per GPU, the gate's pass flag and the touched flag (struct nvs_gate_hot).
 */
#ifndef NVSHARE_MARKS_H
#define NVSHARE_MARKS_H

#include <stdatomic.h>
#include <stdint.h>

#include "gpus.h"

struct nvs_thread {
    _Atomic uint64_t inflight; /* GPUs (bits) this thread is submitting to right now */
    _Atomic uint64_t waiting;  /* GPUs (bits) this thread waits for in a synchronising call */
    atomic_int in_use;
    struct nvs_thread *next;
};

struct nvs_gate_hot {
    _Alignas(64) atomic_int pass; /* 1: submissions go straight to the driver */
    atomic_int touched;           /* a submission passed since the idle check last looked */
};

extern NVS_TLS struct nvs_thread *nvs_tls_thread;
extern struct nvs_gate_hot nvs_gate_hot[NVS_MAX_GPUS];
/* Per GPU, when a wait on it last returned (nvs_now_ns): the work it waited for was done then. */
extern _Atomic uint64_t nvs_wait_ended_ns[NVS_MAX_GPUS];

struct nvs_thread *nvs_thread_register(void);

/* Once, before the first registration: the thread key and the barrier's kind. */
void nvs_marks_start(void);
/* After the gate closed: waits until no thread that saw it open is still inside a driver call
 * on g (at most a second: one still inside after that is waiting, not queueing). */
void nvs_marks_wait_inflight(const struct nvs_gpu *g);
/* Every running thread of the process executes a full barrier (membarrier, or a millisecond). */
void nvs_marks_barrier(void);
/* Whether a thread of the process is inside a driver call on g: submitting, or waiting. */
int nvs_marks_on_gpu(const struct nvs_gpu *g);
/* In the child of fork(): only the forking thread exists; nothing is in flight. */
void nvs_marks_after_fork(void);

/*
 * A thread waits for the GPUs in `mask` (a synchronising call): the holder is not idle while it
 * does. nvs_wait_begin returns what to hand nvs_wait_end (waits do not nest in practice, but a
 * signal handler may wait inside a wait). nvs_wait_end notes when the wait ended
 * (nvs_wait_ended_ns): the idle window may start then.
 */
uint64_t nvs_wait_begin(uint64_t mask);
void nvs_wait_end(uint64_t before, uint64_t mask);
/* The GPUs in `mask` are working for this process (a query answered "not ready"). */
void nvs_gpus_active(uint64_t mask);
/* Every GPU this process has: for waits on an object whose GPU the hook does not know. */
uint64_t nvs_gpus_all(void);

#endif
