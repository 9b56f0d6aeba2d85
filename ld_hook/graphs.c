/*
 * Graph memory (see graphs.h). Each executable instantiated through the hook has a record: per
 * GPU, the most its allocation nodes can hold at once (graph_peak.c: along the graph's
 * dependencies, so a graph that frees and allocates again inside itself is not charged twice;
 * child graphs included, 2 MiB granules) and whether the driver holds it reserved for it now. A
 * part stops being held when the device's graph pool shrinks (cuDeviceGraphMemTrim releases
 * what no scheduled graph uses, and the next launch reserves it again), so it is checked again
 * at its next upload or launch. The driver may share memory more tightly than the peak (the
 * charge then settles to less after the call); the check before it never assumes less.
 */
#include <stdlib.h>
#include <string.h>

#include "allocmap.h"
#include "capture.h"
#include "contexts.h"
#include "dispatch.h"
#include "gate.h"
#include "graph_peak.h"
#include "graphs.h"
#include "ledger.h"
#include "log.h"


struct graph_part {
    int gpu;
    uint64_t bytes;
    uint64_t held_since; /* the GPU's pool generation when it was reserved; 0: not held */
};

struct graph_rec {
    int n;
    struct graph_part part[];
};

static struct {
    pthread_mutex_t mu;
    uint64_t charged[NVS_MAX_GPUS];    /* charged for the GPU's graph pool */
    uint64_t reserved[NVS_MAX_GPUS];   /* the pool's reserved memory when last read */
    uint64_t generation[NVS_MAX_GPUS]; /* +1 each time the pool is seen to shrink */
    int used[NVS_MAX_GPUS];            /* a graph ran on it: worth re-reading */
} graphs = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t pool_attr(int gpu, CUgraphMem_attribute a)
{
    cuuint64_t v = 0;
    return NVS_CALL(cuDeviceGetGraphMemAttribute, (gpu, a, &v)) == CUDA_SUCCESS ? v : 0;
}

static int settle_gpu(struct nvs_gpu *g)
{
    if (g == NULL) return 0;
    cuuint64_t reserved = 0;
    if (NVS_CALL(cuDeviceGetGraphMemAttribute,
                 (g->index, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved)) != CUDA_SUCCESS)
        return 0;
    nvs_mutex_lock(&graphs.mu);
    int64_t delta = (int64_t)reserved - (int64_t)graphs.charged[g->index];
    graphs.charged[g->index] = reserved;
    if (reserved < graphs.reserved[g->index]) graphs.generation[g->index]++; /* trimmed, reset */
    graphs.reserved[g->index] = reserved;
    nvs_mutex_unlock(&graphs.mu);
    if (delta > 0) nvs_ledger_force(g, (uint64_t)delta);
    if (delta < 0) nvs_ledger_uncharge(g, (uint64_t)-delta);
    return delta < 0;
}

int nvs_graphs_settle(struct nvs_gpu *g)
{
    if (g == NULL) return 0;
    nvs_mutex_lock(&graphs.mu);
    int used = graphs.used[g->index];
    nvs_mutex_unlock(&graphs.mu);
    return used ? settle_gpu(g) : 0;
}

static struct graph_rec *record_of_graph(CUgraph graph)
{
    uint64_t bytes[NVS_MAX_GPUS] = {0};
    int n = 0;
    nvs_graph_peak(graph, bytes);
    for (int i = 0; i < NVS_MAX_GPUS; i++) n += bytes[i] > 0;
    struct graph_rec *rec = calloc(1, sizeof *rec + (size_t)n * sizeof rec->part[0]);
    if (rec == NULL) return NULL;
    for (int i = 0; i < NVS_MAX_GPUS; i++)
        if (bytes[i] > 0) rec->part[rec->n++] = (struct graph_part){.gpu = i, .bytes = bytes[i]};
    return rec;
}

static struct graph_rec *record_of_exec(CUgraphExec exec)
{
    struct nvs_alloc e;
    if (exec == NULL || !nvs_allocmap_get((uint64_t)(uintptr_t)exec, NVS_KIND_GRAPH, &e)) return NULL;
    return (struct graph_rec *)(uintptr_t)e.aux;
}

static int held(const struct graph_part *p)
{
    nvs_mutex_lock(&graphs.mu);
    int h = p->held_since != 0 && p->held_since == graphs.generation[p->gpu] + 1;
    nvs_mutex_unlock(&graphs.mu);
    return h;
}

static int all_held(const struct graph_rec *rec)
{
    for (int i = 0; i < rec->n; i++)
        if (!held(&rec->part[i])) return 0;
    return 1;
}

