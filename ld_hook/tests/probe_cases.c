/*
 * The probe's commands for what real frameworks do beyond plain allocations and launches:
 * streams on several devices, VMM handles mapped and released (NCCL, the CUDA samples), pools
 * with a release threshold (RMM, TensorRT), stream capture and graphs (PyTorch, vLLM), contexts
 * created, destroyed and reset, green contexts, every gated submission path by name, and several
 * threads launching at once. Each command answers one line, like those in probe.c.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake.h" /* the cuGraphAddNode parameters the fake reads */
#include "probe.h"

#define FN ((CUfunction)1)

static CUresult on_device(int d, CUcontext *ctx)
{
    CUresult r = cuDevicePrimaryCtxRetain(ctx, d);
    return r ? r : cuCtxPushCurrent_v2(*ctx);
}

static CUstream stream_arg(unsigned long long id)
{
    uint64_t v = 0;
    return handle_of(id, 'S', &v) ? (CUstream)(uintptr_t)v : NULL;
}

static CUresult new_stream(int d, size_t *id)
{
    CUcontext ctx, popped;
    CUstream s;
    CUresult r = on_device(d, &ctx);
    if (!r) r = cuStreamCreate(&s, 0);
    cuCtxPopCurrent_v2(&popped);
    if (!r) *id = keep('S', (uint64_t)(uintptr_t)s, 0);
    return r;
}

static CUresult launches(CUstream s, unsigned long long n)
{
    CUresult r = CUDA_SUCCESS;
    for (unsigned long long i = 0; i < n && !r; i++)
        r = cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    return r;
}

/* ---- every gated submission path, by name ---- */

#define CALL(name, ...)                                    \
    static CUresult call_##name(CUstream st)                \
    {                                                      \
        (void)st;                                          \
        return name(__VA_ARGS__);                          \
    }
CALL(cuLaunch, FN)
CALL(cuLaunchGrid, FN, 1, 1)
CALL(cuLaunchGridAsync, FN, 1, 1, st)
CALL(cuLaunchKernel, FN, 1, 1, 1, 1, 1, 1, 0, st, NULL, NULL)
CALL(cuLaunchCooperativeKernel, FN, 1, 1, 1, 1, 1, 1, 0, st, NULL)
CALL(cuLaunchHostFunc, st, NULL, NULL)
CALL(cuLaunchHostFunc_v2, st, NULL, NULL, 0)
CALL(cuStreamAddCallback, st, NULL, NULL, 0)
CALL(cuMemcpyAsync, 0, 0, 1, st)
CALL(cuMemsetD8Async, 0, 0, 1, st)
CALL(cuMemcpyHtoD_v2, 0, "x", 1)
CALL(cuMemcpyPeer, 0, NULL, 0, NULL, 1)
CALL(cuMemcpyBatchAsync, NULL, NULL, NULL, 0, NULL, NULL, 0, NULL, st)
CALL(cuMemcpyBatchAsync_v2, NULL, NULL, NULL, 0, NULL, NULL, 0, st)
CALL(cuMemcpy3DBatchAsync, 0, NULL, NULL, 0, st)
CALL(cuMemcpy3DBatchAsync_v2, 0, NULL, 0, st)
CALL(cuMemcpyWithAttributesAsync, 0, 0, 1, NULL, st)
CALL(cuMemcpy3DWithAttributesAsync, NULL, 0, st)
CALL(cuMemPrefetchAsync, 0, 1, 0, st)
CALL(cuMemPrefetchAsync_v2, 0, 1, (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, 0}, 0, st)
CALL(cuMemPrefetchBatchAsync, NULL, NULL, 0, NULL, NULL, 0, 0, st)
CALL(cuMemDiscardBatchAsync, NULL, NULL, 0, 0, st)
CALL(cuMemDiscardAndPrefetchBatchAsync, NULL, NULL, 0, NULL, NULL, 0, 0, st)
CALL(cuStreamWaitValue32, st, 0, 0, 0)
CALL(cuStreamWaitValue64, st, 0, 0, 0)
CALL(cuStreamWriteValue32, st, 0, 0, 0)
CALL(cuStreamWriteValue64, st, 0, 0, 0)
CALL(cuStreamBatchMemOp, st, 0, NULL, 0)
CALL(cuStreamWaitValue32_v2, st, 0, 0, 0)
CALL(cuStreamWaitValue64_v2, st, 0, 0, 0)
CALL(cuStreamWriteValue32_v2, st, 0, 0, 0)
CALL(cuStreamWriteValue64_v2, st, 0, 0, 0)
CALL(cuStreamBatchMemOp_v2, st, 0, NULL, 0)
CALL(cuMemMapArrayAsync, NULL, 0, st)
CALL(cuSignalExternalSemaphoresAsync, NULL, NULL, 0, st)
CALL(cuWaitExternalSemaphoresAsync, NULL, NULL, 0, st)
CALL(cuMemBatchDecompressAsync, NULL, 0, 0, NULL, st)

