/*
 * The fake driver's graphs, with the graph-memory rules CUDA documents: allocation nodes (from
 * a capture's cuMemAllocAsync or from cuGraphAddMemAllocNode) take no memory when they are
 * added; an executable's allocations are mapped from the device's graph pool when it is
 * uploaded or launched (or instantiated with the upload flag), the pool growing only by what
 * its reserved-but-unused memory cannot serve; they stay mapped across launches; a destroyed
 * executable's memory goes back to the pool, still reserved; cuDeviceGraphMemTrim unmaps what no
 * scheduled graph uses (every fake graph has finished by then) and gives the pool's unused
 * memory back to the device, so the next launch maps it again. Allocations of one graph share
 * no memory, unless NVSHARE_FAKE_GRAPH_SHARE=1: then a graph needs only its largest allocation
 * (as if none were live at once; the driver may share what is not, nothing requires it to).
 */
#include <stdlib.h>
#include <string.h>

#include "fake.h"

#define GRAPH_MAGIC 0x66616b6567726170ull
#define EXEC_MAGIC 0x66616b6565786563ull
#define MAX_EXECS 4096
#define CUDA_ERROR_NOT_SUPPORTED 801

struct fake_exec {
    uint64_t magic;
    struct fake_graph *graph;
    uint64_t mem[FAKE_MAX_DEVS]; /* its allocations' bytes per device */
    int mapped[FAKE_MAX_DEVS];
};

static struct fake_exec *execs[MAX_EXECS]; /* with dev.mu held */
static int nexecs;
static uint64_t next_va = 0x7e0000000000ull;

struct fake_graph *fake_graph_new(int d)
{
    struct fake_graph *g = calloc(1, sizeof *g);
    g->magic = GRAPH_MAGIC;
    g->dev = d;
    return g;
}

struct fake_node *fake_graph_add(struct fake_graph *g, struct fake_node node)
{
    if (g->n == g->cap) {
        g->cap = g->cap ? g->cap * 2 : 16;
        g->nodes = realloc(g->nodes, g->cap * sizeof *g->nodes);
    }
    struct fake_node *n = malloc(sizeof *n);
    *n = node;
    if (g->captured && g->n > 0) { /* a stream's work runs in order */
        n->deps[0] = g->nodes[g->n - 1];
        n->ndeps = 1;
    }
    g->nodes[g->n++] = n;
    return n;
}

/* The node `node` with dependencies `deps`, or NULL where the fake cannot hold that many. */
static struct fake_node *add_after(struct fake_graph *g, const CUgraphNode *deps, size_t ndeps,
                                   struct fake_node node)
{
    if (ndeps > FAKE_MAX_DEPS || (ndeps > 0 && deps == NULL)) return NULL;
    for (size_t i = 0; i < ndeps; i++) node.deps[i] = (struct fake_node *)deps[i];
    node.ndeps = ndeps;
    return fake_graph_add(g, node);
}

static struct fake_graph *graph_of(CUgraph graph)
{
    struct fake_graph *g = (struct fake_graph *)graph;
    return g != NULL && g->magic == GRAPH_MAGIC ? g : NULL;
}

/* With dev.mu held: the graph's allocation bytes per device, child graphs included. */
static void graph_memory(const struct fake_graph *g, uint64_t *mem)
{
    const char *share = getenv("NVSHARE_FAKE_GRAPH_SHARE");
    int shared = share != NULL && strcmp(share, "1") == 0;
    for (size_t i = 0; i < g->n; i++) {
        const struct fake_node *n = g->nodes[i];
        uint64_t bytes = fake_rounded(n->bytesize);
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
            mem[n->dev] = shared ? (bytes > mem[n->dev] ? bytes : mem[n->dev]) : mem[n->dev] + bytes;
        if (n->type == CU_GRAPH_NODE_TYPE_GRAPH) graph_memory(n->child, mem);
    }
}

static int has_memory_nodes(const struct fake_graph *g)
{
    uint64_t mem[FAKE_MAX_DEVS] = {0};
    graph_memory(g, mem);
    for (int d = 0; d < FAKE_MAX_DEVS; d++)
        if (mem[d]) return 1;
    return 0;
}

/* ---- building graphs ---- */

