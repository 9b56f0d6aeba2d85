/*
 * Stream captures (see capture.h): every capture begun through the hook is listed with its GPU
 * until it ends. Begin-capture waits while a release synchronises that GPU; the wait is bounded by
 * the work already queued there.
 */
#include <stdlib.h>

#include "capture.h"
#include "contexts.h"
#include "dispatch.h"
#include "log.h"

struct capturing {
    CUstream s;
    int gpu;
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int active[NVS_MAX_GPUS];
    int fenced[NVS_MAX_GPUS];
    struct capturing *list;
    int n, cap;
} cap = {.mu = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t cv_once = PTHREAD_ONCE_INIT;

static void init_cv(void)
{
    nvs_cond_init(&cap.cv);
}

/* Lists s as capturing on its GPU. 1 when newly listed; 0 when already listed or not a GPU. */
static int enter(CUstream s)
{
    pthread_once(&cv_once, init_cv);
    struct nvs_gpu *g = nvs_stream_gpu(s);
    if (g == NULL) return 0;
    nvs_mutex_lock(&cap.mu);
    for (int i = 0; i < cap.n; i++)
        if (cap.list[i].s == s) {
            nvs_mutex_unlock(&cap.mu);
            return 0;
        }
    while (cap.fenced[g->index]) pthread_cond_wait(&cap.cv, &cap.mu);
    if (cap.n == cap.cap) {
        int size = cap.cap ? cap.cap * 2 : 8;
        struct capturing *list = realloc(cap.list, (size_t)size * sizeof *list);
        if (list == NULL) {
            nvs_mutex_unlock(&cap.mu);
            return 0;
        }
        cap.list = list;
        cap.cap = size;
    }
    cap.list[cap.n++] = (struct capturing){.s = s, .gpu = g->index};
    cap.active[g->index]++;
    nvs_mutex_unlock(&cap.mu);
    return 1;
}

static void leave(CUstream s)
{
    pthread_once(&cv_once, init_cv);
    nvs_mutex_lock(&cap.mu);
    for (int i = 0; i < cap.n; i++)
        if (cap.list[i].s == s) {
            cap.active[cap.list[i].gpu]--;
            cap.list[i] = cap.list[--cap.n];
            pthread_cond_broadcast(&cap.cv);
            break;
        }
    nvs_mutex_unlock(&cap.mu);
}

#define NVS_BEGIN(name, params, args)                            \
    NVS_EXPORT CUresult name params                              \
    {                                                            \
        int listed = enter(s);                                   \
        CUresult r = NVS_CALL(name, args);                       \
        if (r != CUDA_SUCCESS && listed) leave(s);               \
        return r;                                                \
    }
NVS_BEGIN(cuStreamBeginCapture_v2, (CUstream s, CUstreamCaptureMode mode), (s, mode))
NVS_BEGIN(cuStreamBeginCapture_v2_ptsz, (CUstream s, CUstreamCaptureMode mode), (s, mode))
NVS_BEGIN(cuStreamBeginCaptureToGraph,
          (CUstream s, CUgraph graph, const CUgraphNode *deps, const CUgraphEdgeData *edges,
           size_t n, CUstreamCaptureMode mode),
          (s, graph, deps, edges, n, mode))
NVS_BEGIN(cuStreamBeginCaptureToGraph_ptsz,
          (CUstream s, CUgraph graph, const CUgraphNode *deps, const CUgraphEdgeData *edges,
           size_t n, CUstreamCaptureMode mode),
          (s, graph, deps, edges, n, mode))

NVS_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph)
{
    CUresult r = NVS_CALL(cuStreamEndCapture, (s, graph));
    leave(s);
    return r;
}

NVS_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *graph)
{
    CUresult r = NVS_CALL(cuStreamEndCapture_ptsz, (s, graph));
    leave(s);
    return r;
}

int nvs_capture_active(const struct nvs_gpu *g)
{
    nvs_mutex_lock(&cap.mu);
    int n = cap.active[g->index];
    nvs_mutex_unlock(&cap.mu);
    return n;
}

int nvs_capture_wait_idle(const struct nvs_gpu *g, uint64_t deadline_ns)
{
    pthread_once(&cv_once, init_cv);
    struct timespec ts = nvs_deadline_at(deadline_ns);
    nvs_mutex_lock(&cap.mu);
    while (cap.active[g->index] > 0)
        if (pthread_cond_timedwait(&cap.cv, &cap.mu, &ts) != 0) break;
    int n = cap.active[g->index];
    nvs_mutex_unlock(&cap.mu);
    return n;
}

int nvs_capture_fence(const struct nvs_gpu *g)
{
    nvs_mutex_lock(&cap.mu);
    int n = cap.active[g->index];
    if (n == 0) cap.fenced[g->index]++; /* (the drainer and a paced launch may both fence) */
    nvs_mutex_unlock(&cap.mu);
    return n;
}

void nvs_capture_unfence(const struct nvs_gpu *g)
{
    pthread_once(&cv_once, init_cv);
    nvs_mutex_lock(&cap.mu);
    cap.fenced[g->index]--;
    pthread_cond_broadcast(&cap.cv);
    nvs_mutex_unlock(&cap.mu);
}

int nvs_stream_capturing(CUstream s)
{
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (NVS_CALL(cuStreamIsCapturing, (s, &status)) != CUDA_SUCCESS) return 0;
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void nvs_capture_relax_thread(void)
{
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    NVS_CALL(cuThreadExchangeStreamCaptureMode, (&mode));
}

void nvs_capture_after_fork(void)
{
    pthread_mutex_init(&cap.mu, NULL);
    init_cv();
    for (int i = 0; i < NVS_MAX_GPUS; i++) cap.active[i] = cap.fenced[i] = 0;
    cap.n = 0;
}
