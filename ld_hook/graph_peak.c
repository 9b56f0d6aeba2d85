/*
 * A graph's peak memory (see graph_peak.h). At the moment a graph holds the most, let X be the
 * allocation made last among those live: every other live allocation Y was made before X and is
 * not yet freed. So Y is not a descendant of X (it would come after X), and the free node of Y,
 * if the graph has one, is not an ancestor of X (Y would be gone before X). The peak is at most,
 * over every allocation X, X's bytes plus those of every Y of its GPU that passes both tests.
 * Ancestry is read once, as a bitset over the graph's memory nodes per node, built in
 * dependency order; a graph too large for that (or a driver that does not say) gets the sum.
 */
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "graph_peak.h"

#define GRANULE (2ull << 20)
#define MAX_NESTING 8
#define MAX_BITSET_WORDS (1u << 22) /* 32 MiB of ancestry at most; past it, the sum */

struct mem_node {
    size_t node;        /* its index among the graph's nodes */
    int gpu;            /* an allocation's GPU; -1 for a free node */
    uint64_t bytes;     /* an allocation's, in granules */
    CUdeviceptr dptr;   /* what it allocates or frees */
    long freed_by;      /* an allocation: the mem_node that frees it in this graph, or -1 */
};

struct by_node {
    uintptr_t node;
    size_t index;
};

static uint64_t round_up(uint64_t n) { return (n + GRANULE - 1) / GRANULE * GRANULE; }

static int cmp_node(const void *a, const void *b)
{
    uintptr_t x = ((const struct by_node *)a)->node, y = ((const struct by_node *)b)->node;
    return (x > y) - (x < y);
}

static long index_of(const struct by_node *sorted, size_t n, CUgraphNode node)
{
    struct by_node key = {.node = (uintptr_t)node};
    const struct by_node *hit = bsearch(&key, sorted, n, sizeof *sorted, cmp_node);
    return hit != NULL ? (long)hit->index : -1;
}

/* Every node's dependencies as indices (CSR: deps[off[i]..off[i+1]]); 0 when the driver cannot
 * say, or names a node outside the graph. */
static int dependencies(CUgraphNode *nodes, size_t n, size_t **off_out, size_t **deps_out)
{
    struct by_node *sorted = calloc(n, sizeof *sorted);
    size_t *off = calloc(n + 1, sizeof *off);
    size_t *deps = NULL;
    CUgraphNode *buf = NULL;
    int ok = sorted != NULL && off != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        sorted[i] = (struct by_node){.node = (uintptr_t)nodes[i], .index = i};
        size_t c = 0;
        ok = NVS_CALL(cuGraphNodeGetDependencies, (nodes[i], NULL, &c)) == CUDA_SUCCESS;
        off[i + 1] = off[i] + c;
    }
    if (ok) {
        qsort(sorted, n, sizeof *sorted, cmp_node);
        deps = calloc(off[n] + 1, sizeof *deps);
        buf = calloc(off[n] + 1, sizeof *buf);
        ok = deps != NULL && buf != NULL;
    }
    for (size_t i = 0; ok && i < n; i++) {
        size_t c = off[i + 1] - off[i];
        if (c == 0) continue;
        ok = NVS_CALL(cuGraphNodeGetDependencies, (nodes[i], buf, &c)) == CUDA_SUCCESS &&
             c == off[i + 1] - off[i];
        for (size_t j = 0; ok && j < c; j++) {
            long at = index_of(sorted, n, buf[j]);
            ok = at >= 0;
            if (ok) deps[off[i] + j] = (size_t)at;
        }
    }
    free(sorted);
    free(buf);
    if (!ok) {
        free(off);
        free(deps);
        return 0;
    }
    *off_out = off;
    *deps_out = deps;
    return 1;
}

/* anc[i * words ..]: the memory nodes (by mem_node index) among node i's ancestors, built
 * children-first with an explicit stack; 0 on a cycle or out of memory. */
static int ancestry(size_t n, const size_t *off, const size_t *deps, const long *mem_of,
                    size_t words, uint64_t *anc)
{
    unsigned char *state = calloc(n, 1); /* 0 new, 1 opened, 2 done */
    size_t *stack = calloc(n + off[n] + 1, sizeof *stack);
    int ok = state != NULL && stack != NULL;
    for (size_t root = 0; ok && root < n; root++) {
        if (state[root]) continue;
        size_t top = 0;
        stack[top++] = root;
        while (ok && top > 0) {
            size_t i = stack[top - 1];
            if (state[i] == 2) {
                top--;
            } else if (state[i] == 0) {
                state[i] = 1;
                for (size_t e = off[i]; e < off[i + 1]; e++)
                    if (state[deps[e]] == 0) stack[top++] = deps[e];
            } else {
                uint64_t *mine = anc + i * words;
                for (size_t e = off[i]; ok && e < off[i + 1]; e++) {
                    size_t d = deps[e];
                    ok = state[d] == 2; /* opened but not done: a cycle */
                    for (size_t w = 0; ok && w < words; w++) mine[w] |= anc[d * words + w];
                    if (ok && mem_of[d] >= 0) mine[mem_of[d] / 64] |= 1ull << (mem_of[d] % 64);
                }
                state[i] = 2;
                top--;
            }
        }
    }
    free(state);
    free(stack);
    return ok;
}

