// CUDA C checks and micro-benchmarks run under libnvshare.so on a real GPU (tests/gpu/run.sh).
//   programs launch N            per-launch time of an empty kernel (launch-bound loop)
//   programs malloc N            2 MiB cudaMalloc/cudaFree pairs, per pair
//   programs free_live N         cudaFree cost with N live allocations
//   programs alloc_paths BYTES   try cudaMallocAsync, an explicit pool and cudaMallocArray
//                                of BYTES each; prints "path ok|oom|error(<name>)"
//   programs vmm BYTES           NCCL's pattern: 256 MiB VMM handles mapped and released at once,
//                                up to BYTES; then a retained handle, unmapping, and again
//   programs pool BYTES          a pool with release threshold max (RMM, TensorRT): BYTES
//                                allocated and freed async, then cudaMalloc of BYTES; then trimmed
//   programs graph_mem BYTES     a graph capturing a BYTES cudaMallocAsync: charged at launch
//   programs graph_admit BYTES   a captured cudaMallocAsync of BYTES: instantiated with the
//                                upload flag, then plainly, uploaded and launched four times;
//                                prints each verdict and the driver's graph pool (used,
//                                reserved), then, after a trim, a graph of two BYTES/2
//                                allocations one after the other (does the driver share them?)
//   programs capture_loop S      S seconds of graph captures (global mode, with kernels and
//                                stream-ordered allocations), each instantiated and launched
//   programs two_gpu BYTES       device 0 current, work and stream-ordered allocations of BYTES on
//                                a stream of device 1: charged and gated on device 1
//   programs quota loop|graph S  compute-bound work for S seconds once told "go" on stdin (after
//                                "ready"): `loop` one ~1 ms FMA kernel per synchronise, `graph` a
//                                CUDA graph of 20 of them launched twice per synchronise; then
//                                "batch START END" per synchronise (CLOCK_MONOTONIC seconds)
// Every line is "key value..."; every check also prints this process's NVML usage.
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvml.h>
#include <stdint.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

__global__ void empty_kernel(void) {}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define CHECK(call)                                                                    \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,               \
                    cudaGetErrorString(e_));                                           \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void launch_bench(long n) {
    CHECK(cudaFree(0));
    for (int i = 0; i < 1000; i++) empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    enum { ROUNDS = 11 };
    double per[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_s();
        for (long i = 0; i < n; i++) {
            empty_kernel<<<1, 1>>>();
            if ((i & 1023) == 1023) CHECK(cudaDeviceSynchronize());
        }
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaGetLastError());
        per[r] = (now_s() - t0) / n * 1e6;
    }
    qsort(per, ROUNDS, sizeof per[0], cmp_double);
    printf("launch_us_median %.4f min %.4f max %.4f\n", per[ROUNDS / 2], per[0], per[ROUNDS - 1]);
}

static void malloc_bench(long n) {
    CHECK(cudaFree(0));
    void *p;
    for (int i = 0; i < 100; i++) { CHECK(cudaMalloc(&p, 2 << 20)); CHECK(cudaFree(p)); }
    double t0 = now_s();
    for (long i = 0; i < n; i++) {
        CHECK(cudaMalloc(&p, 2 << 20));
        CHECK(cudaFree(p));
    }
    printf("malloc_free_pair_us %.4f\n", (now_s() - t0) / n * 1e6);
}

static void free_live_bench(long n) {
    CHECK(cudaFree(0));
    void **ptrs = (void **)calloc(n, sizeof(void *));
    for (long i = 0; i < n; i++) CHECK(cudaMalloc(&ptrs[i], 4096));
    double t0 = now_s();
    for (long i = 0; i < n; i++) CHECK(cudaFree(ptrs[(i * 7919) % n]));  // scattered order
    printf("free_with_%ld_live_us %.4f\n", n, (now_s() - t0) / n * 1e6);
    free(ptrs);
}

static const char *verdict(cudaError_t e) {
    static char buf[96];
    if (e == cudaSuccess) return "ok";
    if (e == cudaErrorMemoryAllocation) return "oom";
    snprintf(buf, sizeof buf, "error(%s)", cudaGetErrorName(e));
    return buf;
}

static cudaMemPool_t device_pool(void) {  // an explicit pool of device 0's memory
    cudaMemPool_t pool;
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    CHECK(cudaMemPoolCreate(&pool, &props));
    return pool;
}

