/*
 * The cut (see cut.h). The count of collectives begun is one atomic word per GPU whose top bit
 * says a drop holds them: a collective begins with one compare-and-swap while nothing holds, so
 * the position a drop reports (read with the same atomic operation that sets the bit) counts
 * every collective that began before it and none after.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>

#include "conn.h"
#include "cut.h"
#include "log.h"

#define HELD_BIT (1ull << 63)

struct cut {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t begun; /* with HELD_BIT while a drop holds collectives */
    _Atomic uint64_t done;  /* submitted (the driver call returned) */
    atomic_int known;       /* the cut below is the daemon's answer */
    uint64_t limit;         /* while held: collectives may begin up to this count */
    uint64_t id, cut;
};

static struct cut cuts[NVS_MAX_GPUS];

static struct cut *cut_of(const struct nvs_gpu *g) { return &cuts[g->index]; }

int nvs_is_collective(const CUlaunchConfig *cfg)
{
    if (cfg == NULL || cfg->attrs == NULL) return 0;
    const CUlaunchAttribute *a = cfg->attrs;
    for (unsigned i = 0; i < cfg->numAttrs; i++)
        if (a[i].id == CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN)
            return a[i].value.memSyncDomain == CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE;
    return 0;
}

void nvs_cut_begin(struct nvs_gpu *g)
{
    struct cut *c = cut_of(g);
    uint64_t v = atomic_load_explicit(&c->begun, memory_order_relaxed);
    while (!(v & HELD_BIT))
        if (atomic_compare_exchange_weak_explicit(&c->begun, &v, v + 1, memory_order_relaxed,
                                                  memory_order_relaxed))
            return;
    nvs_mutex_lock(&c->mu);
    for (;;) {
        v = atomic_load(&c->begun);
        if (!(v & HELD_BIT) || (v & ~HELD_BIT) < c->limit) break;
        struct timespec ts = nvs_deadline_ms(250);
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    atomic_fetch_add(&c->begun, 1);
    nvs_mutex_unlock(&c->mu);
}

int nvs_cut_end(struct nvs_gpu *g)
{
    struct cut *c = cut_of(g);
    /* sequentially consistent against on_cut's store of `known` and read of `done`: one of the
     * two sees the other, so reaching the cut is never missed */
    uint64_t done = atomic_fetch_add(&c->done, 1) + 1;
    if (!atomic_load(&c->known)) return 0;
    nvs_mutex_lock(&c->mu);
    int reached = atomic_load(&c->known) && done == c->cut;
    nvs_mutex_unlock(&c->mu);
    return reached;
}

void nvs_cut_on_drop(struct nvs_gpu *g, uint64_t cut_id)
{
    struct cut *c = cut_of(g);
    nvs_mutex_lock(&c->mu);
    c->limit = atomic_fetch_or(&c->begun, HELD_BIT) & ~HELD_BIT;
    c->id = cut_id;
    atomic_store(&c->known, 0);
    struct nvs_gang_cut body = {.cut_id = cut_id, .collectives = c->limit};
    int queued = nvs_conn_queue(g, NVS_MSG_GANG_POSITION, &body, sizeof body, NULL) == 0;
    nvs_mutex_unlock(&c->mu);
    if (queued) nvs_conn_flush(g);
    NVS_DEBUG("GPU %d: the gang drops (cut %llu); %llu collectives begun", g->index,
              (unsigned long long)cut_id, (unsigned long long)body.collectives);
}

int nvs_cut_on_cut(struct nvs_gpu *g, uint64_t cut_id, uint64_t collectives)
{
    struct cut *c = cut_of(g);
    nvs_mutex_lock(&c->mu);
    int reached = -1;
    if (cut_id == c->id && (atomic_load(&c->begun) & HELD_BIT)) {
        c->cut = collectives;
        if (collectives > c->limit) c->limit = collectives;
        atomic_store(&c->known, 1);
        reached = atomic_load(&c->done) >= collectives;
        pthread_cond_broadcast(&c->cv);
    }
    nvs_mutex_unlock(&c->mu);
    NVS_DEBUG("GPU %d: cut %llu at %llu collectives (%s)", g->index, (unsigned long long)cut_id,
              (unsigned long long)collectives,
              reached == 1 ? "reached" : reached == 0 ? "behind" : "stale");
    return reached;
}

static void free_collectives(struct cut *c)
{
    atomic_fetch_and(&c->begun, ~HELD_BIT);
    atomic_store(&c->known, 0);
    pthread_cond_broadcast(&c->cv);
}

void nvs_cut_on_over(struct nvs_gpu *g, uint64_t cut_id)
{
    struct cut *c = cut_of(g);
    nvs_mutex_lock(&c->mu);
    if (cut_id == c->id) free_collectives(c);
    nvs_mutex_unlock(&c->mu);
}

void nvs_cut_on_down(struct nvs_gpu *g)
{
    struct cut *c = cut_of(g);
    nvs_mutex_lock(&c->mu);
    free_collectives(c);
    nvs_mutex_unlock(&c->mu);
}

int nvs_cut_behind(struct nvs_gpu *g)
{
    struct cut *c = cut_of(g);
    if (!atomic_load_explicit(&c->known, memory_order_acquire)) return 0;
    nvs_mutex_lock(&c->mu);
    int behind = atomic_load(&c->known) && atomic_load(&c->done) < c->cut;
    nvs_mutex_unlock(&c->mu);
    return behind;
}

uint64_t nvs_cut_collectives(struct nvs_gpu *g) { return atomic_load(&cut_of(g)->done); }

void nvs_cut_start(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        struct cut *c = &cuts[i];
        pthread_mutex_init(&c->mu, NULL);
        nvs_cond_init(&c->cv);
        atomic_store(&c->begun, 0);
        atomic_store(&c->done, 0);
        atomic_store(&c->known, 0);
        c->limit = c->id = c->cut = 0;
    }
}
