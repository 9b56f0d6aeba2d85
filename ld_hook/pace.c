/*
 * Pacing a borrower's queue (see pace.h).
 */
#include <pthread.h>

#include "capture.h"
#include "dispatch.h"
#include "log.h"
#include "marks.h"
#include "pace.h"

#define RING 64u
#define MIN_DEPTH 2u
#define FIRST_DEPTH 4u
#define MAX_BOUND_US 1000000ull /* a bound past a second bounds nothing worth waiting for */

struct pace {
    pthread_mutex_t mu;
    CUcontext ctx;     /* the context the ring's events were made in */
    CUevent ev[RING];      /* made on first use */
    uint64_t at[RING];     /* when each unfinished one was recorded */
    unsigned ahead[RING];  /* and how many were unfinished before it then */
    unsigned head, n;      /* the oldest unfinished, how many */
    uint64_t launch_ns;    /* how long a launch runs, learned (0: not yet) */
    unsigned depth;
};

_Atomic uint64_t nvs_pace_bound_ns[NVS_MAX_GPUS];
static struct pace paces[NVS_MAX_GPUS];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        pthread_mutex_init(&paces[i].mu, NULL);
        paces[i].depth = FIRST_DEPTH;
    }
}

void nvs_pace_set(const struct nvs_gpu *g, uint64_t bound_us)
{
    if (bound_us > MAX_BOUND_US) bound_us = MAX_BOUND_US;
    atomic_store_explicit(&nvs_pace_bound_ns[g->index], bound_us * 1000ull, memory_order_relaxed);
}

/* The ring's driver calls: none while a capture runs on g (0), in relaxed capture mode. */
static int enter(const struct nvs_gpu *g, CUstreamCaptureMode *mode)
{
    pthread_once(&once, init);
    if (nvs_capture_fence(g) != 0) return 0;
    *mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    NVS_CALL(cuThreadExchangeStreamCaptureMode, (mode));
    nvs_mutex_lock(&paces[g->index].mu);
    return 1;
}

static void leave(const struct nvs_gpu *g, CUstreamCaptureMode *mode)
{
    nvs_mutex_unlock(&paces[g->index].mu);
    NVS_CALL(cuThreadExchangeStreamCaptureMode, (mode));
    nvs_capture_unfence(g);
}

/* The oldest launch finished `lag_ns` after its submission, behind `ahead` others: one launch
 * runs about lag / (ahead + 1) (a running average of those); then `depth - 1` launches ahead of
 * a new one are about the bound's worth. */
static void learn(struct pace *p, uint64_t lag_ns, unsigned ahead, uint64_t bound_ns)
{
    uint64_t one = lag_ns / (ahead + 1u);
    p->launch_ns = p->launch_ns ? (3 * p->launch_ns + one) / 4 : one;
    uint64_t depth = p->launch_ns ? bound_ns / p->launch_ns + 1 : RING;
    p->depth = (unsigned)(depth < MIN_DEPTH ? MIN_DEPTH : depth > RING ? RING : depth);
}

void nvs_pace_before(const struct nvs_gpu *g)
{
    uint64_t bound = atomic_load_explicit(&nvs_pace_bound_ns[g->index], memory_order_relaxed);
    CUstreamCaptureMode mode;
    if (bound == 0 || !enter(g, &mode)) return;
    struct pace *p = &paces[g->index];
    while (p->n > 0 && NVS_CALL(cuEventQuery, (p->ev[p->head])) != CUDA_ERROR_NOT_READY) {
        p->head = (p->head + 1) % RING;
        p->n--;
    }
    while (p->n >= p->depth) {
        uint64_t before = nvs_wait_begin(g->bit);
        NVS_CALL(cuEventSynchronize, (p->ev[p->head]));
        nvs_wait_end(before, g->bit);
        learn(p, nvs_elapsed(nvs_now_ns(), p->at[p->head]), p->ahead[p->head], bound);
        p->head = (p->head + 1) % RING;
        p->n--;
    }
    leave(g, &mode);
}

void nvs_pace_after(const struct nvs_gpu *g, CUstream s)
{
    CUstreamCaptureMode mode;
    if (!nvs_paced(g) || !enter(g, &mode)) return;
    struct pace *p = &paces[g->index];
    CUcontext ctx = NULL;
    if (NVS_CALL(cuCtxGetCurrent, (&ctx)) == CUDA_SUCCESS && ctx != NULL && ctx != p->ctx &&
        p->n == 0) {
        for (unsigned i = 0; i < RING; i++) /* a new context: the old one's events go */
            if (p->ev[i] != NULL) {
                NVS_CALL(cuEventDestroy_v2, (p->ev[i]));
                p->ev[i] = NULL;
            }
        p->ctx = ctx;
    }
    unsigned slot = (p->head + p->n) % RING;
    if (ctx != NULL && ctx == p->ctx && p->n < RING &&
        (p->ev[slot] != NULL ||
         NVS_CALL(cuEventCreate, (&p->ev[slot], CU_EVENT_DISABLE_TIMING)) == CUDA_SUCCESS) &&
        NVS_CALL(cuEventRecord, (p->ev[slot], s)) == CUDA_SUCCESS) {
        p->at[slot] = nvs_now_ns();
        p->ahead[slot] = p->n++;
    }
    leave(g, &mode);
}

void nvs_pace_after_fork(void)
{
    pthread_once(&once, init);
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        struct pace *p = &paces[i];
        pthread_mutex_init(&p->mu, NULL);
        for (unsigned k = 0; k < RING; k++) p->ev[k] = NULL; /* the parent's: not ours to free */
        p->ctx = NULL;
        p->head = p->n = 0;
        atomic_store(&nvs_pace_bound_ns[i], 0);
    }
}
