// CUDA C checks and micro-benchmarks run under libnvshare.so on a real GPU (tests/gpu/run.sh).
//   programs launch N            per-launch time of an empty kernel (launch-bound loop)
//   programs malloc N            2 MiB cudaMalloc/cudaFree pairs, per pair
//   programs free_live N         cudaFree cost with N live allocations
//   programs alloc_paths BYTES   try cudaMallocAsync, an explicit pool and cudaMallocArray
//                                of BYTES each; prints "path ok|oom|error(<name>)"
#include <cuda_runtime.h>
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

static void alloc_paths(size_t bytes) {
    CHECK(cudaFree(0));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e == cudaSuccess) { CHECK(cudaFreeAsync(p, s)); CHECK(cudaStreamSynchronize(s)); }
    cudaGetLastError();
    printf("cudaMallocAsync %zu %s\n", bytes, verdict(e));

    cudaMemPool_t pool;
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    CHECK(cudaMemPoolCreate(&pool, &props));
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
    else { fprintf(stderr, "unknown mode %s\n", argv[1]); return 2; }
    return 0;
}