static int has(const uint64_t *set, long bit) { return bit >= 0 && (set[bit / 64] >> (bit % 64)) & 1; }

/* The peak per GPU of the allocations in `mem` (k of them, allocations and frees); 0 when the
 * graph's dependencies cannot be read. */
static int ordered_peak(CUgraphNode *nodes, size_t n, const struct mem_node *mem, size_t k,
                        uint64_t *peak)
{
    size_t words = (k + 63) / 64;
    if (words == 0 || n > MAX_BITSET_WORDS / words) return 0;
    size_t *off = NULL, *deps = NULL;
    if (!dependencies(nodes, n, &off, &deps)) return 0;
    long *mem_of = malloc(n * sizeof *mem_of);
    uint64_t *anc = calloc(n * words, sizeof *anc);
    int ok = mem_of != NULL && anc != NULL;
    for (size_t i = 0; ok && i < n; i++) mem_of[i] = -1;
    for (size_t m = 0; ok && m < k; m++) mem_of[mem[m].node] = (long)m;
    ok = ok && ancestry(n, off, deps, mem_of, words, anc);
    for (size_t x = 0; ok && x < k; x++) {
        if (mem[x].gpu < 0) continue;
        const uint64_t *before_x = anc + mem[x].node * words;
        uint64_t at_once = mem[x].bytes;
        for (size_t y = 0; y < k; y++) {
            if (y == x || mem[y].gpu != mem[x].gpu) continue;
            int after_x = has(anc + mem[y].node * words, (long)x);
            int gone_before_x = has(before_x, mem[y].freed_by);
            if (!after_x && !gone_before_x) at_once += mem[y].bytes;
        }
        if (at_once > peak[mem[x].gpu]) peak[mem[x].gpu] = at_once;
    }
    free(off);
    free(deps);
    free(mem_of);
    free(anc);
    return ok;
}

static void peak_of(CUgraph graph, uint64_t *bytes, int depth)
{
    size_t n = 0;
    if (NVS_CALL(cuGraphGetNodes, (graph, NULL, &n)) != CUDA_SUCCESS || n == 0) return;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    struct mem_node *mem = calloc(n, sizeof *mem);
    if (nodes == NULL || mem == NULL ||
        NVS_CALL(cuGraphGetNodes, (graph, nodes, &n)) != CUDA_SUCCESS)
        n = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType type = -1;
        if (nodes[i] == NULL || NVS_CALL(cuGraphNodeGetType, (nodes[i], &type)) != CUDA_SUCCESS)
            continue;
        if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            if (NVS_CALL(cuGraphMemAllocNodeGetParams, (nodes[i], &p)) == CUDA_SUCCESS &&
                p.poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
                nvs_gpu_at(p.poolProps.location.id) != NULL)
                mem[k++] = (struct mem_node){.node = i, .gpu = p.poolProps.location.id,
                                             .bytes = round_up(p.bytesize), .dptr = p.dptr,
                                             .freed_by = -1};
        } else if (type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
            CUdeviceptr dptr = 0;
            if (NVS_CALL(cuGraphMemFreeNodeGetParams, (nodes[i], &dptr)) == CUDA_SUCCESS)
                mem[k++] = (struct mem_node){.node = i, .gpu = -1, .dptr = dptr, .freed_by = -1};
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH && depth < MAX_NESTING) {
            CUgraph child = NULL; /* its peak, as if live while anything of this graph is */
            if (NVS_CALL(cuGraphChildGraphNodeGetGraph, (nodes[i], &child)) == CUDA_SUCCESS)
                peak_of(child, bytes, depth + 1);
        }
    }
    for (size_t a = 0; a < k; a++)
        for (size_t f = 0; mem[a].gpu >= 0 && f < k; f++)
            if (mem[f].gpu < 0 && mem[f].dptr == mem[a].dptr) mem[a].freed_by = (long)f;
    uint64_t peak[NVS_MAX_GPUS] = {0};
    if (!ordered_peak(nodes, n, mem, k, peak)) {
        memset(peak, 0, sizeof peak); /* the driver did not say: all of them at once */
        for (size_t a = 0; a < k; a++)
            if (mem[a].gpu >= 0) peak[mem[a].gpu] += mem[a].bytes;
    }
    for (int g = 0; g < NVS_MAX_GPUS; g++) bytes[g] += peak[g];
    free(nodes);
    free(mem);
}

void nvs_graph_peak(CUgraph graph, uint64_t bytes[NVS_MAX_GPUS]) { peak_of(graph, bytes, 0); }