EXPORT CUresult cuGraphCreate(CUgraph *graph, unsigned flags)
{
    (void)flags;
    struct fake_ctx *c = fake_current();
    *graph = (CUgraph)fake_graph_new(c != NULL ? c->dev : 0);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                       size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    struct fake_graph *g = graph_of(graph);
    if (g == NULL || p == NULL || p->bytesize == 0 || ndeps > FAKE_MAX_DEPS ||
        p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        p->poolProps.location.id < 0 || p->poolProps.location.id >= dev.count)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    p->dptr = next_va;
    next_va += fake_rounded(p->bytesize);
    *node = (CUgraphNode)add_after(
        g, deps, ndeps,
        (struct fake_node){.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC, .dev = p->poolProps.location.id,
                           .bytesize = p->bytesize, .dptr = p->dptr});
    pthread_mutex_unlock(&dev.mu);
    return *node != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                      size_t ndeps, CUdeviceptr dptr)
{
    struct fake_graph *g = graph_of(graph);
    if (g == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    *node = (CUgraphNode)add_after(
        g, deps, ndeps, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_MEM_FREE, .dptr = dptr});
    pthread_mutex_unlock(&dev.mu);
    return *node != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Embeds `child` (the real driver clones it; the fake's graphs are not changed once embedded).
 * A graph with memory nodes can only be a child when its ownership moves (cuGraphAddNode). */
EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                         size_t ndeps, CUgraph child)
{
    (void)deps, (void)ndeps;
    struct fake_graph *g = graph_of(graph), *c = graph_of(child);
    if (g == NULL || c == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    CUresult r = has_memory_nodes(c) ? CUDA_ERROR_NOT_SUPPORTED : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        *node = (CUgraphNode)fake_graph_add(
            g, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_GRAPH, .child = c});
    pthread_mutex_unlock(&dev.mu);
    return r;
}

/* Only a child graph node whose graph moves into the parent: it may hold memory nodes. */
EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                               size_t ndeps, fake_node_params *params)
{
    (void)deps, (void)ndeps;
    struct fake_graph *g = graph_of(graph);
    if (g == NULL || params == NULL || params->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;
    if (params->u.graph.ownership != FAKE_CHILD_GRAPH_OWNERSHIP_MOVE)
        return cuGraphAddChildGraphNode(node, graph, deps, ndeps, params->u.graph.graph);
    struct fake_graph *c = graph_of(params->u.graph.graph);
    if (c == NULL || c == g) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    *node = (CUgraphNode)fake_graph_add(
        g, (struct fake_node){.type = CU_GRAPH_NODE_TYPE_GRAPH, .child = c});
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *n)
{
    struct fake_graph *g = graph_of(graph);
    if (g == NULL || n == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    if (nodes != NULL)
        for (size_t i = 0; i < *n; i++) nodes[i] = i < g->n ? (CUgraphNode)g->nodes[i] : NULL;
    size_t count = g->n;
    pthread_mutex_unlock(&dev.mu);
    if (nodes == NULL || *n > count) *n = count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
{
    if (node == NULL) return CUDA_ERROR_INVALID_VALUE;
    *type = ((struct fake_node *)node)->type;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    struct fake_node *n = (struct fake_node *)node;
    if (n == NULL || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    p->poolProps.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, n->dev};
    p->bytesize = n->bytesize;
    p->dptr = n->dptr;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr)
{
    struct fake_node *n = (struct fake_node *)node;
    if (n == NULL || dptr == NULL || n->type != CU_GRAPH_NODE_TYPE_MEM_FREE)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = n->dptr;
    return CUDA_SUCCESS;
}

/* As CUDA documents it: with `deps` NULL the count; else up to *n of them, *n set to how many. */
EXPORT CUresult cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode *deps, size_t *n)
{
    struct fake_node *f = (struct fake_node *)node;
    if (f == NULL || n == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (deps != NULL)
        for (size_t i = 0; i < *n; i++) deps[i] = i < f->ndeps ? (CUgraphNode)f->deps[i] : NULL;
    if (deps == NULL || *n > f->ndeps) *n = f->ndeps;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *child)
{
    struct fake_node *n = (struct fake_node *)node;
    if (n == NULL || n->type != CU_GRAPH_NODE_TYPE_GRAPH) return CUDA_ERROR_INVALID_VALUE;
    *child = (CUgraph)n->child;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(CUgraph graph)
{
    return graph_of(graph) != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- executables and their memory ---- */

static struct fake_exec *exec_of(CUgraphExec exec)
{
    struct fake_exec *e = (struct fake_exec *)exec;
    return e != NULL && e->magic == EXEC_MAGIC ? e : NULL;
}

/* With dev.mu held: map e's allocations, growing each pool by what its unused memory lacks;
 * nothing at all when one device cannot. */
static CUresult map_exec(struct fake_exec *e)
{
    uint64_t grow[FAKE_MAX_DEVS] = {0};
    for (int d = 0; d < dev.count; d++) {
        if (e->mapped[d] || e->mem[d] == 0) continue;
        uint64_t want = dev.graph_used[d] + e->mem[d];
        grow[d] = want > dev.graph_reserved[d] ? want - dev.graph_reserved[d] : 0;
        if (dev.used[d] + grow[d] > dev.total) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int d = 0; d < dev.count; d++) {
        if (e->mapped[d] || e->mem[d] == 0) continue;
        dev.used[d] += grow[d];
        dev.graph_reserved[d] += grow[d];
        dev.graph_used[d] += e->mem[d];
        e->mapped[d] = 1;
    }
    return CUDA_SUCCESS;
}

static void unmap_exec(struct fake_exec *e, int d)
{
    if (!e->mapped[d]) return;
    dev.graph_used[d] -= e->mem[d];
    e->mapped[d] = 0;
}

static CUresult instantiate(CUgraphExec *exec, CUgraph graph, int upload)
{
    struct fake_graph *g = graph_of(graph);
    if (g == NULL || exec == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&dev.mu);
    CUresult r = CUDA_SUCCESS;
    int memory = has_memory_nodes(g);
    if ((memory && g->instantiated) || nexecs == MAX_EXECS) r = CUDA_ERROR_INVALID_VALUE;
    struct fake_exec *e = NULL;
    if (r == CUDA_SUCCESS) {
        e = calloc(1, sizeof *e);
        e->magic = EXEC_MAGIC;
        e->graph = g;
        graph_memory(g, e->mem);
        if (upload) r = map_exec(e);
    }
    if (r == CUDA_SUCCESS) {
        g->instantiated = memory;
        execs[nexecs++] = e;
        *exec = (CUgraphExec)e;
    } else {
        free(e);
    }
    pthread_mutex_unlock(&dev.mu);
    return r;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                            unsigned long long flags)
{
    (void)flags;
    return instantiate(exec, graph, 0);
}
EXPORT CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log,
                                   size_t log_size)
{
    (void)err, (void)log, (void)log_size;
    return instantiate(exec, graph, 0);
}
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *err,
                                      char *log, size_t log_size)
{
    return cuGraphInstantiate(exec, graph, err, log, log_size);
}
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph,
                                             CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    if (params == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = instantiate(exec, graph, (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) != 0);
    params->result_out = r == CUDA_SUCCESS ? 0 : 1; /* CUDA_GRAPH_INSTANTIATE_(SUCCESS|ERROR) */
    return r;
}
EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return cuGraphInstantiateWithParams(exec, graph, params);
}

static CUresult run_graph(CUgraphExec exec, CUstream s, int launch_it)
{
    pthread_mutex_lock(&dev.mu);
    struct fake_exec *e = exec_of(exec);
    CUresult r = e != NULL ? map_exec(e) : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&dev.mu);
    return r == CUDA_SUCCESS && launch_it ? fake_run(s, 0) : r;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return run_graph(g, s, 1); }
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return run_graph(g, s, 1); }
EXPORT CUresult cuGraphUpload(CUgraphExec g, CUstream s) { return run_graph(g, s, 0); }
EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec g, CUstream s) { return run_graph(g, s, 0); }

EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    pthread_mutex_lock(&dev.mu);
    struct fake_exec *e = exec_of(exec);
    if (e != NULL) {
        for (int d = 0; d < dev.count; d++) unmap_exec(e, d); /* back to the pool, still reserved */
        e->graph->instantiated = 0;
        e->magic = 0;
        for (int i = 0; i < nexecs; i++)
            if (execs[i] == e) execs[i] = execs[--nexecs];
        free(e);
    }
    pthread_mutex_unlock(&dev.mu);
    return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, CUgraphMem_attribute attr, void *value)
{
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&dev.mu);
    uint64_t v = attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT       ? dev.graph_used[d]
                 : attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT ? dev.graph_reserved[d]
                                                                  : 0;
    pthread_mutex_unlock(&dev.mu);
    *(cuuint64_t *)value = v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    if (d < 0 || d >= dev.count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&dev.mu);
    for (int i = 0; i < nexecs; i++) unmap_exec(execs[i], d);
    dev.used[d] -= dev.graph_reserved[d] - dev.graph_used[d];
    dev.graph_reserved[d] = dev.graph_used[d];
    pthread_mutex_unlock(&dev.mu);
    return CUDA_SUCCESS;
}