/*
 * Charges what each part not held can make its GPU's graph pool grow by (its bytes beyond the
 * pool's reserved-but-unused memory), recording it as charged for the pool so that the settle
 * after the call corrects it. `used_before` gets each pool's used memory. On a refusal nothing
 * stays charged.
 */
static CUresult admit(struct graph_rec *rec, uint64_t *used_before)
{
    uint64_t took[NVS_MAX_GPUS];
    for (int i = 0; i < rec->n; i++) {
        struct graph_part *p = &rec->part[i];
        struct nvs_gpu *g = nvs_gpu_at(p->gpu);
        took[i] = 0;
        used_before[i] = pool_attr(p->gpu, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT);
        if (g == NULL || held(p)) continue;
        uint64_t reserved = pool_attr(p->gpu, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT);
        uint64_t spare = reserved > used_before[i] ? reserved - used_before[i] : 0;
        uint64_t need = p->bytes > spare ? p->bytes - spare : 0;
        CUresult r = nvs_ledger_charge(g, need);
        if (r == CUDA_ERROR_OUT_OF_MEMORY && settle_gpu(g)) r = nvs_ledger_charge(g, need);
        if (r != CUDA_SUCCESS) {
            uint64_t limit = 0, holds = 0;
            nvs_ledger_peek(g, &limit, &holds);
            nvs_log("graph memory of %llu MiB on GPU %d refused: the process holds %llu MiB of "
                    "its %llu MiB limit; the graph call fails with CUDA_ERROR_OUT_OF_MEMORY and "
                    "nothing was reserved",
                    (unsigned long long)(p->bytes >> 20), p->gpu,
                    (unsigned long long)(holds >> 20), (unsigned long long)(limit >> 20));
            while (i-- > 0) {
                struct nvs_gpu *back = nvs_gpu_at(rec->part[i].gpu);
                nvs_mutex_lock(&graphs.mu);
                graphs.charged[rec->part[i].gpu] -= took[i];
                nvs_mutex_unlock(&graphs.mu);
                nvs_ledger_uncharge(back, took[i]);
            }
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        nvs_mutex_lock(&graphs.mu);
        graphs.charged[p->gpu] += need;
        graphs.used[p->gpu] = 1;
        nvs_mutex_unlock(&graphs.mu);
        took[i] = need;
    }
    return CUDA_SUCCESS;
}

/* After the call: charges follow the pools; parts the driver now holds are marked held. A launch
 * or upload that succeeded holds them all; an instantiation, those whose pool grew by them. */
static void settle_rec(struct graph_rec *rec, CUresult r, int ran, const uint64_t *used_before)
{
    for (int i = 0; i < rec->n; i++) {
        struct graph_part *p = &rec->part[i];
        settle_gpu(nvs_gpu_at(p->gpu));
        int now_held = r == CUDA_SUCCESS &&
                       (ran || pool_attr(p->gpu, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) >=
                                   used_before[i] + p->bytes);
        if (!now_held) continue;
        nvs_mutex_lock(&graphs.mu);
        p->held_since = graphs.generation[p->gpu] + 1;
        nvs_mutex_unlock(&graphs.mu);
    }
}

CUresult nvs_graph_admit(CUgraphExec exec, CUstream s)
{
    struct graph_rec *rec = record_of_exec(exec);
    if (rec == NULL || rec->n == 0) return CUDA_SUCCESS;
    if (all_held(rec) || nvs_stream_capturing(s)) return CUDA_SUCCESS; /* captured: runs later */
    uint64_t used_before[NVS_MAX_GPUS];
    return admit(rec, used_before);
}

void nvs_graph_ran(CUgraphExec exec, CUstream s, CUresult r)
{
    struct graph_rec *rec = record_of_exec(exec);
    if (rec == NULL) {
        /* not instantiated through the hook: measured after its first run, as before */
        struct nvs_gpu *g = nvs_submit_gpu(s);
        if (r != CUDA_SUCCESS || g == NULL || exec == NULL) return;
        rec = calloc(1, sizeof *rec);
        if (rec == NULL ||
            nvs_allocmap_put((struct nvs_alloc){.key = (uint64_t)(uintptr_t)exec,
                                                .kind = NVS_KIND_GRAPH,
                                                .aux = (uint64_t)(uintptr_t)rec}) != 0)
            free(rec);
        nvs_mutex_lock(&graphs.mu);
        graphs.used[g->index] = 1;
        nvs_mutex_unlock(&graphs.mu);
        settle_gpu(g);
        return;
    }
    if (all_held(rec)) return; /* the driver had it all reserved: nothing to read */
    uint64_t used_before[NVS_MAX_GPUS] = {0};
    settle_rec(rec, r, 1, used_before);
}

/* ---- instantiation: the graph's allocation nodes are read, and checked once more ---- */

typedef CUresult (*instantiate_fn)(CUgraphExec *exec, CUgraph graph, const void *args);

static CUresult instantiate(CUgraphExec *exec, CUgraph graph, const void *args, instantiate_fn call)
{
    struct graph_rec *rec = record_of_graph(graph);
    uint64_t used_before[NVS_MAX_GPUS] = {0};
    if (rec != NULL && admit(rec, used_before) != CUDA_SUCCESS) {
        free(rec);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = call(exec, graph, args);
    if (rec == NULL) return r;
    settle_rec(rec, r, 0, used_before);
    if (r != CUDA_SUCCESS || exec == NULL ||
        nvs_allocmap_put((struct nvs_alloc){.key = (uint64_t)(uintptr_t)*exec,
                                            .kind = NVS_KIND_GRAPH,
                                            .aux = (uint64_t)(uintptr_t)rec}) != 0)
        free(rec);
    return r;
}

struct legacy_args {
    CUgraphNode *err;
    char *log;
    size_t log_size;
};

static CUresult call_v1(CUgraphExec *exec, CUgraph graph, const void *args)
{
    const struct legacy_args *a = args;
    return NVS_CALL(cuGraphInstantiate, (exec, graph, a->err, a->log, a->log_size));
}
static CUresult call_v2(CUgraphExec *exec, CUgraph graph, const void *args)
{
    const struct legacy_args *a = args;
    return NVS_CALL(cuGraphInstantiate_v2, (exec, graph, a->err, a->log, a->log_size));
}
static CUresult call_flags(CUgraphExec *exec, CUgraph graph, const void *args)
{
    return NVS_CALL(cuGraphInstantiateWithFlags, (exec, graph, *(const unsigned long long *)args));
}
/* An instantiation that also uploads submits to its upload stream: it passes that gate, as
 * cuGraphUpload does. */
static struct nvs_thread *upload_gate(const CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (p == NULL || !(p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) return NULL;
    return nvs_gate_enter(nvs_submit_gpu(p->hUploadStream), p->hUploadStream);
}
static CUresult call_params(CUgraphExec *exec, CUgraph graph, const void *args)
{
    CUDA_GRAPH_INSTANTIATE_PARAMS *p = (CUDA_GRAPH_INSTANTIATE_PARAMS *)args;
    struct nvs_thread *t = upload_gate(p);
    CUresult r = NVS_CALL(cuGraphInstantiateWithParams, (exec, graph, p));
    nvs_gate_exit(t);
    return r;
}
static CUresult call_params_ptsz(CUgraphExec *exec, CUgraph graph, const void *args)
{
    CUDA_GRAPH_INSTANTIATE_PARAMS *p = (CUDA_GRAPH_INSTANTIATE_PARAMS *)args;
    struct nvs_thread *t = upload_gate(p);
    CUresult r = NVS_CALL(cuGraphInstantiateWithParams_ptsz, (exec, graph, p));
    nvs_gate_exit(t);
    return r;
}

NVS_EXPORT CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *err,
                                       char *log, size_t log_size)
{
    struct legacy_args a = {err, log, log_size};
    return instantiate(exec, graph, &a, call_v1);
}
NVS_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *err,
                                          char *log, size_t log_size)
{
    struct legacy_args a = {err, log, log_size};
    return instantiate(exec, graph, &a, call_v2);
}
NVS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                                unsigned long long flags)
{
    return instantiate(exec, graph, &flags, call_flags);
}
NVS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return instantiate(exec, graph, params, call_params);
}
NVS_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return instantiate(exec, graph, params, call_params_ptsz);
}

/* ---- memory given back: to the pool when an executable goes, to the GPU on a trim ---- */

NVS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    struct nvs_alloc e;
    int known = nvs_allocmap_take((uint64_t)(uintptr_t)exec, NVS_KIND_GRAPH, &e);
    CUresult r = NVS_CALL(cuGraphExecDestroy, (exec));
    if (!known) return r;
    if (r != CUDA_SUCCESS) {
        nvs_allocmap_put(e);
        return r;
    }
    struct graph_rec *rec = (struct graph_rec *)(uintptr_t)e.aux;
    for (int i = 0; i < rec->n; i++) settle_gpu(nvs_gpu_at(rec->part[i].gpu));
    free(rec);
    return r;
}

NVS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    CUresult r = NVS_CALL(cuDeviceGraphMemTrim, (dev));
    struct nvs_gpu *g = nvs_gpu_at(dev);
    if (g != NULL) settle_gpu(g);
    return r;
}

void nvs_graphs_after_fork(void)
{
    pthread_mutex_init(&graphs.mu, NULL);
    for (int i = 0; i < NVS_MAX_GPUS; i++) graphs.charged[i] = graphs.reserved[i] = graphs.used[i] = 0;
}
