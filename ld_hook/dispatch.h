/*
 * The dispatch table (generated from hooks.def): one slot per driver or NVML function the hook
 * interposes or calls, holding the real function once resolved. NVS_CALL is the one way the hook
 * calls a real function; it answers "not found" (CUDA_ERROR_NOT_FOUND, NVML's
 * FUNCTION_NOT_FOUND) when the library has no such function.
 */
#ifndef NVSHARE_DISPATCH_H
#define NVSHARE_DISPATCH_H

#include <stdatomic.h>

#include "nvshare.h"

enum nvs_fn_id {
#define NVS_CU(n) NVS_H_##n,
#define NVS_NVML(n) NVS_H_##n,
#define NVS_DRV(n) NVS_H_##n,
#define NVS_NVML_DRV(n) NVS_H_##n,
#include "hooks.def"
#undef NVS_CU
#undef NVS_NVML
#undef NVS_DRV
#undef NVS_NVML_DRV
    NVS_H_COUNT
};

extern _Atomic(void *) nvs_slots[NVS_H_COUNT];
void *nvs_resolve(int id);
int nvs_not_found(int id);

static inline void *nvs_real(int id)
{
    void *p = atomic_load_explicit(&nvs_slots[id], memory_order_relaxed);
    return NVS_LIKELY(p != NULL) ? p : nvs_resolve(id);
}

#define NVS_REAL(name) ((__typeof__(&name))nvs_real(NVS_H_##name))
#define NVS_CALL(name, args)                                                  \
    ({                                                                        \
        __typeof__(&name) real_ = NVS_REAL(name);                             \
        real_ != NULL ? real_ args : (__typeof__(real_ args))nvs_not_found(NVS_H_##name); \
    })

#endif