static CUresult call_cuLaunchKernelEx(CUstream st)
{
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, st, NULL, 0};
    return cuLaunchKernelEx(&cfg, FN, NULL, NULL);
}

static CUresult call_cuLaunchCooperativeKernelMultiDevice(CUstream st)
{
    CUDA_LAUNCH_PARAMS p = {FN, 1, 1, 1, 1, 1, 1, 0, st, NULL};
    return cuLaunchCooperativeKernelMultiDevice(&p, 1, 0);
}

static const struct {
    const char *name;
    CUresult (*fn)(CUstream);
} submissions[] = {
#define ENTRY(name) {#name, call_##name},
    ENTRY(cuLaunch) ENTRY(cuLaunchGrid) ENTRY(cuLaunchGridAsync) ENTRY(cuLaunchKernel)
    ENTRY(cuLaunchKernelEx) ENTRY(cuLaunchCooperativeKernel)
    ENTRY(cuLaunchCooperativeKernelMultiDevice) ENTRY(cuLaunchHostFunc) ENTRY(cuLaunchHostFunc_v2)
    ENTRY(cuStreamAddCallback)
    ENTRY(cuMemcpyAsync) ENTRY(cuMemsetD8Async) ENTRY(cuMemcpyHtoD_v2) ENTRY(cuMemcpyPeer)
    ENTRY(cuMemcpyBatchAsync) ENTRY(cuMemcpyBatchAsync_v2) ENTRY(cuMemcpy3DBatchAsync)
    ENTRY(cuMemcpy3DBatchAsync_v2) ENTRY(cuMemcpyWithAttributesAsync)
    ENTRY(cuMemcpy3DWithAttributesAsync) ENTRY(cuMemPrefetchAsync) ENTRY(cuMemPrefetchAsync_v2)
    ENTRY(cuMemPrefetchBatchAsync) ENTRY(cuMemDiscardBatchAsync)
    ENTRY(cuMemDiscardAndPrefetchBatchAsync) ENTRY(cuStreamWaitValue32) ENTRY(cuStreamWaitValue64)
    ENTRY(cuStreamWriteValue32) ENTRY(cuStreamWriteValue64) ENTRY(cuStreamBatchMemOp)
    ENTRY(cuStreamWaitValue32_v2) ENTRY(cuStreamWaitValue64_v2) ENTRY(cuStreamWriteValue32_v2)
    ENTRY(cuStreamWriteValue64_v2) ENTRY(cuStreamBatchMemOp_v2) ENTRY(cuMemMapArrayAsync)
    ENTRY(cuSignalExternalSemaphoresAsync) ENTRY(cuWaitExternalSemaphoresAsync)
    ENTRY(cuMemBatchDecompressAsync)
#undef ENTRY
};

static int submit(const char *args)
{
    char name[64] = "";
    unsigned long long sid = ~0ull;
    sscanf(args, "%63s %llu", name, &sid);
    if (strcmp(name, "list") == 0) {
        for (size_t i = 0; i < sizeof submissions / sizeof submissions[0]; i++)
            printf("%s%s", i ? " " : "ok ", submissions[i].name);
        printf("\n");
        fflush(stdout);
        return 1;
    }
    for (size_t i = 0; i < sizeof submissions / sizeof submissions[0]; i++)
        if (strcmp(submissions[i].name, name) == 0) {
            reply(submissions[i].fn(stream_arg(sid)), "ok\n", 0);
            return 1;
        }
    reply(CUDA_ERROR_INVALID_VALUE, "", 0);
    return 1;
}

