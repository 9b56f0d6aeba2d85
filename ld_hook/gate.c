/*
 * The gate (see gate.h): the lock state machine per GPU and one drainer thread per GPU that
 * carries out releases, so the connection's reader only ever reads. What the hot path marks (which
 * thread is on which GPU) is marks.c's.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "capture.h"
#include "config.h"
#include "conn.h"
#include "contexts.h"
#include "cut.h"
#include "dispatch.h"
#include "gate.h"
#include "log.h"
#include "marks.h"
#include "pace.h"
#include "thread.h"

#define DEFAULT_IDLE_RELEASE_MS 1000u
#define MIN_CAPTURE_WAIT_MS 1000u
/* The drainer looks at a holder four times per idle window, at most every 50 ms and at least
 * every 250 us, and once more when the window ends: a holder told a window under a millisecond
 * (one that outranks every waiter) hands over that long after its last wait returned. */
#define MAX_IDLE_POLL_US 50000u
#define MIN_IDLE_POLL_US 250u
/* The drainer's own wait for the GPU that returns sooner found nothing left to run. */
#define ALREADY_DONE_NS 20000u
/* The drainer's timed waits end this close to their deadline (Linux's default slack: 50 us). */
#define DRAINER_TIMER_SLACK_NS 1000ul


struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    enum nvs_lock_state state;
    int mode_on;  /* the daemon's limits ask for gating */
    int refused;  /* the daemon refused to gate us: run ungated until the next registration */
    uint32_t reason;
    uint64_t tq_ms, idle_ns; /* the grant's quantum; how long the holder may sit idle */
    uint64_t release_ns, last_active_ns;
    int unfinished; /* submitted since the GPU was last seen to have finished this process's work */
    int after_wait; /* the last sign of work was a wait returning (at last_active_ns) */
    int drainer;  /* the drainer thread runs */
};

static struct gate gates[NVS_MAX_GPUS];
static atomic_int undrained_reported;

static struct gate *gate_of(const struct nvs_gpu *g) { return &gates[g->index]; }

static int is_open(enum nvs_lock_state s)
{
    return s == NVS_LOCK_UNGATED || s == NVS_LOCK_HELD || s == NVS_LOCK_RELEASING ||
           s == NVS_LOCK_TAKING;
}

/* With gt->mu held. */
static void set_state(struct nvs_gpu *g, enum nvs_lock_state s)
{
    struct gate *gt = gate_of(g);
    gt->state = s;
    if (s != NVS_LOCK_HELD) nvs_pace_set(g, 0); /* paced only while held (pace.h) */
    atomic_store_explicit(&nvs_gate_hot[g->index].pass, is_open(s), memory_order_relaxed);
    pthread_cond_broadcast(&gt->cv);
}

/* ------------------------------------------------------------------ the slow path */

/* Waits until g's gate is open (or s records into a capture: no GPU work). 1 = pass for capture. */
static int wait_open(struct nvs_gpu *g, CUstream s)
{
    struct gate *gt = gate_of(g);
    nvs_conn_use(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_UNUSED) set_state(g, NVS_LOCK_UNGATED); /* no answer: fail soft */
    int capture_pass = 0;
    while (!is_open(gt->state)) {
        int request = gt->state == NVS_LOCK_IDLE || gt->state == NVS_LOCK_LENT;
        if (request) {
            /* behind its gang's cut, it may have the GPU back while the gang stops */
            uint16_t type = nvs_cut_behind(g) ? NVS_MSG_GANG_CATCHUP : NVS_MSG_LOCK_REQUEST;
            /* lent: the request takes the GPU back at once, so do not wait for its answer */
            set_state(g, gt->state == NVS_LOCK_LENT ? NVS_LOCK_TAKING : NVS_LOCK_REQUESTED);
            if (nvs_conn_queue(g, type, NULL, 0, NULL) != 0) set_state(g, NVS_LOCK_UNGATED);
        }
        nvs_mutex_unlock(&gt->mu);
        if (request) {
            NVS_DEBUG("GPU %d: requesting the lock", g->index);
            nvs_conn_flush(g);
        }
        capture_pass = nvs_capture_active(g) > 0 && nvs_stream_capturing(s);
        nvs_mutex_lock(&gt->mu);
        if (capture_pass) break;
        if (!is_open(gt->state) && gt->state != NVS_LOCK_IDLE && gt->state != NVS_LOCK_LENT) {
            struct timespec ts = nvs_deadline_ms(250);
            pthread_cond_timedwait(&gt->cv, &gt->mu, &ts);
        }
    }
    nvs_mutex_unlock(&gt->mu);
    return capture_pass;
}

