/*
 * The test program the pytest suite drives: a CUDA "application" linked against libcuda.so.1
 * (the fake one in tests), run with libnvshare.so preloaded. `probe symbols` reports which library
 * answers dlsym and cuGetProcAddress_v2; `probe run [--gpa]` reads one command per line on stdin and
 * answers one line per command, so a test can allocate, launch and query step by step.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cuda_api.h"
#include "probe.h"

struct api {
    __typeof__(&cuInit) init;
    __typeof__(&cuDevicePrimaryCtxRetain) retain;
    __typeof__(&cuCtxSetCurrent) set_current;
    __typeof__(&cuCtxSynchronize) sync;
    __typeof__(&cuLaunchKernel) launch;
    __typeof__(&cuMemcpyHtoD_v2) htod;
    __typeof__(&cuMemAlloc_v2) alloc;
    __typeof__(&cuMemAllocPitch_v2) pitch;
    __typeof__(&cuMemAllocManaged) managed;
    __typeof__(&cuMemAllocAsync) async;
    __typeof__(&cuMemAllocFromPoolAsync) pool;
    __typeof__(&cuMemCreate) create;
    __typeof__(&cuMemRelease) release;
    __typeof__(&cuArrayCreate_v2) array;
    __typeof__(&cuArray3DCreate_v2) array3d;
    __typeof__(&cuMipmappedArrayCreate) mipmap;
    __typeof__(&cuArrayDestroy) array_destroy;
    __typeof__(&cuMipmappedArrayDestroy) mipmap_destroy;
    __typeof__(&cuMemFree_v2) free;
    __typeof__(&cuMemFreeAsync) free_async;
    __typeof__(&cuMemGetInfo_v2) info;
    __typeof__(&cuDeviceTotalMem_v2) total;
    __typeof__(&cuMemHostAlloc) host_alloc;
};

static struct api direct(void)
{
    return (struct api){cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuCtxSynchronize,
                        cuLaunchKernel, cuMemcpyHtoD_v2, cuMemAlloc_v2, cuMemAllocPitch_v2,
                        cuMemAllocManaged, cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemCreate,
                        cuMemRelease, cuArrayCreate_v2, cuArray3DCreate_v2, cuMipmappedArrayCreate,
                        cuArrayDestroy, cuMipmappedArrayDestroy, cuMemFree_v2, cuMemFreeAsync,
                        cuMemGetInfo_v2, cuDeviceTotalMem_v2, cuMemHostAlloc};
}

/* Like a CUDA 13 runtime: every entry point through cuGetProcAddress_v2, found with dlsym. */
static struct api via_proc_address(cuuint64_t flags)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    __typeof__(&cuGetProcAddress_v2) gpa =
        lib ? (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2") : NULL;
    if (gpa == NULL) {
        fprintf(stderr, "probe: no cuGetProcAddress_v2\n");
        exit(3);
    }
    struct api a;
    void **slots = (void **)&a;
    static const char *const names[] = {
        "cuInit", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuCtxSynchronize",
        "cuLaunchKernel", "cuMemcpyHtoD", "cuMemAlloc", "cuMemAllocPitch", "cuMemAllocManaged",
        "cuMemAllocAsync", "cuMemAllocFromPoolAsync", "cuMemCreate", "cuMemRelease",
        "cuArrayCreate", "cuArray3DCreate", "cuMipmappedArrayCreate", "cuArrayDestroy",
        "cuMipmappedArrayDestroy", "cuMemFree", "cuMemFreeAsync", "cuMemGetInfo",
        "cuDeviceTotalMem", "cuMemHostAlloc"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (gpa(names[i], &slots[i], 13000, flags, NULL) != CUDA_SUCCESS) {
            fprintf(stderr, "probe: cuGetProcAddress_v2(%s) failed\n", names[i]);
            exit(3);
        }
    return a;
}

static const char *owner(void *fn)
{
    Dl_info info;
    if (fn == NULL) return "NULL";
    if (dladdr(fn, &info) == 0 || info.dli_fname == NULL) return "unknown";
    return basename((char *)info.dli_fname);
}

static int symbols(void)
{
    static const char *const names[] = {
        "cuInit", "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuMemAlloc_v2", "cuMemcpyHtoD_v2",
        "cuMemcpyHtoD_v2_ptds", "cuMemsetD8Async_ptsz", "cuGraphLaunch", "cuMemGetInfo_v2",
        "cuGetProcAddress_v2", "cuCtxGetDevice", "cuDeviceGetCount", "cuStreamCreate",
        "cuMemHostAlloc", "cuGraphInstantiate_v2", "cuGraphInstantiateWithParams_ptsz"};
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return 2;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        printf("dlsym %s %s\n", names[i], owner(dlsym(lib, names[i])));
    __typeof__(&cuGetProcAddress_v2) gpa =
        (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2");
    static const char *const bases[] = {"cuInit", "cuLaunchKernel", "cuMemAlloc", "cuMemcpyHtoD",
                                        "cuMemsetD8Async", "cuGraphLaunch", "cuMemGetInfo",
                                        "cuGetProcAddress", "cuCtxGetDevice", "cuStreamCreate",
                                        "cuMemFreeAsync", "cuCtxCreate", "cuGraphInstantiate"};
    static const cuuint64_t flag_sets[] = {CU_GET_PROC_ADDRESS_DEFAULT,
                                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    for (size_t f = 0; f < 2; f++)
        for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
            void *fn = NULL;
            CUresult r = gpa(bases[i], &fn, 13000, flag_sets[f], NULL);
            Dl_info info;
            const char *sym = (r == CUDA_SUCCESS && dladdr(fn, &info) && info.dli_sname)
                                  ? info.dli_sname
                                  : "-";
            printf("gpa %s %llu %s %s\n", bases[i], (unsigned long long)flag_sets[f], owner(fn), sym);
        }
    return 0;
}

/* ---- the interpreter ---- */

struct handle *handles;
size_t nhandles;
static size_t caphandles;

size_t keep(char kind, uint64_t value, uint64_t aux)
{
    if (nhandles == caphandles) {
        caphandles = caphandles ? caphandles * 2 : 1024;
        handles = realloc(handles, caphandles * sizeof *handles);
    }
    handles[nhandles] = (struct handle){kind, value, aux};
    return nhandles++;
}

int handle_of(unsigned long long id, char kind, uint64_t *value)
{
    if (id >= nhandles || handles[id].kind != kind) return 0;
    *value = handles[id].value;
    return 1;
}

static CUresult release(struct api *a, size_t id)
{
    if (id >= nhandles || handles[id].kind == 0) return CUDA_ERROR_INVALID_VALUE;
    struct handle h = handles[id];
    handles[id].kind = 0;
    switch (h.kind) {
    case 'p': return a->free((CUdeviceptr)h.value);
    case 'q': return a->free_async((CUdeviceptr)h.value, NULL);
    case 'v': return a->release(h.value);
    case 'a': return a->array_destroy((CUarray)(uintptr_t)h.value);
    default: return a->mipmap_destroy((CUmipmappedArray)(uintptr_t)h.value);
    }
}

static CUresult alloc(struct api *a, char *args, size_t *id)
{
    char kind[32];
    unsigned long long x[6] = {0};
    int n = sscanf(args, "%31s %llu %llu %llu %llu %llu %llu", kind, &x[0], &x[1], &x[2], &x[3],
                   &x[4], &x[5]);
    if (n < 2) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p = 0;
    CUresult r;
    if (strcmp(kind, "mem") == 0) {
        r = a->alloc(&p, x[0]);
        if (!r) *id = keep('p', p, 0);
    } else if (strcmp(kind, "pitch") == 0) {
        size_t pitch;
        r = a->pitch(&p, &pitch, x[0], x[1], 4);
        if (!r) *id = keep('p', p, 0);
    } else if (strcmp(kind, "managed") == 0) {
        r = a->managed(&p, x[0], CU_MEM_ATTACH_GLOBAL);
        if (!r) *id = keep('p', p, 0);
    } else if (strcmp(kind, "async") == 0) {
        r = a->async(&p, x[0], NULL);
        if (!r) *id = keep('q', p, 0);
    } else if (strcmp(kind, "pool") == 0) {
        CUmemoryPool pool = NULL;
        r = cuDeviceGetMemPool(&pool, 0);
        if (!r) r = a->pool(&p, x[0], pool, NULL);
        if (!r) *id = keep('q', p, 0);
    } else if (strcmp(kind, "vmm") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        CUmemGenericAllocationHandle h = 0;
        r = a->create(&h, x[0], &prop, 0);
        if (!r) *id = keep('v', h, x[0]);
    } else if (strcmp(kind, "array") == 0) {
        CUDA_ARRAY_DESCRIPTOR d = {x[0], x[1], (unsigned)x[2], (unsigned)x[3]};
        CUarray arr;
        r = a->array(&arr, &d);
        if (!r) *id = keep('a', (uint64_t)(uintptr_t)arr, 0);
    } else if (strcmp(kind, "array3d") == 0 || strcmp(kind, "mipmap") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR d = {x[0], x[1], x[2], (unsigned)x[3], (unsigned)x[4], 0};
        if (kind[0] == 'a') {
            CUarray arr;
            r = a->array3d(&arr, &d);
            if (!r) *id = keep('a', (uint64_t)(uintptr_t)arr, 0);
        } else {
            CUmipmappedArray arr;
            r = a->mipmap(&arr, &d, (unsigned)x[5]);
            if (!r) *id = keep('m', (uint64_t)(uintptr_t)arr, 0);
        }
    } else if (strcmp(kind, "host") == 0) {
        void *h;
        r = a->host_alloc(&h, x[0], 0);
        *id = 0;
    } else {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    return r;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static CUresult start(struct api *a, int device)
{
    CUcontext ctx;
    CUresult r = a->init(0);
    if (!r) r = a->retain(&ctx, device);
    if (!r) r = a->set_current(ctx);
    return r;
}

void reply(CUresult r, const char *fmt, unsigned long long v)
{
    if (r != CUDA_SUCCESS)
        printf("err %d\n", r);
    else
        printf(fmt, v);
    fflush(stdout);
}

static int run(struct api *a)
{
    char line[512];
    while (fgets(line, sizeof line, stdin) != NULL) {
        char cmd[32] = "";
        unsigned long long n = 0, m = 0;
        sscanf(line, "%31s %llu %llu", cmd, &n, &m);
        CUresult r = CUDA_SUCCESS;
        if (strcmp(cmd, "init") == 0) {
            reply(start(a, (int)n), "ok\n", 0); /* init [device] */
        } else if (strcmp(cmd, "alloc") == 0) {
            size_t id = 0;
            r = alloc(a, line + 6, &id);
            reply(r, "ok %llu\n", id);
        } else if (strcmp(cmd, "free") == 0) {
            reply(release(a, n), "ok\n", 0);
        } else if (strcmp(cmd, "info") == 0) {
            size_t fr = 0, tot = 0;
            r = a->info(&fr, &tot);
            if (r) reply(r, "", 0);
            else printf("ok %zu %zu\n", fr, tot), fflush(stdout);
        } else if (strcmp(cmd, "total") == 0) {
            size_t tot = 0;
            r = a->total(&tot, 0);
            reply(r, "ok %llu\n", tot);
        } else if (strcmp(cmd, "launch") == 0) {
            for (unsigned long long i = 0; i < n && !r; i++)
                r = a->launch((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            if (!r) r = a->sync();
            reply(r, "ok\n", 0);
        } else if (strcmp(cmd, "launchfor") == 0) {
            /* launch and synchronise in batches of m (default 1) for n milliseconds */
            double end = now_ms() + (double)n;
            unsigned long long count = 0;
            while (now_ms() < end && !r) {
                for (unsigned long long i = 0; i < (m ? m : 1) && !r; i++, count++)
                    r = a->launch((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                if (!r) r = a->sync();
            }
            reply(r, "ok %llu\n", count);
        } else if (strcmp(cmd, "eventfor") == 0 || strcmp(cmd, "copyfor") == 0) {
            /* launchfor, each launch waited for by an event (as PyTorch's stream waits) or by a
             * blocking copy (as .item() or .cpu()) instead of a synchronise */
            int event = strcmp(cmd, "eventfor") == 0;
            char host[16];
            CUevent ev = NULL;
            if (event) r = cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
            unsigned long long count = 0;
            for (double end = now_ms() + (double)n; now_ms() < end && !r; count++) {
                r = a->launch((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                if (!r && event) r = cuEventRecord(ev, NULL);
                if (!r) r = event ? cuEventSynchronize(ev) : a->htod(0, host, sizeof host);
            }
            if (ev != NULL) cuEventDestroy_v2(ev);
            reply(r, "ok %llu\n", count);
        } else if (strcmp(cmd, "copy") == 0) {
            char host[16];
            r = a->htod(0, host, sizeof host);
            reply(r, "ok\n", 0);
        } else if (strcmp(cmd, "many") == 0) {
            /* n live allocations of m bytes, then free them all (in allocation order) */
            size_t first = nhandles;
            for (unsigned long long i = 0; i < n && !r; i++) {
                size_t id;
                char args[64];
                snprintf(args, sizeof args, "mem %llu", m);
                r = alloc(a, args, &id);
            }
            for (size_t id = first; id < nhandles && !r; id++) r = release(a, id);
            reply(r, "ok\n", 0);
        } else if (strcmp(cmd, "sleep") == 0) {
            usleep((useconds_t)(n * 1000));
            reply(0, "ok\n", 0);
        } else if (strcmp(cmd, "fork") == 0) {
            /* n = 0: the child does no CUDA; n = 1: the child initialises CUDA and launches */
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                if (n == 1 && (start(a, 0) || a->launch((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) || a->sync()))
                    _exit(1);
                _exit(0);
            }
            int status = 0;
            waitpid(pid, &status, 0);
            reply(0, "ok %llu\n", WIFEXITED(status) ? (unsigned long long)WEXITSTATUS(status) : 255);
        } else if (strcmp(cmd, "nvml") == 0) {
            void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
            nvmlReturn_t (*init)(void) = lib ? (nvmlReturn_t(*)(void))dlsym(lib, "nvmlInit_v2") : NULL;
            nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) =
                lib ? (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2") : NULL;
            __typeof__(&nvmlDeviceGetMemoryInfo) mem =
                lib ? (__typeof__(&nvmlDeviceGetMemoryInfo))dlsym(lib, "nvmlDeviceGetMemoryInfo") : NULL;
            nvmlDevice_t d;
            nvmlMemory_t m2;
            if (!init || !by_index || !mem || init() || by_index(0, &d) || mem(d, &m2))
                reply(CUDA_ERROR_UNKNOWN, "", 0);
            else
                printf("ok %llu %llu %llu\n", m2.free, m2.total, m2.used), fflush(stdout);
        } else if (strcmp(cmd, "quit") == 0) {
            return 0;
        } else if (probe_case(cmd, line + strlen(cmd))) {
            continue;
        } else {
            reply(CUDA_ERROR_INVALID_VALUE, "", 0);
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && strcmp(argv[1], "symbols") == 0) return symbols();
    if (argc >= 2 && strcmp(argv[1], "no-cuinit") == 0) {
        /* resolves driver symbols, never initialises CUDA: the hook must stay asleep */
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        void *fn = lib ? dlsym(lib, "cuLaunchKernel") : NULL;
        size_t fr, tot;
        CUresult r = cuMemGetInfo_v2(&fr, &tot); /* fails: not initialised */
        printf("ok %d %d\n", fn != NULL, r);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "run") == 0) {
        struct api a = direct();
        if (argc >= 3 && strcmp(argv[2], "--gpa") == 0) a = via_proc_address(0);
        if (argc >= 3 && strcmp(argv[2], "--gpa-ptds") == 0)
            a = via_proc_address(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
        return run(&a);
    }
    fprintf(stderr, "usage: probe symbols | no-cuinit | run [--gpa|--gpa-ptds]\n");
    return 2;
}