/* ---- several threads launching at once (on device 0's primary context) ---- */

struct burst {
    double ms;
    unsigned long long count;
    CUresult r;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void *burst_main(void *p)
{
    struct burst *b = p;
    CUcontext ctx;
    b->r = cuDevicePrimaryCtxRetain(&ctx, 0);
    if (!b->r) b->r = cuCtxSetCurrent(ctx);
    double end = now_ms() + b->ms;
    while (!b->r && now_ms() < end) {
        b->r = launches(NULL, 2);
        b->count += 2;
        if (!b->r) b->r = cuCtxSynchronize();
    }
    return NULL;
}

/* One rank of a data-parallel job: a kernel and a collective (a launch in the remote
 * memory-synchronisation domain, as NCCL's are) per step, synchronised every `every` steps, for
 * `n` steps on the current context. Every rank runs the same number of collectives, as a real
 * job does: one that stopped early would leave its peers in their last collective for ever. */
static CUresult train(unsigned long long n, unsigned long long every, unsigned long long *steps)
{
    CUlaunchAttribute attr = {.id = CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN,
                              .value.memSyncDomain = CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE};
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, &attr, 1};
    CUresult r = CUDA_SUCCESS;
    while (!r && *steps < n) {
        r = cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (!r) r = cuLaunchKernelEx(&cfg, FN, NULL, NULL);
        if (!r && ++*steps % (every ? every : 1) == 0) r = cuCtxSynchronize();
    }
    if (!r) r = cuCtxSynchronize();
    return r;
}

static CUresult threads(unsigned long long n, unsigned long long ms, unsigned long long *count)
{
    pthread_t t[64];
    struct burst b[64];
    if (n > 64) n = 64;
    for (unsigned long long i = 0; i < n; i++) {
        b[i] = (struct burst){.ms = (double)ms};
        pthread_create(&t[i], NULL, burst_main, &b[i]);
    }
    CUresult r = CUDA_SUCCESS;
    for (unsigned long long i = 0; i < n; i++) {
        pthread_join(t[i], NULL);
        if (b[i].r) r = b[i].r;
        *count += b[i].count;
    }
    return r;
}

/* ---- the commands ---- */

static int memory_case(const char *cmd, unsigned long long x, unsigned long long y,
                       unsigned long long z)
{
    uint64_t v = 0;
    CUresult r;
    if (strcmp(cmd, "map") == 0) { /* map VMM-HANDLE: a fresh address range, mapped */
        CUdeviceptr va = 0;
        r = handle_of(x, 'v', &v) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
        if (!r) r = cuMemAddressReserve(&va, handles[x].aux, 0, 0, 0);
        if (!r) r = cuMemMap(va, handles[x].aux, 0, v, 0);
        reply(r, "ok %llu\n", r ? 0 : keep('M', va, handles[x].aux));
    } else if (strcmp(cmd, "unmap") == 0) {
        r = handle_of(x, 'M', &v) ? cuMemUnmap(v, handles[x].aux) : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "retain") == 0) { /* retain MAPPING: the handle behind an address */
        CUmemGenericAllocationHandle h = 0;
        r = handle_of(x, 'M', &v) ? cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)v)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", r ? 0 : keep('v', h, handles[x].aux));
    } else if (strcmp(cmd, "pool_create") == 0) { /* pool_create DEVICE */
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = 1;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = (int)x;
        CUmemoryPool pool;
        r = cuMemPoolCreate(&pool, &props);
        reply(r, "ok %llu\n", r ? 0 : keep('P', (uint64_t)(uintptr_t)pool, 0));
    } else if (strcmp(cmd, "pool_default") == 0) { /* pool_default DEVICE */
        CUmemoryPool pool;
        r = cuDeviceGetMemPool(&pool, (CUdevice)x);
        reply(r, "ok %llu\n", r ? 0 : keep('P', (uint64_t)(uintptr_t)pool, 0));
    } else if (strcmp(cmd, "pool_threshold") == 0) { /* pool_threshold POOL BYTES (max: -1) */
        cuuint64_t t = y;
        r = handle_of(x, 'P', &v) ? cuMemPoolSetAttribute((CUmemoryPool)(uintptr_t)v,
                                                          CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "pool_trim") == 0) { /* pool_trim POOL KEEP */
        r = handle_of(x, 'P', &v) ? cuMemPoolTrimTo((CUmemoryPool)(uintptr_t)v, y)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "pool_destroy") == 0) {
        r = handle_of(x, 'P', &v) ? cuMemPoolDestroy((CUmemoryPool)(uintptr_t)v)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "alloc_pool") == 0) { /* alloc_pool POOL STREAM BYTES */
        CUdeviceptr p = 0;
        r = handle_of(x, 'P', &v)
                ? cuMemAllocFromPoolAsync(&p, z, (CUmemoryPool)(uintptr_t)v, stream_arg(y))
                : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", r ? 0 : keep('q', p, 0));
    } else if (strcmp(cmd, "alloc_async") == 0) { /* alloc_async STREAM BYTES */
        CUdeviceptr p = 0;
        r = cuMemAllocAsync(&p, y, stream_arg(x));
        reply(r, "ok %llu\n", r ? 0 : keep('q', p, 0));
    } else if (strcmp(cmd, "free_async") == 0) { /* free_async PTR STREAM */
        r = handle_of(x, 'q', &v) ? cuMemFreeAsync(v, stream_arg(y)) : CUDA_ERROR_INVALID_VALUE;
        if (!r) handles[x].kind = 0;
        reply(r, "ok\n", 0);
    } else {
        return 0;
    }
    return 1;
}

