/*
 * Per-call cost of a gated kernel launch while the lock is held: the same loop of cuLaunchKernel
 * calls against the fake driver (NVSHARE_FAKE_LAUNCH_US=0, so the driver side is a few
 * nanoseconds), run with and without libnvshare.so preloaded. bench/hook_fastpath.sh runs both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_api.h"

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    long calls = argc > 1 ? atol(argv[1]) : 20000000L;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    CUcontext ctx;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx)) return 1;
    /* the first launch takes the lock (a round trip); the loop measures the held-lock path */
    if (cuLaunchKernel((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) || cuCtxSynchronize())
        return 1;
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        double t0 = now_ns();
        for (long i = 0; i < calls; i++)
            cuLaunchKernel((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        double per = (now_ns() - t0) / (double)calls;
        if (per < best) best = per;
    }
    cuCtxSynchronize();
    printf("%.2f ns per cuLaunchKernel (best of %d rounds of %ld calls)\n", best, rounds, calls);
    return 0;
}