static void alloc_paths(size_t bytes) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e == cudaSuccess) { CHECK(cudaFreeAsync(p, s)); CHECK(cudaStreamSynchronize(s)); }
    cudaGetLastError();
    printf("cudaMallocAsync %zu %s\n", bytes, verdict(e));

    cudaMemPool_t pool = device_pool();
    p = NULL;
    e = cudaMallocFromPoolAsync(&p, bytes, pool, s);
    if (e == cudaSuccess) { CHECK(cudaFreeAsync(p, s)); CHECK(cudaStreamSynchronize(s)); }
    cudaGetLastError();
    printf("cudaMallocFromPoolAsync %zu %s\n", bytes, verdict(e));
    CHECK(cudaMemPoolDestroy(pool));

    cudaChannelFormatDesc desc = cudaCreateChannelDesc<float>();
    size_t width = 16384, height = bytes / (width * sizeof(float));
    cudaArray_t arr = NULL;
    e = cudaMallocArray(&arr, &desc, width, height, 0);
    if (e == cudaSuccess) CHECK(cudaFreeArray(arr));
    cudaGetLastError();
    printf("cudaMallocArray %zu %s\n", bytes, verdict(e));

    p = NULL;
    e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) CHECK(cudaFree(p));
    cudaGetLastError();
    printf("cudaMalloc %zu %s\n", bytes, verdict(e));
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("cudaMemGetInfo free %zu total %zu\n", free_b, total_b);
}

static unsigned long long nvml_self(void) {
    // what NVML shows this process holding on GPU 0 (not through the hook: NVML's own view)
    static int ready = 0;
    if (!ready) ready = nvmlInit_v2() == NVML_SUCCESS ? 1 : -1;
    if (ready < 0) return 0;
    nvmlDevice_t dev;
    nvmlProcessInfo_t procs[64];
    unsigned int n = 64;
    if (nvmlDeviceGetHandleByIndex_v2(0, &dev) != NVML_SUCCESS) return 0;
    if (nvmlDeviceGetComputeRunningProcesses(dev, &n, procs) != NVML_SUCCESS) return 0;
    for (unsigned int i = 0; i < n; i++)
        if (procs[i].pid == (unsigned int)getpid()) return procs[i].usedGpuMemory;
    return 0;
}

static void vmm_check(size_t limit) {
    CHECK(cudaFree(0));
    CUdevice dev;
    cuCtxGetDevice(&dev);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    const size_t chunk = 256ull << 20;
    enum { MAX = 64 };
    CUdeviceptr va[MAX];
    int mapped = 0;
    CUresult refused = CUDA_SUCCESS;
    size_t want = limit * 4 / chunk;  // try four times the limit, as a framework would
    if (want > MAX) want = MAX;
    for (size_t i = 0; i < want; i++) {
        CUmemGenericAllocationHandle h;
        CUresult r = cuMemCreate(&h, chunk, &prop, 0);
        if (r != CUDA_SUCCESS) { refused = r; break; }
        (cuMemAddressReserve(&va[i], chunk, 0, 0, 0));
        (cuMemMap(va[i], chunk, 0, h, 0));
        CUmemAccessDesc access = {prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        (cuMemSetAccess(va[i], chunk, &access, 1));
        (cuMemRelease(h));  // released while mapped: the memory stays in use
        CHECK(cudaMemset((void *)va[i], 1, chunk));
        mapped++;
    }
    CHECK(cudaDeviceSynchronize());
    printf("vmm_mapped %d of %zu\n", mapped, want);
    printf("vmm_refusal %d\n", (int)refused);
    printf("vmm_nvml_used %llu\n", nvml_self());
    CUmemGenericAllocationHandle again;  // a second reference to the first handle, as NCCL takes
    CUresult r = mapped ? cuMemRetainAllocationHandle(&again, (void *)va[0]) : CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < mapped; i++) {
        cuMemUnmap(va[i], chunk);
        cuMemAddressFree(va[i], chunk);
    }
    CUmemGenericAllocationHandle hs[MAX];
    int fresh = 0;  // handle 0 is still retained: one chunk fewer fits
    while (fresh < MAX && cuMemCreate(&hs[fresh], chunk, &prop, 0) == CUDA_SUCCESS) fresh++;
    printf("vmm_retain %d\n", (int)r);
    printf("vmm_created_while_retained %d\n", fresh);
    if (r == CUDA_SUCCESS) cuMemRelease(again);
    int more = 0;
    while (fresh + more < MAX && cuMemCreate(&hs[fresh + more], chunk, &prop, 0) == CUDA_SUCCESS) more++;
    printf("vmm_created_after_release %d\n", more);
    for (int i = 0; i < fresh + more; i++) cuMemRelease(hs[i]);
}