/* cuGraphAddMemAllocNode of BYTES on DEVICE, freed in the graph by a free node after it; with
 * `after`, the allocation depends on *after, which becomes the free node. */
static CUresult graph_alloc(CUgraph g, int d, size_t bytes, CUgraphNode *after)
{
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1;
    p.poolProps.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, d};
    p.bytesize = bytes;
    CUgraphNode alloc, freed;
    int ordered = after != NULL && *after != NULL;
    CUresult r = cuGraphAddMemAllocNode(&alloc, g, ordered ? after : NULL, ordered, &p);
    if (!r) r = cuGraphAddMemFreeNode(&freed, g, &alloc, 1, p.dptr);
    if (!r && after != NULL) *after = freed;
    return r;
}

static int graph_case(const char *cmd, unsigned long long x, unsigned long long y,
                      unsigned long long z)
{
    uint64_t v = 0;
    CUresult r;
    if (strcmp(cmd, "graph_create") == 0) { /* graph_create -> an empty graph */
        CUgraph g = NULL;
        r = cuGraphCreate(&g, 0);
        reply(r, "ok %llu\n", r ? 0 : keep('G', (uint64_t)(uintptr_t)g, 0));
    } else if (strcmp(cmd, "graph_nodes") == 0) { /* graph_nodes GRAPH -> how many */
        size_t n = 0;
        r = handle_of(x, 'G', &v) ? cuGraphGetNodes((CUgraph)(uintptr_t)v, NULL, &n)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", (unsigned long long)n);
    } else if (strcmp(cmd, "graph_alloc") == 0) { /* graph_alloc GRAPH DEVICE BYTES */
        r = handle_of(x, 'G', &v) ? graph_alloc((CUgraph)(uintptr_t)v, (int)y, z, NULL)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "graph_chain") == 0) { /* graph_chain GRAPH DEVICE BYTES: after */
        static CUgraph chain_graph;                   /* the free of the last graph_chain */
        static CUgraphNode chain_tail;
        if (handle_of(x, 'G', &v) && (CUgraph)(uintptr_t)v != chain_graph) {
            chain_graph = (CUgraph)(uintptr_t)v;
            chain_tail = NULL;
        }
        r = handle_of(x, 'G', &v) ? graph_alloc((CUgraph)(uintptr_t)v, (int)y, z, &chain_tail)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "graph_child") == 0) { /* graph_child PARENT CHILD */
        CUgraphNode n;
        uint64_t c = 0;
        r = handle_of(x, 'G', &v) && handle_of(y, 'G', &c)
                ? cuGraphAddChildGraphNode(&n, (CUgraph)(uintptr_t)v, NULL, 0, (CUgraph)(uintptr_t)c)
                : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "graph_child_move") == 0) { /* graph_child_move PARENT CHILD */
        CUgraphNode n;
        uint64_t c = 0;
        fake_node_params params;
        memset(&params, 0, sizeof params);
        params.type = CU_GRAPH_NODE_TYPE_GRAPH;
        params.u.graph.ownership = FAKE_CHILD_GRAPH_OWNERSHIP_MOVE;
        r = handle_of(x, 'G', &v) && handle_of(y, 'G', &c)
                ? (params.u.graph.graph = (CUgraph)(uintptr_t)c,
                   cuGraphAddNode(&n, (CUgraph)(uintptr_t)v, NULL, 0, &params))
                : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "instantiate_v2") == 0) { /* instantiate_v2 GRAPH -> executable */
        CUgraphExec e = NULL;
        r = handle_of(x, 'G', &v) ? cuGraphInstantiate_v2(&e, (CUgraph)(uintptr_t)v, NULL, NULL, 0)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", r ? 0 : keep('E', (uint64_t)(uintptr_t)e, 0));
    } else if (strcmp(cmd, "instantiate_upload") == 0) { /* instantiate_upload GRAPH STREAM */
        CUgraphExec e = NULL;
        CUDA_GRAPH_INSTANTIATE_PARAMS p = {.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD,
                                           .hUploadStream = stream_arg(y)};
        r = handle_of(x, 'G', &v) ? cuGraphInstantiateWithParams(&e, (CUgraph)(uintptr_t)v, &p)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", r ? 0 : keep('E', (uint64_t)(uintptr_t)e, 0));
    } else if (strcmp(cmd, "graph_mem") == 0) { /* graph_mem DEVICE -> used reserved (driver's) */
        cuuint64_t used = 0, reserved = 0;
        r = cuDeviceGetGraphMemAttribute((CUdevice)x, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used);
        if (!r)
            r = cuDeviceGetGraphMemAttribute((CUdevice)x, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                                             &reserved);
        if (!r) printf("ok %llu %llu\n", (unsigned long long)used, (unsigned long long)reserved);
        else reply(r, "", 0);
        fflush(stdout);
    } else {
        return 0;
    }
    return 1;
}

