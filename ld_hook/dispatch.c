/*
 * The dispatch table: every interposed name, its hook and the slot holding the real function.
 * Programs reach driver functions three ways, and all three answer from this one table:
 *   - symbol interposition (the program links libcuda.so.1; LD_PRELOAD puts our exports first),
 *   - dlsym (interposed here; the real dlsym comes from dlvsym),
 *   - cuGetProcAddress / cuGetProcAddress_v2 (CUDA 12+ runtimes resolve everything this way).
 * Names not in the table pass through untouched. dlsym(RTLD_NEXT, ...) is answered relative to
 * its caller, exactly as glibc would without us (see the trampoline below), so another
 * interposer loaded after libnvshare.so reaches the driver and not itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "config.h"
#include "dispatch.h"

_Atomic(void *) nvs_slots[NVS_H_COUNT];

static const char *const hook_names[NVS_H_COUNT] = {
#define NVS_CU(n) #n,
#define NVS_NVML(n) #n,
#define NVS_DRV(n) #n,
#define NVS_NVML_DRV(n) #n,
#include "hooks.def"
#undef NVS_CU
#undef NVS_NVML
#undef NVS_DRV
#undef NVS_NVML_DRV
};

static const unsigned char hook_is_nvml[NVS_H_COUNT] = {
#define NVS_CU(n) 0,
#define NVS_NVML(n) 1,
#define NVS_DRV(n) 0,
#define NVS_NVML_DRV(n) 1,
#include "hooks.def"
#undef NVS_CU
#undef NVS_NVML
#undef NVS_DRV
#undef NVS_NVML_DRV
};

/* Our function for an interposed id; NULL for functions we only call. */
static void *hook_fn(int id)
{
    static void *const fns[NVS_H_COUNT] = {
#define NVS_CU(n) (void *)&n,
#define NVS_NVML(n) (void *)&n,
#define NVS_DRV(n) NULL,
#define NVS_NVML_DRV(n) NULL,
#include "hooks.def"
#undef NVS_CU
#undef NVS_NVML
#undef NVS_DRV
#undef NVS_NVML_DRV
    };
    return fns[id];
}

int nvs_not_found(int id)
{
    return hook_is_nvml[id] ? 13 /* NVML_ERROR_FUNCTION_NOT_FOUND */ : CUDA_ERROR_NOT_FOUND;
}

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) real_dlsym_p;

/*
 * Sanitizer runtimes resolve their interceptors with dlsym before they are initialised, so the
 * dlsym path must not be instrumented (no effect on the shipped build).
 */
#define NVS_UNINSTRUMENTED __attribute__((no_sanitize("address", "thread", "undefined")))

/* glibc 2.34 moved dlsym into libc with a new version; older ones only have the first one. */
NVS_UNINSTRUMENTED static dlsym_fn real_dlsym(void)
{
    dlsym_fn f = atomic_load_explicit(&real_dlsym_p, memory_order_acquire);
    if (f != NULL) return f;
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && f == NULL; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym_p, f, memory_order_release);
    return f;
}

static _Atomic(void *) lib_handles[2];

static void *library(int nvml)
{
    void *h = atomic_load_explicit(&lib_handles[nvml], memory_order_acquire);
    if (h == NULL) {
        h = dlopen(nvml ? "libnvidia-ml.so.1" : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h != NULL) atomic_store_explicit(&lib_handles[nvml], h, memory_order_release);
    }
    return h;
}

/* Find the real function: first in the global scope after us, else in the library itself. */
void *nvs_resolve(int id)
{
    dlsym_fn ds = real_dlsym();
    void *lib = library(hook_is_nvml[id]);
    if (ds == NULL) return NULL;
    void *p = ds(RTLD_NEXT, hook_names[id]);
    if ((p == NULL || p == hook_fn(id)) && lib != NULL) p = ds(lib, hook_names[id]);
    if (p == hook_fn(id)) p = NULL;
    if (p != NULL) {
        void *expected = NULL;
        if (!atomic_compare_exchange_strong(&nvs_slots[id], &expected, p)) p = expected;
    }
    return p;
}

static int lookup(const char *name)
{
    for (int i = 0; i < NVS_H_COUNT; i++)
        if (hook_fn(i) != NULL && strcmp(hook_names[i], name) == 0) return i;
    return -1;
}