void nvs_gate_slow(struct nvs_gpu *g, struct nvs_thread *t, CUstream s)
{
    struct nvs_gate_hot *h = &nvs_gate_hot[g->index];
    for (;;) {
        atomic_store_explicit(&t->inflight, 0, memory_order_relaxed);
        int capture_pass = wait_open(g, s);
        atomic_store_explicit(&t->inflight, g->bit, memory_order_relaxed);
        if (capture_pass || atomic_load_explicit(&h->pass, memory_order_relaxed)) break;
    }
    atomic_store_explicit(&h->touched, 1, memory_order_relaxed);
}

struct nvs_thread *nvs_gate_enter_many(uint64_t mask)
{
    struct nvs_thread *t = nvs_tls_thread;
    if (t == NULL) t = nvs_thread_register();
    for (;;) {
        atomic_store_explicit(&t->inflight, mask, memory_order_relaxed);
        int closed = -1;
        for (int i = 0; i < NVS_MAX_GPUS && closed < 0; i++)
            if ((mask >> i & 1) && !atomic_load_explicit(&nvs_gate_hot[i].pass, memory_order_relaxed))
                closed = i;
        if (closed < 0) break;
        atomic_store_explicit(&t->inflight, 0, memory_order_relaxed);
        wait_open(&nvs_gpu_table[closed], NULL);
    }
    for (int i = 0; i < NVS_MAX_GPUS; i++)
        if (mask >> i & 1) atomic_store_explicit(&nvs_gate_hot[i].touched, 1, memory_order_relaxed);
    return t;
}

/* ------------------------------------------------------------------ releases */

static void report_undrained(const struct nvs_gpu *g, uint64_t waited_ms)
{
    NVS_DEBUG("GPU %d: a stream capture still runs %llu ms after the drop; handing the lock over "
              "without synchronising",
              g->index, (unsigned long long)waited_ms);
    if (!atomic_exchange(&undrained_reported, 1))
        nvs_log("GPU %d: a stream capture outlived the time quantum (%llu ms); the lock was handed "
                "over without waiting for this process's queued GPU work, so that the capture is "
                "not broken (reported to the scheduler as an undrained release; said once)",
                g->index, (unsigned long long)waited_ms);
}

/* Returns 0 once g is DRAINING (gate closed), or -1 when the release was called off. */
static int close_for_release(struct nvs_gpu *g, uint64_t deadline_ns)
{
    struct gate *gt = gate_of(g);
    for (;;) {
        int left = nvs_capture_wait_idle(g, deadline_ns);
        nvs_mutex_lock(&gt->mu);
        if (gt->state != NVS_LOCK_RELEASING) {
            nvs_mutex_unlock(&gt->mu);
            return -1;
        }
        if (left == 0 || nvs_now_ns() >= deadline_ns) {
            set_state(g, NVS_LOCK_DRAINING);
            nvs_mutex_unlock(&gt->mu);
            return 0;
        }
        nvs_mutex_unlock(&gt->mu);
    }
}

