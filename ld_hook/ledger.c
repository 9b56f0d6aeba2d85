/*
 * The memory ledger (see ledger.h).
 *
 * Limits: the process's own view is the smaller of NVSHARE_GPU_MEMORY_LIMIT and the daemon's
 * mem_limit (managed backing is also capped at the GPU's size, unless the policy allows every
 * process past it or this one asks with NVSHARE_ENABLE_SINGLE_OVERSUB=1: the policy's managed
 * backing is what allows it, since device memory cannot go past the GPU at all). Before it has
 * ever registered, the daemon's word is what it last published for this process's pod, or its
 * node-wide default (fallback.c), not "no limit". While the daemon is unreachable a process of a
 * pod with several processes keeps what it had reserved and may grow to an equal share of the
 * pod's limit, not to all of it.
 *
 * Reservations: the daemon's grants carry the client's whole reservation, and that absolute
 * figure is what the ledger keeps, so a grant can never be counted twice. A surplus goes back at
 * once when it exceeds 256 MiB (64 MiB on a ledger shared with other processes) and otherwise
 * after a second without allocations, or at once when the daemon asks for it (MEM_RECLAIM: a
 * peer on the ledger was refused room this reservation holds).
 */
#include <string.h>

#include <stdatomic.h>

#include "config.h"
#include "conn.h"
#include "fallback.h"
#include "ledger.h"
#include "log.h"

#define RETURN_THRESHOLD (256ull << 20)
/* On a ledger shared with other processes: what one frees and keeps reserved, its peers are
 * refused (a 1 GiB pod churned by two processes was refused a tenth of its allocations while
 * room remained), so a surplus goes back at once past a chunk's worth. */
#define SHARED_RETURN_THRESHOLD (64ull << 20)
#define IDLE_SURPLUS_NS 1000000000ull

struct ledger {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int registered;         /* reservations go to the daemon */
    int have_limits;
    atomic_int limits_known; /* have_limits, readable without the mutex */
    struct nvs_limits limits;
    uint64_t published;     /* never registered: what the daemon last published for us, 0 = none */
    uint64_t usage;         /* charged by the hooks: allocations, pool and graph reservations */
    uint64_t external;      /* NVML shows the process holding this much more (beyond the allowance) */
    uint64_t usage_hwm;     /* the highest usage since NVML was last heard */
    uint64_t reserved;      /* the daemon's figure for our reservation */
    uint64_t reported;      /* usage as the daemon last heard it; UINT64_MAX = never */
    uint64_t last_charge_ns;
    uint32_t peers;         /* processes on our pod's ledger, ourselves included */
    uint64_t offline_cap;   /* while unreachable: the most we may hold, 0 = no such cap */
    uint32_t refused;        /* allocations refused here, not by the daemon, since the last report */
    uint64_t refused_largest;
    int reserving, replied, answered_with_error;
    uint64_t wait_seq;
    struct nvs_mem_grant reply;
};

static struct ledger ledgers[NVS_MAX_GPUS];

static struct ledger *ledger_of(const struct nvs_gpu *g) { return &ledgers[g->index]; }

static uint64_t min_limit(uint64_t a, uint64_t b)
{
    if (a == 0) return b;
    if (b == 0) return a;
    return a < b ? a : b;
}

/* With l->mu held; 0 = no limit. */
static uint64_t effective_limit(const struct nvs_gpu *g, const struct ledger *l)
{
    uint64_t daemon = l->have_limits ? l->limits.mem_limit : l->published;
    uint64_t limit = min_limit(nvs_cfg.env_mem_limit, daemon);
    if (l->have_limits && l->limits.backing == NVS_BACKING_MANAGED &&
        !(l->limits.flags & NVS_LIMIT_SINGLE_OVERSUB) && !nvs_cfg.single_oversub)
        limit = min_limit(limit, g->total_mem);
    if (!l->registered) limit = min_limit(limit, l->offline_cap);
    return limit;
}

static int over(uint64_t limit, uint64_t held, uint64_t bytes)
{
    return limit != 0 && (held > limit || bytes > limit - held);
}