static int ends_with(const char *s, size_t len, const char *suffix)
{
    size_t n = strlen(suffix);
    return len >= n && memcmp(s + len - n, suffix, n) == 0;
}

static int is_per_thread(const char *name)
{
    size_t len = strlen(name);
    return ends_with(name, len, "_ptds") || ends_with(name, len, "_ptsz");
}

/* Length of the name without its _ptds/_ptsz and _vN suffixes: the name cuGetProcAddress asks for. */
static size_t base_len(const char *name)
{
    size_t len = strlen(name);
    if (ends_with(name, len, "_ptds") || ends_with(name, len, "_ptsz")) len -= 5;
    if (len > 3 && name[len - 3] == '_' && name[len - 2] == 'v' && name[len - 1] >= '2' &&
        name[len - 1] <= '9')
        len -= 3;
    return len;
}

/*
 * The CUDA version from which cuGetProcAddress(base) means this versioned name (cuda.h's
 * #defines). Only a fallback: an answer is matched by the driver's own pointer first.
 */
static int since_version(const char *name)
{
    static const struct {
        const char *name;
        int version;
    } exceptions[] = {
        {"cuCtxCreate_v3", 11040},          {"cuCtxCreate_v4", 12050},
        {"cuCtxDestroy_v2", 4000},          {"cuCtxPushCurrent_v2", 4000},
        {"cuCtxPopCurrent_v2", 4000},       {"cuGetProcAddress_v2", 12000},
        {"cuStreamDestroy_v2", 4000},       {"cuDevicePrimaryCtxRelease_v2", 11000},
        {"cuDevicePrimaryCtxReset_v2", 11000}, {"cuStreamBeginCapture_v2", 10010},
        {"cuStreamWaitValue32_v2", 11070},  {"cuStreamWaitValue64_v2", 11070},
        {"cuStreamWriteValue32_v2", 11070}, {"cuStreamWriteValue64_v2", 11070},
        {"cuStreamBatchMemOp_v2", 11070},   {"cuMemPrefetchAsync_v2", 13000},
        {"cuMemcpyBatchAsync_v2", 13000},   {"cuMemcpy3DBatchAsync_v2", 13000},
        {"cuLaunchHostFunc_v2", 13020},     {"cuGraphInstantiate_v2", 11000},
    };
    size_t len = strlen(name);
    if (is_per_thread(name)) len -= 5;
    int since = -1;
    for (size_t i = 0; i < sizeof exceptions / sizeof exceptions[0]; i++)
        if (strlen(exceptions[i].name) == len && memcmp(exceptions[i].name, name, len) == 0)
            since = exceptions[i].version;
    if (since < 0) since = memmem(name, len, "_v2", 3) != NULL ? 3020 : 0;
    return is_per_thread(name) && since < 7000 ? 7000 : since;
}

/*
 * Which of our hooks answers cuGetProcAddress(symbol, version, flags) that the driver answered with
 * `real`. Preferred: the entry whose real function is that very pointer. Otherwise the cuda.h rules:
 * the per-thread variant when asked for, and the newest version not newer than `version`. Returns -1
 * when none applies (e.g. a v1 entry point we do not interpose), and the driver's answer stands.
 */
static int pick_for_proc_address(const char *symbol, void *real, int version, cuuint64_t flags)
{
    /* From CUDA 12.0, cuda.h maps cuGraphInstantiate to cuGraphInstantiateWithFlags (another
     * signature): the driver's answer is that function, never our cuGraphInstantiate_v2. */
    if (version >= 12000 && strcmp(symbol, "cuGraphInstantiate") == 0) {
        int id = lookup("cuGraphInstantiateWithFlags");
        void *expected = NULL;
        atomic_compare_exchange_strong(&nvs_slots[id], &expected, real);
        return id;
    }
    size_t slen = strlen(symbol);
    int candidates[NVS_H_COUNT], n = 0;
    for (int i = 0; i < NVS_H_COUNT; i++) {
        const char *name = hook_names[i];
        if (hook_fn(i) == NULL) continue;
        if (strcmp(name, symbol) == 0 || (base_len(name) == slen && memcmp(name, symbol, slen) == 0))
            candidates[n++] = i;
    }
    for (int k = 0; k < n; k++)
        if (nvs_real(candidates[k]) == real) return candidates[k];
    int want_pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1, best_since = -1, fallback = -1, fallback_since = -1;
    for (int k = 0; k < n; k++) {
        const char *name = hook_names[candidates[k]];
        int since = since_version(name);
        if (since > version) continue;
        int pt = is_per_thread(name);
        if (pt == want_pt && since > best_since) best = candidates[k], best_since = since;
        if (!pt && since > fallback_since) fallback = candidates[k], fallback_since = since;
    }
    int id = best >= 0 ? best : fallback;
    if (id >= 0) {
        void *expected = NULL;
        atomic_compare_exchange_strong(&nvs_slots[id], &expected, real);
    }
    return id;
}

