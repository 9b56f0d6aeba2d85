/*
 * The GPU as this process is shown it (see shown.h). The daemon's answers are kept for a tenth
 * of a second, so nvidia-smi's calls for one screen (memory, then the process list counted and
 * then filled) see one consistent picture and cost one round trip. A daemon that does not
 * answer is left alone for two seconds: a query never waits on a hung daemon more than once in
 * that time, and then for at most the daemon timeout (capped at two seconds, nvs_dial_ask).
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "conn.h"
#include "dial.h"
#include "fallback.h"
#include "ledger.h"
#include "log.h"
#include "shown.h"

#define CACHE_NS 100000000ull
#define QUIET_NS 2000000000ull
#define CACHED_GPUS 8

struct cached {
    char uuid[NVS_UUID_LEN];
    uint64_t at_ns; /* 0 = empty */
    struct nvs_view view;
};

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct cached cache[CACHED_GPUS];
static uint64_t quiet_until_ns; /* the daemon did not answer: not asked again before this */

/* One VIEW_REQUEST; 1 with *view set when the daemon answered. */
static int ask_daemon(const char *uuid, uint64_t real_total, struct nvs_view *view)
{
    struct nvs_view_request r;
    memset(&r, 0, sizeof r);
    snprintf(r.gpu_uuid, sizeof r.gpu_uuid, "%s", uuid);
    r.gpu_total_mem = real_total;
    memcpy(r.pod_namespace, nvs_cfg.pod_namespace, sizeof r.pod_namespace);
    memcpy(r.pod_name, nvs_cfg.pod_name, sizeof r.pod_name);
    int ok = nvs_dial_ask(NVS_MSG_VIEW_REQUEST, &r, sizeof r, NVS_MSG_VIEW, view, sizeof *view) == 0 &&
             view->process_count <= NVS_VIEW_MAX_PROCESSES;
    if (!ok) NVS_DEBUG("GPU %s: the scheduler did not answer a view request", uuid);
    return ok;
}

/* The daemon's view of `uuid`, from the cache when fresh; 0 when it has none to give. */
static int daemon_view(const char *uuid, uint64_t real_total, struct nvs_view *view)
{
    uint64_t now = nvs_now_ns();
    pthread_mutex_lock(&cache_mu);
    int quiet = now < quiet_until_ns;
    struct cached *slot = &cache[0];
    for (int i = 0; i < CACHED_GPUS; i++) {
        if (cache[i].at_ns != 0 && strcmp(cache[i].uuid, uuid) == 0) {
            slot = &cache[i];
            break;
        }
        if (cache[i].at_ns < slot->at_ns) slot = &cache[i]; /* the oldest goes first */
    }
    int fresh = slot->at_ns != 0 && strcmp(slot->uuid, uuid) == 0 &&
                nvs_elapsed(now, slot->at_ns) < CACHE_NS;
    if (fresh) *view = slot->view;
    pthread_mutex_unlock(&cache_mu);
    if (fresh) return 1;
    if (quiet) return 0;
    int ok = ask_daemon(uuid, real_total, view); /* no lock held while waiting */
    pthread_mutex_lock(&cache_mu);
    if (ok) {
        snprintf(slot->uuid, sizeof slot->uuid, "%s", uuid);
        slot->view = *view;
        slot->at_ns = nvs_now_ns();
    } else {
        quiet_until_ns = nvs_now_ns() + QUIET_NS;
    }
    pthread_mutex_unlock(&cache_mu);
    return ok;
}

static uint64_t smaller_limit(uint64_t a, uint64_t b)
{
    if (a == 0) return b;
    if (b == 0) return a;
    return a < b ? a : b;
}

static void add(struct nvs_shown *out, uint32_t pid, uint32_t flags, uint64_t used)
{
    if (out->count < NVS_VIEW_MAX_PROCESSES)
        out->processes[out->count++] = (struct nvs_view_process){.pid = pid, .flags = flags, .used = used};
}

int nvs_shown_get(const char *uuid, uint64_t real_total, struct nvs_shown *out)
{
    nvs_config_load();
    struct nvs_gpu *g = nvs_gpu_by_uuid(uuid); /* NULL unless this process uses that GPU */
    uint64_t own_limit = nvs_cfg.env_mem_limit, own_used = 0;
    if (g != NULL) nvs_ledger_peek(g, &own_limit, &own_used);
    struct nvs_view view;
    int asked = daemon_view(uuid, real_total, &view);
    /* the ledger already has the daemon's limit (or the published one) for a GPU it uses;
     * otherwise the daemon's answer, else what the daemon published for this pod */
    uint64_t limit = own_limit;
    if (g == NULL)
        limit = smaller_limit(own_limit, asked ? view.mem_limit : nvs_fallback_memory_limit());
    if (limit == 0) return 0;
    memset(out, 0, sizeof *out);
    out->limit = limit;
    if (g != NULL) add(out, (uint32_t)getpid(), NVS_VIEW_SELF, own_used);
    uint64_t used = asked ? view.used : 0;
    for (uint32_t i = 0; asked && i < view.process_count; i++) {
        const struct nvs_view_process *p = &view.processes[i];
        if (g != NULL && (p->flags & NVS_VIEW_SELF)) { /* our own figure is fresher */
            used -= p->used < used ? p->used : used;
            continue;
        }
        add(out, p->pid, p->flags, p->used);
    }
    out->used = used + own_used;
    return 1;
}

void nvs_shown_after_fork(void)
{
    pthread_mutex_init(&cache_mu, NULL);
    memset(cache, 0, sizeof cache);
    quiet_until_ns = 0;
}