static void pool_check(size_t bytes) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaMemPool_t pool = device_pool();
    uint64_t max = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &max));
    void *p = NULL;
    cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool, s);
    if (e == cudaSuccess) CHECK(cudaFreeAsync(p, s));
    CHECK(cudaStreamSynchronize(s));
    uint64_t reserved = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    printf("pool_first %s\n", verdict(e));
    printf("pool_reserved_after_free %llu\n", (unsigned long long)reserved);
    printf("pool_nvml_used %llu\n", nvml_self());
    void *q = NULL;
    e = cudaMalloc(&q, bytes);  // the pool still holds `bytes`: over the limit
    if (e == cudaSuccess) CHECK(cudaFree(q));
    cudaGetLastError();
    printf("pool_then_malloc %s\n", verdict(e));
    e = cudaMallocFromPoolAsync(&p, bytes, pool, s);  // served from what the pool keeps
    if (e == cudaSuccess) CHECK(cudaFreeAsync(p, s));
    CHECK(cudaStreamSynchronize(s));
    cudaGetLastError();
    printf("pool_reuse %s\n", verdict(e));
    CHECK(cudaMemPoolTrimTo(pool, 0));
    e = cudaMalloc(&q, bytes);
    if (e == cudaSuccess) CHECK(cudaFree(q));
    cudaGetLastError();
    printf("pool_trimmed_then_malloc %s\n", verdict(e));
    CHECK(cudaMemPoolDestroy(pool));
}

__global__ void touch_kernel(char *p, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i * 4096 % n] = 1;
}

static void graph_mem_check(size_t bytes) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    void *p = NULL;
    CHECK(cudaMallocAsync(&p, bytes, s));
    touch_kernel<<<256, 256, 0, s>>>((char *)p, bytes);
    CHECK(cudaFreeAsync(p, s));
    CHECK(cudaStreamEndCapture(s, &graph));
    size_t free_b, total_b;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("graph_free_after_capture %zu\n", free_b);
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("graph_free_after_launch %zu\n", free_b);
    printf("graph_nvml_used %llu\n", nvml_self());
    void *q = NULL;
    cudaError_t e = cudaMalloc(&q, bytes);
    if (e == cudaSuccess) CHECK(cudaFree(q));
    cudaGetLastError();
    printf("graph_then_malloc %s\n", verdict(e));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaDeviceGraphMemTrim(0));
    e = cudaMalloc(&q, bytes);
    if (e == cudaSuccess) CHECK(cudaFree(q));
    cudaGetLastError();
    printf("graph_trimmed_then_malloc %s\n", verdict(e));
}

static unsigned long long graph_pool_attr(cudaGraphMemAttributeType attr) {
    unsigned long long v = 0;  // the driver's own figure (the hook does not interpose it)
    CHECK(cudaDeviceGetGraphMemAttribute(0, attr, &v));
    return v;
}

// A graph capturing cudaMallocAsync(half) + kernel + cudaFreeAsync, `times` times in a row.
static cudaGraph_t captured_allocations(cudaStream_t s, size_t bytes, int times) {
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < times; i++) {
        void *p = NULL;
        CHECK(cudaMallocAsync(&p, bytes, s));
        touch_kernel<<<256, 256, 0, s>>>((char *)p, bytes);
        CHECK(cudaFreeAsync(p, s));
    }
    CHECK(cudaStreamEndCapture(s, &graph));
    return graph;
}