/* With l->mu held: how much unused reservation this process may keep before it goes back. */
static uint64_t return_threshold(const struct ledger *l)
{
    return l->peers > 1 ? SHARED_RETURN_THRESHOLD : RETURN_THRESHOLD;
}

/* With l->mu held: hand back every byte of reservation not backing usage. 1 = a frame queued. */
static int return_surplus(struct nvs_gpu *g, struct ledger *l)
{
    if (!l->registered || l->reserving || l->reserved <= l->usage) return 0;
    struct nvs_mem_return body = {.bytes = l->reserved - l->usage, .used = l->usage};
    if (nvs_conn_queue(g, NVS_MSG_MEM_RETURN, &body, sizeof body, NULL) != 0) return 0;
    l->reserved = l->usage;
    l->reported = l->usage;
    return 1;
}

/* With l->mu held: ask the daemon for `need` more bytes; bounded by the daemon timeout. */
static CUresult reserve(struct nvs_gpu *g, struct ledger *l, uint64_t need)
{
    struct nvs_mem_reserve body = {.bytes = need, .used = l->usage};
    uint64_t seq = 0;
    if (nvs_conn_queue(g, NVS_MSG_MEM_RESERVE, &body, sizeof body, &seq) != 0)
        return CUDA_SUCCESS; /* going down: the local limit alone decides */
    l->reported = l->usage;
    l->reserving = 1;
    l->replied = l->answered_with_error = 0;
    l->wait_seq = seq;
    nvs_mutex_unlock(&l->mu);
    nvs_conn_flush(g);
    nvs_mutex_lock(&l->mu);
    struct timespec deadline = nvs_deadline_ms(nvs_cfg.daemon_timeout_ms + 100u);
    while (!l->replied && l->registered)
        if (pthread_cond_timedwait(&l->cv, &l->mu, &deadline) != 0 && !l->replied) {
            nvs_conn_fail(g, "the nvshare scheduler did not answer a memory reservation");
            break;
        }
    l->reserving = 0;
    pthread_cond_broadcast(&l->cv);
    if (!l->replied || l->answered_with_error) return CUDA_SUCCESS; /* fail soft: local limit */
    l->reserved = l->reply.reserved;
    return l->reply.granted == 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

/* Before the first registration: what the daemon published for us (read outside the mutex). */
static void take_published(struct ledger *l)
{
    if (atomic_load_explicit(&l->limits_known, memory_order_relaxed)) return;
    uint64_t published = nvs_fallback_memory_limit();
    nvs_mutex_lock(&l->mu);
    l->published = published;
    nvs_mutex_unlock(&l->mu);
}

CUresult nvs_ledger_charge(struct nvs_gpu *g, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return CUDA_SUCCESS;
    nvs_conn_use(g);
    struct ledger *l = ledger_of(g);
    take_published(l);
    nvs_mutex_lock(&l->mu);
    while (l->reserving) pthread_cond_wait(&l->cv, &l->mu);
    CUresult r = CUDA_SUCCESS;
    int ours = 1; /* a refusal decided here, not by the daemon */
    uint64_t limit = effective_limit(g, l);
    int beyond = l->registered && l->usage + bytes > l->reserved;
    /* Over the limit as this hook knows it, and beyond its reservation: asked all the same, since
     * the daemon's limit may be newer (a raise whose LIMIT_UPDATE is still on its way, which then
     * arrives before the answer). A refusal costs a round trip; an allocation costs nothing more. */
    if (over(limit, l->usage + l->external, bytes) && !beyond) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (beyond) {
        r = reserve(g, l, l->usage + bytes - l->reserved);
        ours = r == CUDA_SUCCESS;
        limit = effective_limit(g, l); /* may have changed while we waited */
        if (r == CUDA_SUCCESS && over(limit, l->usage + l->external, bytes)) r = CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS && l->registered && l->usage + bytes > l->reserved)
            r = CUDA_ERROR_OUT_OF_MEMORY; /* granted less than asked */
    }
    if (r != CUDA_SUCCESS && ours) {
        l->refused++;
        if (bytes > l->refused_largest) l->refused_largest = bytes;
    }
    /* Granted, then refused here (a lower limit of the environment's, or granted less than
     * asked): a large grant goes back now, not after a second, so the pod's others can use it. */
    int queued = r != CUDA_SUCCESS && l->reserved > l->usage + return_threshold(l) &&
                 return_surplus(g, l);
    if (r == CUDA_SUCCESS) {
        l->usage += bytes;
        if (l->usage > l->usage_hwm) l->usage_hwm = l->usage;
        l->last_charge_ns = nvs_now_ns();
    }
    NVS_DEBUG("GPU %d: charge %llu -> %s (usage %llu, external %llu, limit %llu, reserved %llu)",
              g->index, (unsigned long long)bytes, r == CUDA_SUCCESS ? "ok" : "refused",
              (unsigned long long)l->usage, (unsigned long long)l->external,
              (unsigned long long)limit, (unsigned long long)l->reserved);
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
    return r;
}