static int capture_case(const char *cmd, unsigned long long x, unsigned long long y)
{
    uint64_t v = 0;
    CUresult r;
    if (strcmp(cmd, "capture_begin") == 0) { /* capture_begin STREAM MODE */
        r = cuStreamBeginCapture_v2(stream_arg(x), (CUstreamCaptureMode)y);
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "capture_launch") == 0) { /* capture_launch STREAM N: recorded */
        reply(launches(stream_arg(x), y), "ok\n", 0);
    } else if (strcmp(cmd, "capture_alloc") == 0) { /* capture_alloc STREAM BYTES: alloc+free nodes */
        CUdeviceptr p = 0;
        r = cuMemAllocAsync(&p, y, stream_arg(x));
        if (!r) r = launches(stream_arg(x), 1);
        if (!r) r = cuMemFreeAsync(p, stream_arg(x));
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "capture_end") == 0) { /* capture_end STREAM -> graph */
        CUgraph g = NULL;
        r = cuStreamEndCapture(stream_arg(x), &g);
        reply(r, "ok %llu\n", r ? 0 : keep('G', (uint64_t)(uintptr_t)g, 0));
    } else if (strcmp(cmd, "instantiate") == 0) { /* instantiate GRAPH -> executable */
        CUgraphExec e = NULL;
        r = handle_of(x, 'G', &v) ? cuGraphInstantiateWithFlags(&e, (CUgraph)(uintptr_t)v, 0)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok %llu\n", r ? 0 : keep('E', (uint64_t)(uintptr_t)e, 0));
    } else if (strcmp(cmd, "graph_launch") == 0 || strcmp(cmd, "graph_upload") == 0) {
        int up = cmd[6] == 'u';
        r = !handle_of(x, 'E', &v) ? CUDA_ERROR_INVALID_VALUE
            : up                   ? cuGraphUpload((CUgraphExec)(uintptr_t)v, stream_arg(y))
                                   : cuGraphLaunch((CUgraphExec)(uintptr_t)v, stream_arg(y));
        if (!r && !up) r = cuStreamSynchronize(stream_arg(y));
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "exec_destroy") == 0) {
        r = handle_of(x, 'E', &v) ? cuGraphExecDestroy((CUgraphExec)(uintptr_t)v)
                                  : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "graph_trim") == 0) { /* graph_trim DEVICE */
        reply(cuDeviceGraphMemTrim((CUdevice)x), "ok\n", 0);
    } else {
        return 0;
    }
    return 1;
}

