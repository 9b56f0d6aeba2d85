/*
 * The probe's commands for waiting on the GPU, every way a program can (tests/hook/test_busy.py):
 *   waitin NAME MS    for MS: launch a kernel, then wait for it in NAME (a synchronisation, a
 *                     synchronous copy or set, a copy to or from pageable memory, or a loop
 *                     polling a stream or event query); answers the number of rounds
 *   queuefor NAME MS  for MS: submit through NAME (a stream-ordered copy, set or wait), then
 *                     sleep through most of the work it queued, in no driver call at all
 * Both leave one more kernel running when they answer, so that the holder is still busy then.
 *   stepfor MS K      for MS: K kernels, then a blocking copy of the result to pageable host
 *                     memory (PyTorch's `loss.item()`); answers the number of steps
 * Copies and sets are found by name with dlsym, as a framework finds them, and called with
 * zeros: the fake driver moves no bytes, and a null host pointer is pageable memory.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fake.h" /* fake_queued */
#include "probe.h"

#define FN ((CUfunction)1)

typedef CUresult (*zero_args_fn)(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                 uintptr_t, uintptr_t, uintptr_t);

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static zero_args_fn by_name(const char *name)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib != NULL ? (zero_args_fn)dlsym(lib, name) : NULL;
}

static CUresult poll_until_ready(CUresult (*query)(void *), void *what)
{
    CUresult r;
    while ((r = query(what)) == CUDA_ERROR_NOT_READY) usleep(200);
    return r;
}

static CUresult query_stream(void *s) { return cuStreamQuery((CUstream)s); }
static CUresult query_stream_ptsz(void *s) { return cuStreamQuery_ptsz((CUstream)s); }
static CUresult query_event(void *e) { return cuEventQuery((CUevent)e); }

/* Waits, through `name`, for the kernel just launched on the default stream. */
static CUresult wait_in(const char *name, CUevent ev)
{
    if (strcmp(name, "cuCtxSynchronize") == 0) return cuCtxSynchronize();
    if (strcmp(name, "cuCtxSynchronize_v2") == 0) {
        CUcontext ctx = NULL;
        cuCtxGetCurrent(&ctx);
        return cuCtxSynchronize_v2(ctx);
    }
    if (strcmp(name, "cuStreamSynchronize") == 0) return cuStreamSynchronize(NULL);
    if (strcmp(name, "cuStreamSynchronize_ptsz") == 0) return cuStreamSynchronize_ptsz(NULL);
    if (strcmp(name, "cuStreamQuery") == 0) return poll_until_ready(query_stream, NULL);
    if (strcmp(name, "cuStreamQuery_ptsz") == 0) return poll_until_ready(query_stream_ptsz, NULL);
    if (strcmp(name, "cuEventSynchronize") == 0 || strcmp(name, "cuEventQuery") == 0) {
        CUresult r = cuEventRecord(ev, NULL);
        if (r) return r;
        return name[7] == 'S' ? cuEventSynchronize(ev) : poll_until_ready(query_event, ev);
    }
    zero_args_fn fn = by_name(name);
    return fn != NULL ? fn(0, 0, 0, 0, 0, 0, 0, 0, 0) : CUDA_ERROR_NOT_FOUND;
}

static CUresult wait_loop(const char *name, double ms, unsigned long long *rounds)
{
    CUevent ev = NULL;
    CUresult r = cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    for (double end = now_ms() + ms; !r && now_ms() < end; ++*rounds) {
        r = cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (!r) r = wait_in(name, ev);
    }
    if (ev != NULL) cuEventDestroy_v2(ev);
    return r ? r : cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

static CUresult queue_loop(const char *name, double ms, unsigned long long *rounds)
{
    zero_args_fn fn = by_name(name);
    if (fn == NULL) return CUDA_ERROR_NOT_FOUND;
    const char *us = getenv("NVSHARE_FAKE_LAUNCH_US");
    useconds_t nap = (useconds_t)((us != NULL ? atof(us) : 1000.0) * 0.6);
    CUresult r = CUDA_SUCCESS;
    for (double end = now_ms() + ms; !r && now_ms() < end; ++*rounds) {
        r = fn(0, 0, 0, 0, 0, 0, 0, 0, 0);
        usleep(nap); /* the GPU runs what was queued; this thread is in no driver call */
    }
    return r ? r : cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

static CUresult step_loop(double ms, unsigned long long k, unsigned long long *steps)
{
    float loss = 0;
    CUresult r = CUDA_SUCCESS;
    for (double end = now_ms() + ms; !r && now_ms() < end; ++*steps) {
        for (unsigned long long i = 0; i < k && !r; i++)
            r = cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (!r) r = cuMemcpyDtoHAsync_v2(&loss, 0, sizeof loss, NULL);
        if (!r) r = cuStreamSynchronize(NULL);
    }
    return r;
}

/* n launches on the default stream, none waited for: the most the GPU had queued after one. */
static CUresult queue_depth(unsigned long long n, unsigned long long *most)
{
    CUresult r = CUDA_SUCCESS;
    for (unsigned long long i = 0; i < n && !r; i++) {
        r = cuLaunchKernel(FN, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        unsigned long long queued = fake_queued();
        if (queued > *most) *most = queued;
    }
    return r ? r : cuCtxSynchronize();
}

int probe_wait_case(const char *cmd, const char *args)
{
    char name[64] = "";
    unsigned long long n = 0, k = 0;
    CUresult r;
    if (strcmp(cmd, "waitin") == 0 || strcmp(cmd, "queuefor") == 0) {
        sscanf(args, "%63s %llu", name, &n);
        r = cmd[0] == 'w' ? wait_loop(name, (double)n, &k) : queue_loop(name, (double)n, &k);
    } else if (strcmp(cmd, "queuedepth") == 0) { /* queuedepth N -> the most queued */
        sscanf(args, "%llu", &n);
        r = queue_depth(n, &k);
    } else if (strcmp(cmd, "stepfor") == 0) {
        sscanf(args, "%llu %llu", &n, &k);
        unsigned long long steps = 0;
        r = step_loop((double)n, k ? k : 1, &steps);
        k = steps;
    } else {
        return 0;
    }
    reply(r, "ok %llu\n", k);
    return 1;
}
