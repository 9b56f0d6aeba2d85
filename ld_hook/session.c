/*
 * The session (see session.h). The connection's reader thread calls on_event for every frame;
 * the gate and the ledger only record what happened and wake whoever waits, so the reader is
 * back on the socket at once: grants are never held up behind a release's synchronisation.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "capture.h"
#include "config.h"
#include "conn.h"
#include "cut.h"
#include "dispatch.h"
#include "gate.h"
#include "ledger.h"
#include "log.h"
#include "pools.h"
#include "session.h"
#include "thread.h"

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int started;

static void on_event(struct nvs_gpu *g, const struct nvs_event *e)
{
    switch (e->kind) {
    case NVS_EV_REGISTERED:
        nvs_ledger_on_registered(g, &e->u.registered.limits);
        nvs_gate_on_registered(g, &e->u.registered.limits);
        break;
    case NVS_EV_DOWN:
        nvs_ledger_on_down(g);
        nvs_cut_on_down(g);
        nvs_gate_on_down(g);
        break;
    case NVS_EV_LIMITS:
        nvs_ledger_on_limits(g, &e->u.limits);
        nvs_gate_on_limits(g, &e->u.limits);
        break;
    case NVS_EV_LOCK_GRANT:
        nvs_gate_on_grant(g, &e->u.grant);
        break;
    case NVS_EV_LOCK_TERMS:
        nvs_gate_on_terms(g, &e->u.grant);
        break;
    case NVS_EV_LOCK_DROP:
        nvs_gate_on_drop(g);
        break;
    case NVS_EV_LOCK_LENT:
        nvs_gate_on_lent(g, 1);
        break;
    case NVS_EV_LOCK_UNLENT:
        nvs_gate_on_lent(g, 0);
        break;
    case NVS_EV_GANG_DROP:
        nvs_cut_on_drop(g, e->u.cut.cut_id);
        break;
    case NVS_EV_GANG_CUT: {
        int reached = nvs_cut_on_cut(g, e->u.cut.cut_id, e->u.cut.collectives);
        if (reached == 1) nvs_gate_on_cut_reached(g);
        if (reached == 0) nvs_gate_on_cut_behind(g);
        break;
    }
    case NVS_EV_GANG_CUT_OVER:
        nvs_cut_on_over(g, e->u.cut.cut_id);
        break;
    case NVS_EV_MEM_GRANT:
        nvs_ledger_on_grant(g, e->seq, &e->u.mem);
        break;
    case NVS_EV_MEM_OBSERVED:
        nvs_ledger_on_observed(g, &e->u.observed);
        break;
    case NVS_EV_LEDGER_PEERS:
        nvs_ledger_on_peers(g, &e->u.peers);
        break;
    case NVS_EV_MEM_RECLAIM:
        nvs_ledger_on_reclaim(g);
        break;
    case NVS_EV_ERROR:
        NVS_DEBUG("GPU %d: scheduler error %d answering type %u: %s", g->index,
                  e->u.error.status, e->u.error.ref_type, e->u.error.message);
        if (e->u.error.ref_type == NVS_MSG_MEM_RESERVE) nvs_ledger_on_refused(g, e->seq);
        if (e->u.error.ref_type == NVS_MSG_LOCK_REQUEST) nvs_gate_on_refused(g);
        break;
    }
}

static void *service_main(void *arg)
{
    (void)arg;
    nvs_capture_relax_thread();
    for (;;) {
        /* connections, pools and the ledger: every 25 ms, sooner under a short
         * NVSHARE_IDLE_RELEASE_MS (the drainer watches idleness, gate.h) */
        uint32_t tick_ms = nvs_cfg.idle_release_ms ? nvs_cfg.idle_release_ms / 4 : 25;
        if (tick_ms < 5) tick_ms = 5;
        if (tick_ms > 100) tick_ms = 100;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)tick_ms * 1000000L};
        nanosleep(&ts, NULL);
        uint64_t now = nvs_now_ns();
        for (int i = 0; i < nvs_gpu_count(); i++) {
            struct nvs_gpu *g = nvs_gpu_at(i);
            nvs_conn_tick(g, now);
            nvs_pools_settle(g);
            nvs_ledger_tick(g, now);
        }
    }
    return NULL;
}

void nvs_start(void)
{
    if (atomic_load_explicit(&started, memory_order_acquire)) return;
    nvs_config_load();
    pthread_mutex_lock(&start_mu);
    if (!atomic_load_explicit(&started, memory_order_relaxed)) {
        int count = 0;
        if (NVS_CALL(cuDeviceGetCount, (&count)) != CUDA_SUCCESS) count = 0;
        nvs_conn_init(on_event);
        nvs_gate_start();
        nvs_cut_start();
        nvs_ledger_start();
        nvs_gpus_init(count);
        if (count > 0 && nvs_thread_start("nvshare-service", service_main, NULL) != 0)
            nvs_log("cannot start the service thread; idle release and reconnects are off");
        NVS_DEBUG("started: %d GPU(s), scheduler %s", count, nvs_cfg.socket_path);
        atomic_store_explicit(&started, 1, memory_order_release);
    }
    pthread_mutex_unlock(&start_mu);
}

void nvs_session_after_fork(void)
{
    pthread_mutex_init(&start_mu, NULL);
    atomic_store(&started, 0);
}
