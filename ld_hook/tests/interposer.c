/*
 * A second interposer, preloaded after libnvshare.so the way tracing tools and other sharing
 * hooks are: it wraps cuLaunchKernel and finds the next definition with dlsym(RTLD_NEXT), which
 * must be the driver's, not its own (that would recurse forever). It counts the launches it
 * passed on and prints the count at exit.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "../cuda_api.h"

static atomic_long calls;

static CUresult wrapped_launch(NVS_LAUNCH_ARGS)
{
    static _Atomic(__typeof__(&cuLaunchKernel)) next;
    __typeof__(&cuLaunchKernel) fn = atomic_load(&next);
    if (fn == NULL) {
        fn = (__typeof__(&cuLaunchKernel))dlsym(RTLD_NEXT, "cuLaunchKernel");
        if (fn == wrapped_launch) {
            fprintf(stderr, "interposer: dlsym(RTLD_NEXT) answered with myself\n");
            abort();
        }
        atomic_store(&next, fn);
    }
    atomic_fetch_add(&calls, 1);
    return fn(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

__attribute__((visibility("default"), alias("wrapped_launch"))) CUresult cuLaunchKernel(NVS_LAUNCH_ARGS);

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "interposer: passed on %ld launches\n", atomic_load(&calls));
}