static int context_case(const char *cmd, unsigned long long x, unsigned long long y)
{
    uint64_t v = 0;
    CUresult r;
    if (strcmp(cmd, "stream") == 0) { /* stream DEVICE -> a stream on its primary context */
        size_t id = 0;
        r = new_stream((int)x, &id);
        reply(r, "ok %llu\n", id);
    } else if (strcmp(cmd, "launch_on") == 0) { /* launch_on STREAM N: launch, then sync it */
        r = launches(stream_arg(x), y);
        if (!r) r = cuStreamSynchronize(stream_arg(x));
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "queue_on") == 0) { /* queue_on STREAM N: launch, no sync */
        reply(launches(stream_arg(x), y), "ok\n", 0);
    } else if (strcmp(cmd, "ctx_create") == 0) { /* ctx_create DEVICE: made current */
        CUcontext ctx;
        r = cuCtxCreate_v2(&ctx, 0, (CUdevice)x);
        reply(r, "ok %llu\n", r ? 0 : keep('C', (uint64_t)(uintptr_t)ctx, 0));
    } else if (strcmp(cmd, "ctx_stream") == 0) { /* ctx_stream CONTEXT -> a stream in it */
        CUcontext popped;
        CUstream s = NULL;
        r = handle_of(x, 'C', &v) ? cuCtxPushCurrent_v2((CUcontext)(uintptr_t)v) : CUDA_ERROR_INVALID_VALUE;
        if (!r) {
            r = cuStreamCreate(&s, 0);
            cuCtxPopCurrent_v2(&popped);
        }
        reply(r, "ok %llu\n", r ? 0 : keep('S', (uint64_t)(uintptr_t)s, 0));
    } else if (strcmp(cmd, "ctx_destroy") == 0) {
        r = handle_of(x, 'C', &v) ? cuCtxDestroy_v2((CUcontext)(uintptr_t)v) : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "ctx_set") == 0) {
        r = handle_of(x, 'C', &v) ? cuCtxSetCurrent((CUcontext)(uintptr_t)v) : CUDA_ERROR_INVALID_VALUE;
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "primary") == 0) { /* primary DEVICE: retain and make current */
        CUcontext ctx;
        r = cuDevicePrimaryCtxRetain(&ctx, (CUdevice)x);
        if (!r) r = cuCtxSetCurrent(ctx);
        reply(r, "ok\n", 0);
    } else if (strcmp(cmd, "reset") == 0) { /* reset DEVICE, as cudaDeviceReset does */
        reply(cuDevicePrimaryCtxReset_v2((CUdevice)x), "ok\n", 0);
    } else if (strcmp(cmd, "green") == 0) { /* green DEVICE -> a stream on a new green context */
        CUgreenCtx g;
        CUstream s;
        r = cuGreenCtxCreate(&g, NULL, (CUdevice)x, 0);
        if (!r) r = cuGreenCtxStreamCreate(&s, g, 0, 0);
        reply(r, "ok %llu\n", r ? 0 : keep('S', (uint64_t)(uintptr_t)s, 0));
    } else if (strcmp(cmd, "sync") == 0) {
        reply(cuCtxSynchronize(), "ok\n", 0);
    } else if (strcmp(cmd, "train") == 0) { /* train STEPS EVERY -> steps done */
        unsigned long long steps = 0;
        r = train(x, y, &steps);
        reply(r, "ok %llu\n", steps);
    } else if (strcmp(cmd, "threads") == 0) { /* threads N MS: N threads launching for MS */
        unsigned long long count = 0;
        r = threads(x, y, &count);
        reply(r, "ok %llu\n", count);
    } else {
        return 0;
    }
    return 1;
}

int probe_case(const char *cmd, const char *args)
{
    if (strcmp(cmd, "submit") == 0) return submit(args);
    if (probe_wait_case(cmd, args)) return 1;
    unsigned long long x = 0, y = 0, z = 0;
    sscanf(args, "%llu %llu %llu", &x, &y, &z);
    return memory_case(cmd, x, y, z) || capture_case(cmd, x, y) || graph_case(cmd, x, y, z) ||
           context_case(cmd, x, y);
}
