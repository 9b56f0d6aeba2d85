/*
 * What the submission hot path marks (see marks.h): per thread, the GPUs it is inside a driver
 * call on (submitting, or waiting); per GPU, whether the gate lets submissions pass and whether
 * one passed since the idle watch last looked. Threads register once; their slots are reused.
 */
#define _GNU_SOURCE
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "log.h"
#include "marks.h"
#include "thread.h"

#define INFLIGHT_BOUND_MS 1000u /* a call still inside the driver after this is waiting, not queueing */

NVS_TLS struct nvs_thread *nvs_tls_thread;
struct nvs_gate_hot nvs_gate_hot[NVS_MAX_GPUS];
_Atomic uint64_t nvs_wait_ended_ns[NVS_MAX_GPUS];

static _Atomic(struct nvs_thread *) threads;
static pthread_key_t thread_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static int barrier_cmd;

static void thread_gone(void *p)
{
    struct nvs_thread *t = p;
    atomic_store_explicit(&t->inflight, 0, memory_order_release);
    atomic_store_explicit(&t->waiting, 0, memory_order_release);
    atomic_store_explicit(&t->in_use, 0, memory_order_release);
}

static void make_key(void) { pthread_key_create(&thread_key, thread_gone); }

struct nvs_thread *nvs_thread_register(void)
{
    pthread_once(&key_once, make_key);
    struct nvs_thread *t;
    for (t = atomic_load(&threads); t != NULL; t = t->next) {
        int free_slot = 0;
        if (atomic_compare_exchange_strong(&t->in_use, &free_slot, 1)) break;
    }
    if (t == NULL) {
        t = aligned_alloc(64, 64);
        if (t == NULL) abort(); /* 64 bytes; nothing sensible is left to do */
        memset(t, 0, 64);
        atomic_store(&t->in_use, 1);
        t->next = atomic_load(&threads);
        while (!atomic_compare_exchange_weak(&threads, &t->next, t)) {
        }
    }
    nvs_tls_thread = t;
    pthread_setspecific(thread_key, t);
    return t;
}

/* After the gate closed: no thread that saw it open may still be inside a driver call. */
void nvs_marks_wait_inflight(const struct nvs_gpu *g)
{
    uint64_t deadline = nvs_now_ns() + INFLIGHT_BOUND_MS * 1000000ull;
    for (struct nvs_thread *t = atomic_load(&threads); t != NULL; t = t->next) {
        for (int spins = 0; atomic_load_explicit(&t->inflight, memory_order_acquire) & g->bit;
             spins++) {
            if (nvs_now_ns() > deadline) {
                NVS_DEBUG("GPU %d: a submission is still inside the driver after %u ms; it is "
                          "waiting, not queueing",
                          g->index, INFLIGHT_BOUND_MS);
                return;
            }
            if (spins < 64) {
                sched_yield();
            } else {
                struct timespec ts = {0, 50000};
                nanosleep(&ts, NULL);
            }
        }
    }
}

#ifndef MEMBARRIER_CMD_GLOBAL
#define MEMBARRIER_CMD_GLOBAL 1
#endif

static void barrier_init(void)
{
    long q = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    if (q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
        syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0)
        barrier_cmd = MEMBARRIER_CMD_PRIVATE_EXPEDITED;
    else if (q > 0 && (q & MEMBARRIER_CMD_GLOBAL))
        barrier_cmd = MEMBARRIER_CMD_GLOBAL;
}

/*
 * The heavy half of the in-flight handshake: every running thread of the process executes a full
 * barrier, so a mark stored before a thread read the gate is visible now, and a thread reading
 * the gate from now on sees it closed. Without membarrier (old kernel, seccomp) the store buffers
 * of the other CPUs drain within microseconds; a millisecond is given instead.
 */
void nvs_marks_barrier(void)
{
    static atomic_int fence; /* a seq_cst read-modify-write: our own full barrier */
    atomic_fetch_add_explicit(&fence, 1, memory_order_seq_cst);
    if (barrier_cmd != 0 && syscall(SYS_membarrier, barrier_cmd, 0, 0) == 0) return;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
}

uint64_t nvs_gpus_all(void)
{
    int n = nvs_gpu_count();
    return n >= NVS_MAX_GPUS ? ~0ull : (1ull << n) - 1;
}

/* Like the hot path, write the flag only where it is clear: its cache line is the one every
 * submission reads the gate from. */
void nvs_gpus_active(uint64_t mask)
{
    for (int i = 0, n = nvs_gpu_count(); i < n; i++) {
        atomic_int *touched = &nvs_gate_hot[i].touched;
        if ((mask >> i & 1) && !atomic_load_explicit(touched, memory_order_relaxed))
            atomic_store_explicit(touched, 1, memory_order_relaxed);
    }
}

uint64_t nvs_wait_begin(uint64_t mask)
{
    struct nvs_thread *t = nvs_tls_thread;
    if (t == NULL) t = nvs_thread_register();
    uint64_t before = atomic_load_explicit(&t->waiting, memory_order_relaxed);
    atomic_store_explicit(&t->waiting, before | mask, memory_order_relaxed);
    return before;
}

void nvs_wait_end(uint64_t before, uint64_t mask)
{
    uint64_t now = nvs_now_ns(); /* stored before the mark clears: a look that sees it clear sees this */
    for (int i = 0, n = nvs_gpu_count(); i < n && i < NVS_MAX_GPUS; i++)
        if (mask >> i & 1) atomic_store_explicit(&nvs_wait_ended_ns[i], now, memory_order_relaxed);
    struct nvs_thread *t = nvs_tls_thread;
    if (t != NULL) atomic_store_explicit(&t->waiting, before, memory_order_release);
}

int nvs_marks_on_gpu(const struct nvs_gpu *g)
{
    for (struct nvs_thread *t = atomic_load(&threads); t != NULL; t = t->next)
        if ((atomic_load_explicit(&t->inflight, memory_order_acquire) |
             atomic_load_explicit(&t->waiting, memory_order_acquire)) & g->bit)
            return 1;
    return 0;
}

void nvs_marks_start(void)
{
    pthread_once(&key_once, make_key);
    barrier_init();
}

void nvs_marks_after_fork(void)
{
    for (struct nvs_thread *t = atomic_load(&threads); t != NULL; t = t->next) {
        atomic_store(&t->inflight, 0);
        atomic_store(&t->waiting, 0);
        if (t != nvs_tls_thread) atomic_store(&t->in_use, 0);
    }
}