static void release(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    uint32_t reason = gt->reason;
    uint64_t bound_ms = gt->tq_ms > MIN_CAPTURE_WAIT_MS ? gt->tq_ms : MIN_CAPTURE_WAIT_MS;
    uint64_t deadline = gt->release_ns + bound_ms * 1000000ull;
    nvs_mutex_unlock(&gt->mu);
    if (close_for_release(g, deadline) != 0) return;
    nvs_marks_barrier();
    nvs_marks_wait_inflight(g);
    /* A capture may have begun since the gate closed (recording passes it): wait for it too. */
    for (;;) {
        if (nvs_capture_fence(g) == 0) {
            nvs_ctx_sync_gpu(g);
            nvs_capture_unfence(g);
            break;
        }
        if (nvs_now_ns() >= deadline) {
            report_undrained(g, bound_ms);
            reason = NVS_RELEASE_UNDRAINED;
            break;
        }
        nvs_capture_wait_idle(g, deadline);
    }
    nvs_mutex_lock(&gt->mu);
    int sent = 0;
    if (gt->state == NVS_LOCK_DRAINING) {
        struct nvs_lock_released body = {.reason = reason, .reserved = 0};
        sent = nvs_conn_queue(g, NVS_MSG_LOCK_RELEASED, &body, sizeof body, NULL) == 0;
        set_state(g, sent ? NVS_LOCK_IDLE : NVS_LOCK_UNGATED);
    }
    nvs_mutex_unlock(&gt->mu);
    if (sent) {
        nvs_conn_flush(g);
        NVS_DEBUG("GPU %d: lock released (%s)", g->index,
                  reason == NVS_RELEASE_IDLE ? "idle" : reason == NVS_RELEASE_UNDRAINED ? "undrained" : "dropped");
    }
}

static void begin_release(struct nvs_gpu *g, uint32_t reason);

/* ------------------------------------------------------------------ idleness */

enum idle_look { LOOK_BUSY, LOOK_FINISHING, LOOK_QUIET };

/* With gt->mu held: one look at a holder (gate.h says what idle is). LOOK_FINISHING: nothing
 * submitted or waited for since the last look, but submitted work may still be running. */
static enum idle_look look(struct nvs_gpu *g, uint64_t now)
{
    struct gate *gt = gate_of(g);
    if (atomic_exchange_explicit(&nvs_gate_hot[g->index].touched, 0, memory_order_relaxed)) {
        gt->last_active_ns = now;
        gt->unfinished = 1;
        gt->after_wait = 0;
        return LOOK_BUSY;
    }
    if (nvs_marks_on_gpu(g)) {
        gt->last_active_ns = now;
        gt->after_wait = 0;
        return LOOK_BUSY;
    }
    uint64_t waited = atomic_load_explicit(&nvs_wait_ended_ns[g->index], memory_order_relaxed);
    if (waited > gt->last_active_ns) { /* a wait returned since the last look */
        gt->last_active_ns = waited;
        gt->unfinished = 1;
        gt->after_wait = 1;
    }
    if (gt->unfinished) return LOOK_FINISHING;
    if (nvs_elapsed(now, gt->last_active_ns) >= gt->idle_ns &&
        nvs_capture_active(g) == 0)
        begin_release(g, NVS_RELEASE_IDLE);
    return LOOK_QUIET;
}

/*
 * Without gt->mu: waits until the GPU has finished the work this process queued on it, and
 * returns when that was; 0 while a capture runs (synchronising would break it; a capture keeps
 * the holder from going idle anyway). A submission racing with the wait is seen at the next look.
 */
static uint64_t finished_at(struct nvs_gpu *g)
{
    if (nvs_capture_fence(g) != 0) return 0;
    nvs_ctx_sync_gpu(g);
    nvs_capture_unfence(g);
    return nvs_now_ns();
}

/* With gt->mu held: when the drainer looks next, a poll away or when a quiet holder's window
 * ends, whichever is sooner. */