// Graph memory checked before the driver reserves it: over the limit every call that could
// reserve it fails with out-of-memory and the graph pool stays empty; within it, charged once.
static void graph_admit(size_t bytes) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph = captured_allocations(s, bytes, 1);
    cudaGraphInstantiateParams ip;
    memset(&ip, 0, sizeof ip);
    ip.flags = cudaGraphInstantiateFlagUpload;
    ip.uploadStream = s;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaGraphInstantiateWithParams(&exec, graph, &ip);
    cudaGetLastError();
    printf("graph_instantiate_upload %s\n", verdict(e));
    if (e == cudaSuccess) {
        CHECK(cudaStreamSynchronize(s));
        printf("graph_reserved_after_instantiate_upload %llu\n",
               graph_pool_attr(cudaGraphMemAttrReservedMemCurrent));
        CHECK(cudaGraphExecDestroy(exec));  // one executable per graph with memory nodes
    }
    exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGetLastError();
    printf("graph_instantiate %s\n", verdict(e));
    int launches = 0;
    if (e == cudaSuccess) {
        e = cudaGraphUpload(exec, s);
        cudaGetLastError();
        printf("graph_upload %s\n", verdict(e));
        for (int i = 0; i < 4; i++) {
            e = cudaGraphLaunch(exec, s);
            if (e == cudaSuccess) e = cudaStreamSynchronize(s);
            cudaGetLastError();
            launches += e == cudaSuccess;
            if (e != cudaSuccess) printf("graph_launch_error %s\n", verdict(e));
        }
    }
    printf("graph_launches_ok %d\n", launches);
    size_t free_b, total_b;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("graph_free %zu\n", free_b);
    printf("graph_used %llu\n", graph_pool_attr(cudaGraphMemAttrUsedMemCurrent));
    printf("graph_reserved %llu\n", graph_pool_attr(cudaGraphMemAttrReservedMemCurrent));
    printf("graph_nvml_used %llu\n", nvml_self());
    if (exec != NULL) CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaDeviceGraphMemTrim(0));
    printf("graph_reserved_after_trim %llu\n", graph_pool_attr(cudaGraphMemAttrReservedMemCurrent));
    // informational: does the driver let two allocations that are never live at once share?
    graph = captured_allocations(s, bytes / 2, 2);
    e = cudaGraphInstantiate(&exec, graph, 0);
    if (e == cudaSuccess) e = cudaGraphLaunch(exec, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    cudaGetLastError();
    printf("graph_chain %s\n", verdict(e));
    printf("graph_chain_reserved %llu\n", graph_pool_attr(cudaGraphMemAttrReservedMemCurrent));
    if (e == cudaSuccess) CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaDeviceGraphMemTrim(0));
}

// Captures as vLLM makes them at start-up, for `seconds`: any failure is counted, none expected.
static void capture_loop(double seconds) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    long captures = 0, failures = 0;
    char first[160] = "";
    double end = now_s() + seconds;
    while (now_s() < end) {
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        void *p = NULL;
        if (e == cudaSuccess) e = cudaMallocAsync(&p, 8 << 20, s);
        for (int k = 0; k < 50 && e == cudaSuccess; k++) {
            touch_kernel<<<64, 128, 0, s>>>((char *)p, 8 << 20);
            e = cudaGetLastError();
        }
        if (p != NULL) {
            cudaError_t f = cudaFreeAsync(p, s);
            if (e == cudaSuccess) e = f;
        }
        cudaError_t ended = cudaStreamEndCapture(s, &graph);
        if (e == cudaSuccess) e = ended;
        if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
        if (e == cudaSuccess) e = cudaGraphLaunch(exec, s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
        captures++;
        if (e != cudaSuccess) {
            if (!failures++) snprintf(first, sizeof first, "%s", cudaGetErrorString(e));
            cudaGetLastError();
        }
    }
    printf("captures %ld failures %ld first_error %s\n", captures, failures, first[0] ? first : "-");
}

// The current device is 0; every allocation and launch below goes to a stream of device 1.
static void two_gpu(size_t bytes) {
    CHECK(cudaSetDevice(1));
    cudaStream_t s1;
    CHECK(cudaStreamCreate(&s1));
    CHECK(cudaSetDevice(0));
    void *a = NULL, *b = NULL, *c = NULL;
    cudaError_t first = cudaMallocAsync(&a, bytes, s1);  // device 1's pool, device 1's limit
    for (int k = 0; k < 100 && first == cudaSuccess; k++) empty_kernel<<<1, 1, 0, s1>>>();
    cudaGetLastError();
    cudaError_t on0 = cudaMalloc(&b, bytes);  // device 0 still has all of its limit
    cudaError_t second = cudaMallocAsync(&c, bytes, s1);  // device 1 does not
    cudaGetLastError();
    printf("two_gpu_first_on_1 %s\n", verdict(first));
    printf("two_gpu_then_on_0 %s\n", verdict(on0));
    printf("two_gpu_second_on_1 %s\n", verdict(second));
    if (a) cudaFreeAsync(a, s1);
    if (c) cudaFreeAsync(c, s1);
    if (b) cudaFree(b);
    CHECK(cudaStreamSynchronize(s1));
}

