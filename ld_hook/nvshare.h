/*
 * What every translation unit of the hook shares: the export and branch-hint macros, the TLS model
 * of the hot path, and the monotonic clock. Each concern has its own header (log.h, config.h,
 * dispatch.h, gpus.h, allocmap.h, contexts.h, capture.h, conn.h, gate.h, ledger.h, graphs.h, pools.h,
 * alloc.h, session.h); a module includes only the headers of the layers below it (the order is
 * checked by tests/hook/test_structure.py). Only the interposed driver symbols and dlsym are
 * exported (libnvshare.map.in); everything else is hidden (-fvisibility=hidden).
 */
#ifndef NVSHARE_H
#define NVSHARE_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "cuda_api.h"
#include "nvshare_proto.h"

#define NVS_EXPORT __attribute__((visibility("default")))
#define NVS_LIKELY(x) __builtin_expect(!!(x), 1)
#define NVS_UNLIKELY(x) __builtin_expect(!!(x), 0)
/* Only pointer-sized hot-path variables use initial-exec TLS: static TLS space is scarce. */
#define NVS_TLS __thread __attribute__((tls_model("initial-exec")))

static inline uint64_t nvs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Time from `then` to `now`; 0 when `then` was taken after `now` (another thread's clock read). */
static inline uint64_t nvs_elapsed(uint64_t now, uint64_t then) { return now > then ? now - then : 0; }

/* An absolute CLOCK_MONOTONIC time (nvs_now_ns) as a deadline for pthread_cond_timedwait. */
static inline struct timespec nvs_deadline_at(uint64_t ns)
{
    return (struct timespec){.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
}

/* The deadline `ms` milliseconds from now. */
static inline struct timespec nvs_deadline_ms(uint64_t ms) { return nvs_deadline_at(nvs_now_ns() + ms * 1000000ull); }

/* A condition variable whose timed waits take nvs_deadline_ms deadlines (CLOCK_MONOTONIC). */
static inline void nvs_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

#endif /* NVSHARE_H */