static struct timespec next_look(const struct gate *gt)
{
    uint64_t poll_ns = gt->idle_ns / 4;
    if (poll_ns < MIN_IDLE_POLL_US * 1000ull) poll_ns = MIN_IDLE_POLL_US * 1000ull;
    if (poll_ns > MAX_IDLE_POLL_US * 1000ull) poll_ns = MAX_IDLE_POLL_US * 1000ull;
    uint64_t now = nvs_now_ns(), at = now + poll_ns;
    uint64_t ends = gt->last_active_ns + gt->idle_ns;
    if (!gt->unfinished && ends > now && ends < at) at = ends;
    return nvs_deadline_at(at);
}

/* With gt->mu held, the drainer's watch over a holder: returns once a look is done. */
static void watch_idle(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    struct timespec ts = next_look(gt);
    pthread_cond_timedwait(&gt->cv, &gt->mu, &ts);
    if (gt->state != NVS_LOCK_HELD || look(g, nvs_now_ns()) != LOOK_FINISHING) return;
    nvs_mutex_unlock(&gt->mu);
    uint64_t asked = nvs_now_ns();
    uint64_t done = finished_at(g);
    nvs_mutex_lock(&gt->mu);
    if (done != 0 && gt->state == NVS_LOCK_HELD) {
        gt->unfinished = 0;
        /* The window starts when the work finished: when the last wait returned, if nothing was
         * submitted since and nothing was left to run when the drainer asked; else now. */
        int found_done = gt->after_wait && nvs_elapsed(done, asked) < ALREADY_DONE_NS;
        if (!found_done && done > gt->last_active_ns) gt->last_active_ns = done;
    }
}

static void *drainer_main(void *arg)
{
    struct nvs_gpu *g = arg;
    struct gate *gt = gate_of(g);
    nvs_capture_relax_thread();
    prctl(PR_SET_TIMERSLACK, DRAINER_TIMER_SLACK_NS); /* a window ends on time, to the us */
    for (;;) {
        nvs_mutex_lock(&gt->mu);
        while (gt->state != NVS_LOCK_RELEASING) {
            if (gt->state == NVS_LOCK_HELD)
                watch_idle(g);
            else
                pthread_cond_wait(&gt->cv, &gt->mu);
        }
        nvs_mutex_unlock(&gt->mu);
        release(g);
    }
    return NULL;
}

/* With gt->mu held: a release is wanted. */
static void begin_release(struct nvs_gpu *g, uint32_t reason)
{
    struct gate *gt = gate_of(g);
    gt->reason = reason;
    gt->release_ns = nvs_now_ns();
    set_state(g, NVS_LOCK_RELEASING);
}

/* ------------------------------------------------------------------ events */

void nvs_gate_start(void)
{
    nvs_marks_start();
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        struct gate *gt = &gates[i];
        pthread_mutex_init(&gt->mu, NULL);
        nvs_cond_init(&gt->cv);
        gt->state = NVS_LOCK_UNUSED;
        gt->drainer = 0;
        atomic_store(&nvs_gate_hot[i].pass, 0);
        atomic_store(&nvs_gate_hot[i].touched, 0);
    }
}

static void apply_mode(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    struct gate *gt = gate_of(g);
    gt->mode_on = lim->mode != NVS_MODE_OFF;
    if (!gt->mode_on && gt->state != NVS_LOCK_UNGATED) {
        set_state(g, NVS_LOCK_UNGATED); /* the daemon no longer counts us as a holder */
    } else if (gt->mode_on && !gt->refused &&
               (gt->state == NVS_LOCK_UNGATED || gt->state == NVS_LOCK_UNUSED)) {
        set_state(g, NVS_LOCK_IDLE);
    }
}