void nvs_ledger_force(struct nvs_gpu *g, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return;
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    l->usage += bytes;
    if (l->usage > l->usage_hwm) l->usage_hwm = l->usage;
    nvs_mutex_unlock(&l->mu);
}

void nvs_ledger_uncharge(struct nvs_gpu *g, uint64_t bytes)
{
    if (g == NULL || bytes == 0) return;
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    l->usage = bytes > l->usage ? 0 : l->usage - bytes;
    int queued = l->reserved > l->usage && l->reserved - l->usage > return_threshold(l) &&
                 return_surplus(g, l);
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
}

void nvs_ledger_peek(struct nvs_gpu *g, uint64_t *limit, uint64_t *used)
{
    struct ledger *l = ledger_of(g);
    take_published(l);
    nvs_mutex_lock(&l->mu);
    *limit = effective_limit(g, l);
    *used = l->usage + l->external;
    nvs_mutex_unlock(&l->mu);
}

int nvs_ledger_backing_managed(struct nvs_gpu *g)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    int managed = l->have_limits && l->limits.backing == NVS_BACKING_MANAGED;
    nvs_mutex_unlock(&l->mu);
    return managed;
}

/* ------------------------------------------------------------------ events */

void nvs_ledger_start(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        struct ledger *l = &ledgers[i];
        memset(l, 0, sizeof *l);
        pthread_mutex_init(&l->mu, NULL);
        nvs_cond_init(&l->cv);
        l->reported = UINT64_MAX;
        l->peers = 1;
    }
}

static void apply_limits(struct nvs_gpu *g, struct ledger *l, const struct nvs_limits *lim)
{
    l->limits = *lim;
    l->have_limits = 1;
    atomic_store_explicit(&l->limits_known, 1, memory_order_relaxed);
    NVS_DEBUG("GPU %d: limits mem=%llu core=%u mode=%u backing=%u flags=%u", g->index,
              (unsigned long long)lim->mem_limit, lim->core_limit, lim->mode, lim->backing,
              lim->flags);
}

void nvs_ledger_on_registered(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    apply_limits(g, l, lim);
    l->registered = 1;
    l->reserved = 0;           /* a new client of the daemon holds no reservation ... */
    l->reported = UINT64_MAX;  /* ... and learns our usage at the next tick */
    l->offline_cap = 0;
    l->peers = 1;
    pthread_cond_broadcast(&l->cv);
    nvs_mutex_unlock(&l->mu);
}

void nvs_ledger_on_limits(struct nvs_gpu *g, const struct nvs_limits *lim)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    apply_limits(g, l, lim);
    int queued = return_surplus(g, l);
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
}

void nvs_ledger_on_grant(struct nvs_gpu *g, uint64_t seq, const struct nvs_mem_grant *grant)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    int queued = 0;
    if (l->reserving && seq == l->wait_seq) {
        l->reply = *grant;
        l->replied = 1;
        pthread_cond_broadcast(&l->cv);
    } else if (l->registered && !l->reserving) {
        /* an answer we no longer wait for: take the daemon's figure, give back what is unused */
        l->reserved = grant->reserved;
        queued = return_surplus(g, l);
    }
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
}

