/*
 * Contexts and streams: every context the process used, by device (the drain at a lock release
 * synchronises all of them: plain, primary, green, however many), and which GPU a submission goes
 * to (the device of its stream; the calling thread's current context for the default streams).
 */
#ifndef NVSHARE_CONTEXTS_H
#define NVSHARE_CONTEXTS_H

#include "gpus.h"

enum nvs_ctx_kind { NVS_CTX_PLAIN = 0, NVS_CTX_PRIMARY, NVS_CTX_GREEN };

extern NVS_TLS int nvs_tls_dev; /* the calling thread's current device, -1 unknown */

void nvs_ctx_note(CUcontext ctx, int dev, enum nvs_ctx_kind kind);
void nvs_ctx_forget(CUcontext ctx);
int nvs_ctx_device(CUcontext ctx); /* -1 when the driver does not know it */
CUcontext nvs_ctx_current(void);
CUcontext nvs_ctx_primary(int dev); /* the primary context noted for dev, NULL if none */
/* Waits for the work queued in every context of g (never call it on a capturing GPU). */
void nvs_ctx_sync_gpu(const struct nvs_gpu *g);

/* The thread's current context changed: forget the cached device. */
static inline void nvs_thread_ctx_changed(void) { nvs_tls_dev = -1; }
struct nvs_gpu *nvs_thread_gpu(void);
struct nvs_gpu *nvs_stream_gpu(CUstream s);
void nvs_streams_changed(void); /* a stream or context went away: drop cached stream devices */
void nvs_contexts_after_fork(void);

/* The GPU a submission on stream s goes to; no lookup at all in a one-GPU process. */
static inline struct nvs_gpu *nvs_submit_gpu(CUstream s)
{
    struct nvs_gpu *g = atomic_load_explicit(&nvs_single_gpu, memory_order_relaxed);
    return NVS_LIKELY(g != NULL) ? g : nvs_stream_gpu(s);
}

#endif