static CUresult answer_proc_address(CUresult r, const char *symbol, void **pfn, int version,
                                    cuuint64_t flags)
{
    if (r != CUDA_SUCCESS || symbol == NULL || pfn == NULL || *pfn == NULL) return r;
    int id = pick_for_proc_address(symbol, *pfn, version, flags);
    if (id >= 0) *pfn = hook_fn(id);
    return r;
}

NVS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags)
{
    nvs_config_load();
    CUresult r = NVS_CALL(cuGetProcAddress, (symbol, pfn, cudaVersion, flags));
    return answer_proc_address(r, symbol, pfn, cudaVersion, flags);
}

NVS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    nvs_config_load();
    CUresult r = NVS_CALL(cuGetProcAddress_v2, (symbol, pfn, cudaVersion, flags, status));
    return answer_proc_address(r, symbol, pfn, cudaVersion, flags);
}

/*
 * dlsym with a real handle: cheap for every other name (two character compares); an interposed
 * name is answered with our hook, remembering what the library returned as the real function.
 */
__attribute__((used)) NVS_UNINSTRUMENTED void *nvs_dlsym_handle(void *handle, const char *name)
{
    dlsym_fn ds = real_dlsym();
    if (ds == NULL) return NULL;
    if (name == NULL || !((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0))
        return ds(handle, name);
    int id = lookup(name);
    void *p = ds(handle, name);
    if (id < 0 || p == NULL) return p;
    if (p != hook_fn(id)) {
        void *expected = NULL;
        atomic_compare_exchange_strong(&nvs_slots[id], &expected, p);
    }
    return hook_fn(id);
}

/* The real dlsym, for the trampoline to jump to (NULL if glibc has none: dlsym answers NULL). */
__attribute__((used)) NVS_UNINSTRUMENTED void *nvs_dlsym_next_target(void) { return (void *)real_dlsym(); }

/*
 * dlsym itself. glibc resolves RTLD_NEXT relative to the return address dlsym sees, so for
 * RTLD_NEXT the trampoline jumps into the real dlsym with the caller's return address still in
 * place (a C function in between would make every such lookup relative to libnvshare.so, and an
 * interposer after us would find itself and recurse forever). Other handles go to
 * nvs_dlsym_handle.
 */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "    endbr64\n"
        "    cmpq $-1, %rdi\n"
        "    jne nvs_dlsym_handle\n"
        "    pushq %rdi\n"
        "    pushq %rsi\n"
        "    subq $8, %rsp\n"
        "    call nvs_dlsym_next_target\n"
        "    addq $8, %rsp\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    testq %rax, %rax\n"
        "    je 1f\n"
        "    jmp *%rax\n"
        "1:  ret\n"
        ".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        "dlsym:\n"
        "    hint #34\n" /* bti c */
        "    cmn x0, #1\n"
        "    b.ne nvs_dlsym_handle\n"
        "    stp x29, x30, [sp, #-32]!\n"
        "    mov x29, sp\n"
        "    stp x0, x1, [sp, #16]\n"
        "    bl nvs_dlsym_next_target\n"
        "    mov x16, x0\n"
        "    ldp x0, x1, [sp, #16]\n"
        "    ldp x29, x30, [sp], #32\n"
        "    cbz x16, 1f\n"
        "    br x16\n"
        "1:  mov x0, #0\n"
        "    ret\n"
        ".size dlsym, .-dlsym\n");
#else
/* Elsewhere RTLD_NEXT is resolved relative to libnvshare.so (a known limit, see README). */
NVS_EXPORT NVS_UNINSTRUMENTED void *dlsym(void *handle, const char *name)
{
    if (handle == RTLD_NEXT) {
        dlsym_fn ds = real_dlsym();
        return ds != NULL ? ds(handle, name) : NULL;
    }
    return nvs_dlsym_handle(handle, name);
}
#endif