void nvs_gate_on_registered(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    gt->refused = 0;
    set_state(g, NVS_LOCK_UNGATED); /* a new connection holds nothing */
    apply_mode(g, lim);
    int start = !gt->drainer;
    gt->drainer = 1;
    nvs_mutex_unlock(&gt->mu);
    if (start && nvs_thread_start("nvshare-drain", drainer_main, g) != 0) {
        nvs_log("GPU %d: cannot start the drainer thread; this GPU runs without sharing", g->index);
        nvs_mutex_lock(&gt->mu);
        gt->refused = 1;
        set_state(g, NVS_LOCK_UNGATED);
        nvs_mutex_unlock(&gt->mu);
    }
}

void nvs_gate_on_limits(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    apply_mode(g, lim);
    nvs_mutex_unlock(&gt->mu);
}

/* With gt->mu held. The environment's idle release, where set, wins over the daemon's. */
static void set_terms(struct nvs_gpu *g, const struct nvs_lock_grant *grant)
{
    struct gate *gt = gate_of(g);
    nvs_pace_set(g, grant->queue_us);
    gt->tq_ms = grant->tq_ms;
    gt->idle_ns = nvs_cfg.idle_release_ms ? nvs_cfg.idle_release_ms * 1000000ull
                  : grant->idle_release_us ? grant->idle_release_us * 1000ull
                                           : DEFAULT_IDLE_RELEASE_MS * 1000000ull;
}

void nvs_gate_on_terms(struct nvs_gpu *g, const struct nvs_lock_grant *terms)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_HELD) {
        set_terms(g, terms);
        pthread_cond_broadcast(&gt->cv); /* the drainer picks up a shorter idle window */
    }
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_grant(struct nvs_gpu *g, const struct nvs_lock_grant *grant)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_REQUESTED || gt->state == NVS_LOCK_TAKING) {
        set_terms(g, grant);
        gt->last_active_ns = nvs_now_ns();
        gt->unfinished = 1; /* what it queued while it waited or borrowed may still run */
        gt->after_wait = 0;
        atomic_store_explicit(&nvs_gate_hot[g->index].touched, 0, memory_order_relaxed);
        set_state(g, NVS_LOCK_HELD);
        NVS_DEBUG("GPU %d: lock granted", g->index);
    }
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_drop(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_HELD) {
        begin_release(g, NVS_RELEASE_DROPPED);
        NVS_DEBUG("GPU %d: lock drop requested", g->index);
    }
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_lent(struct nvs_gpu *g, int lent)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (lent && gt->state == NVS_LOCK_IDLE)
        set_state(g, NVS_LOCK_LENT);
    else if (!lent && gt->state == NVS_LOCK_LENT)
        set_state(g, NVS_LOCK_IDLE);
    else if (!lent && gt->state == NVS_LOCK_TAKING)
        set_state(g, NVS_LOCK_REQUESTED); /* asked too late to take it back: wait for the grant */
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_cut_reached(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_HELD) begin_release(g, NVS_RELEASE_DROPPED);
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_cut_behind(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    int ask = gt->state == NVS_LOCK_REQUESTED && nvs_conn_queue(g, NVS_MSG_GANG_CATCHUP, NULL, 0, NULL) == 0;
    nvs_mutex_unlock(&gt->mu);
    if (ask) nvs_conn_flush(g);
}

void nvs_gate_on_refused(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    if (gt->state == NVS_LOCK_REQUESTED || gt->state == NVS_LOCK_TAKING) {
        gt->refused = 1; /* the scheduler cannot gate us: run ungated rather than hang */
        set_state(g, NVS_LOCK_UNGATED);
    }
    nvs_mutex_unlock(&gt->mu);
}

void nvs_gate_on_down(struct nvs_gpu *g)
{
    struct gate *gt = gate_of(g);
    nvs_mutex_lock(&gt->mu);
    set_state(g, NVS_LOCK_UNGATED);
    nvs_mutex_unlock(&gt->mu);
}

/* In the child of fork(): only the forking thread exists; nothing is held or in flight. */
void nvs_gate_after_fork(void)
{
    nvs_marks_after_fork();
    nvs_gate_start();
}
