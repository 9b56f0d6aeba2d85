/*
 * The allocation hooks (linear memory, pitch, managed, arrays, mipmaps, VMM handles and their
 * mappings) and their frees. A VMM handle's memory stays charged until the handle is released
 * and its last mapping is gone, as it does on the GPU.
 */
#ifndef NVSHARE_ALLOC_H
#define NVSHARE_ALLOC_H

#include "gpus.h"

/* A context was destroyed or reset: the allocations made in it are gone. */
void nvs_alloc_forget_ctx(CUcontext ctx);

#endif