// Compute-bound: every thread runs a dependent FMA chain; the grid fills every SM.
__global__ void fma_kernel(float *out, int iters) {
    float a = threadIdx.x * 1e-3f, c = blockIdx.x * 1e-4f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, 0.999f, c);
        c = fmaf(c, 0.999f, a);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = a + c;
}

// The quota benchmark's plain CUDA work (bench/quota_accuracy_gpu.py): kernels of about 1 ms,
// one per synchronise (`loop`) or 20 in a graph launched twice per synchronise (`graph`, the
// deep queue a graph replay leaves when the lock is dropped).
static void quota_work(const char *kind, double seconds) {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int blocks = sms * 8, threads = 256;
    float *out = NULL;
    CHECK(cudaMalloc(&out, sizeof(float) * blocks * threads));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Calibrate to about 1 ms per kernel on this GPU, timed on the GPU (events), so that
    // waiting for the lock while other clients calibrate does not count.
    int iters = 1 << 14;
    cudaEvent_t before, after;
    CHECK(cudaEventCreate(&before));
    CHECK(cudaEventCreate(&after));
    for (int round = 0; round < 3; round++) {
        CHECK(cudaEventRecord(before, s));
        fma_kernel<<<blocks, threads, 0, s>>>(out, iters);
        CHECK(cudaEventRecord(after, s));
        CHECK(cudaStreamSynchronize(s));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, before, after));
        if (round > 0) iters = (int)(iters / ms);
    }
    const int per_graph = 20, graphs_per_sync = 2;
    int is_graph = !strcmp(kind, "graph");
    cudaGraphExec_t exec = NULL;
    if (is_graph) {
        cudaGraph_t graph;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int k = 0; k < per_graph; k++) fma_kernel<<<blocks, threads, 0, s>>>(out, iters);
        CHECK(cudaStreamEndCapture(s, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaStreamSynchronize(s));
    }
    printf("ready %d\n", iters);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return;
    size_t cap = 1 << 16, n = 0;
    double *start = (double *)malloc(cap * sizeof(double));
    double *end = (double *)malloc(cap * sizeof(double));
    double stop = now_s() + seconds;
    while (now_s() < stop && n < cap) {
        start[n] = now_s();
        if (is_graph) {
            for (int g = 0; g < graphs_per_sync; g++) CHECK(cudaGraphLaunch(exec, s));
        } else {
            fma_kernel<<<blocks, threads, 0, s>>>(out, iters);
        }
        CHECK(cudaStreamSynchronize(s));
        end[n++] = now_s();
    }
    for (size_t i = 0; i < n; i++) printf("batch %.6f %.6f\n", start[i], end[i]);
    free(start);
    free(end);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s launch|malloc|free_live|alloc_paths N\n", argv[0]);
        return 2;
    }
    long n = atol(argv[2]);
    if (!strcmp(argv[1], "launch")) launch_bench(n);
    else if (!strcmp(argv[1], "malloc")) malloc_bench(n);
    else if (!strcmp(argv[1], "free_live")) free_live_bench(n);
    else if (!strcmp(argv[1], "alloc_paths")) alloc_paths((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "vmm")) vmm_check((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "pool")) pool_check((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "graph_mem")) graph_mem_check((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "graph_admit")) graph_admit((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "capture_loop")) capture_loop(atof(argv[2]));
    else if (!strcmp(argv[1], "two_gpu")) two_gpu((size_t)strtoull(argv[2], NULL, 0));
    else if (!strcmp(argv[1], "quota") && argc > 3) quota_work(argv[2], atof(argv[3]));
    else { fprintf(stderr, "unknown mode %s\n", argv[1]); return 2; }
    return 0;
}
