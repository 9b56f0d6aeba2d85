/*
 * What the two halves of the fake libcuda.so.1 share: the device table, contexts, streams and
 * the capture rules (fake_cuda.c) and memory (fake_memory.c).
 */
#ifndef NVSHARE_FAKE_H
#define NVSHARE_FAKE_H

#include <pthread.h>
#include <stdint.h>

#include "../cuda_api.h"

#define EXPORT __attribute__((visibility("default")))
#define FAKE_MAX_DEVS 8
#define FAKE_MAX_CTX 256
#define FAKE_GRANULE (2ull << 20)
#define FAKE_COLL_RING 1024

struct fake_ctx {
    int dev, alive;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int worker_started;
    unsigned long pending; /* queued or running kernels */
    uint64_t launched, executed; /* kernels queued, and run, in order */
    /* collectives waiting to run: the kernel's place in the order and the collective's number */
    uint64_t coll_at[FAKE_COLL_RING], coll_num[FAKE_COLL_RING];
    unsigned coll_head, coll_tail;
};

/* A graph node; CUgraphNode handles point at these. */
#define FAKE_MAX_DEPS 8 /* the fake's graphs: more dependencies per node are refused */

struct fake_node {
    int type;         /* CU_GRAPH_NODE_TYPE_* */
    int dev;          /* allocation nodes: the device of their pool */
    size_t bytesize;  /* allocation nodes: as asked for */
    CUdeviceptr dptr; /* allocation and free nodes */
    struct fake_graph *child;
    struct fake_node *deps[FAKE_MAX_DEPS]; /* the nodes it depends on */
    size_t ndeps;
};

/* A graph: its nodes, added by capture or by the cuGraphAdd* calls (fake_graph.c). */
struct fake_graph {
    uint64_t magic;
    int dev;
    struct fake_node **nodes;
    size_t n, cap;
    int instantiated; /* with memory nodes, a graph has one executable at a time */
    int captured;     /* from one stream's capture: each node depends on the one before it */
};

struct fake_stream {
    uint64_t magic;
    struct fake_ctx *ctx;
    uint64_t last; /* the context's kernels launched when this stream's last work was queued */
    int capturing, mode, invalidated;
    struct fake_graph *graph;
};

struct fake_device_table {
    pthread_mutex_t mu;
    int initialised, count;
    uint64_t total, used[FAKE_MAX_DEVS];
    unsigned char uuid[FAKE_MAX_DEVS][16];
    long launch_us, launch_jitter_us, submit_delay_us;
    uint64_t collectives; /* launched by this process, numbered from 1 */
    const char *coll_dir;  /* NVSHARE_FAKE_COLLECTIVE_DIR: where ranks meet */
    uint64_t coll_ranks;   /* NVSHARE_FAKE_COLLECTIVE_RANKS */
    int trace_fd;
    uint64_t fail_size;
    struct fake_ctx *ctxs[FAKE_MAX_CTX];
    int nctx;
    struct fake_ctx *primary[FAKE_MAX_DEVS];
    int primary_refs[FAKE_MAX_DEVS];
    int global_captures;
    uint64_t graph_used[FAKE_MAX_DEVS], graph_reserved[FAKE_MAX_DEVS];
};

extern struct fake_device_table dev;

int fake_ready(void);
struct fake_ctx *fake_current(void);
struct fake_ctx *fake_stream_ctx(CUstream s);
struct fake_stream *fake_stream(CUstream s); /* NULL for the default streams */
int fake_valid_ctx(struct fake_ctx *c);
uint64_t fake_rounded(uint64_t n);
/* Queue one unit of work (a kernel's time) on s; wait: return once it has run. */
CUresult fake_run(CUstream s, int wait);
/* A call that would synchronise `c` (or only stream `only`): refused, and the captures broken,
 * where CUDA refuses it. */
CUresult fake_sync_allowed(struct fake_ctx *c, struct fake_stream *only);
/* For the tests (the probe's queuedepth): kernels the current context has queued, not run. */
unsigned long long fake_queued(void);

/* memory (fake_memory.c) */
CUresult fake_take(struct fake_ctx *c, int d, uint64_t requested, uint64_t charge,
                   unsigned long long *handle);
CUresult fake_give(uint64_t handle);
void fake_free_ctx_memory(struct fake_ctx *c);
void fake_release_pools(int d); /* at a synchronisation: pools shrink to their release threshold */
void fake_memory_init(void);
int fake_pinned(const void *p); /* host memory from cuMemHostAlloc (else pageable) */

/* cuda.h's CUgraphNodeParams, as far as cuGraphAddNode reads it here: a child graph node whose
 * graph moves into the parent (CUDA 12.9's CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE), the one way a
 * graph with memory nodes can be a child. */
#define FAKE_CHILD_GRAPH_OWNERSHIP_MOVE 1
typedef struct {
    int type; /* CUgraphNodeType */
    int reserved0[3];
    union {
        long long reserved1[29];
        struct {
            CUgraph graph;
            int ownership;
        } graph;
    } u;
    long long reserved2;
} fake_node_params;
CUresult cuGraphAddNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                        fake_node_params *params);

/* graphs (fake_graph.c); with dev.mu held for fake_graph_add */
struct fake_graph *fake_graph_new(int dev);
struct fake_node *fake_graph_add(struct fake_graph *g, struct fake_node node);

#endif