void nvs_ledger_on_refused(struct nvs_gpu *g, uint64_t seq)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    if (l->reserving && seq == l->wait_seq) {
        l->replied = l->answered_with_error = 1;
        pthread_cond_broadcast(&l->cv);
    }
    nvs_mutex_unlock(&l->mu);
}

void nvs_ledger_on_observed(struct nvs_gpu *g, const struct nvs_mem_observed *obs)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    /* Usage may have fallen since NVML sampled: compare with the highest it was meanwhile. */
    uint64_t explained = obs->allowance + l->usage_hwm;
    l->external = obs->nvml_used > explained ? obs->nvml_used - explained : 0;
    l->usage_hwm = l->usage;
    NVS_DEBUG("GPU %d: NVML shows %llu bytes held; %llu beyond what the hook counted", g->index,
              (unsigned long long)obs->nvml_used, (unsigned long long)l->external);
    nvs_mutex_unlock(&l->mu);
}

void nvs_ledger_on_peers(struct nvs_gpu *g, const struct nvs_ledger_peers *peers)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    l->peers = peers->clients;
    nvs_mutex_unlock(&l->mu);
}

void nvs_ledger_on_reclaim(struct nvs_gpu *g)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    int queued = 0;
    if (l->registered) {
        queued = return_surplus(g, l);
        if (!queued) {
            /* nothing to give (or our own reservation in flight): answer all the same, so the
             * daemon decides its refused peer now rather than after its wait */
            struct nvs_mem_return body = {.bytes = 0, .used = l->usage};
            if (nvs_conn_queue(g, NVS_MSG_MEM_RETURN, &body, sizeof body, NULL) == 0) {
                if (!l->reserving) l->reported = l->usage;
                queued = 1;
            }
        }
    }
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
}

void nvs_ledger_on_down(struct nvs_gpu *g)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    if (l->registered) {
        uint64_t pod_limit = l->have_limits ? l->limits.mem_limit : 0;
        uint64_t kept = l->reserved > l->usage ? l->reserved : l->usage;
        uint64_t share = pod_limit / (l->peers ? l->peers : 1);
        l->offline_cap = pod_limit != 0 && l->peers > 1 ? (kept > share ? kept : share) : 0;
    }
    l->registered = 0;
    l->reserved = 0;
    pthread_cond_broadcast(&l->cv);
    nvs_mutex_unlock(&l->mu);
}

/* With l->mu held: tell the daemon what this hook refused on its own since the last report. */
static int report_refusals(struct nvs_gpu *g, struct ledger *l)
{
    if (!l->registered || l->refused == 0) return 0;
    struct nvs_mem_refusals body = {.count = l->refused, .largest = l->refused_largest};
    if (nvs_conn_queue(g, NVS_MSG_MEM_REFUSALS, &body, sizeof body, NULL) != 0) return 0;
    l->refused = 0;
    l->refused_largest = 0;
    return 1;
}

void nvs_ledger_tick(struct nvs_gpu *g, uint64_t now)
{
    struct ledger *l = ledger_of(g);
    nvs_mutex_lock(&l->mu);
    int queued = report_refusals(g, l);
    if (l->registered && !l->reserving) {
        if (l->reserved > l->usage && nvs_elapsed(now, l->last_charge_ns) >= IDLE_SURPLUS_NS) {
            queued |= return_surplus(g, l);
        } else if (l->reported != l->usage) {
            /* a MEM_RETURN of 0 bytes: status shows allocations made inside a reservation */
            struct nvs_mem_return body = {.bytes = 0, .used = l->usage};
            if (nvs_conn_queue(g, NVS_MSG_MEM_RETURN, &body, sizeof body, NULL) == 0) {
                l->reported = l->usage;
                queued = 1;
            }
        }
    }
    nvs_mutex_unlock(&l->mu);
    if (queued) nvs_conn_flush(g);
}

void nvs_ledger_after_fork(void) { nvs_ledger_start(); }
