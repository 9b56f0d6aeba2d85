/*
 * The map of live allocations (and VMM mappings, and graph executables already measured): an
 * open-addressing hash table keyed by (handle, kind), so a free is O(1) however many allocations
 * are live. Entries carry their charge, GPU, context and, for VMM handles, a reference count
 * (the handle itself plus every mapping of it).
 */
#ifndef NVSHARE_ALLOCMAP_H
#define NVSHARE_ALLOCMAP_H

#include <stdint.h>

enum nvs_alloc_kind {
    NVS_KIND_PTR = 1,  /* cuMemAlloc, pitch, managed */
    NVS_KIND_ARRAY,    /* CUDA arrays */
    NVS_KIND_MIPMAP,   /* mipmapped arrays */
    NVS_KIND_VMM,      /* cuMemCreate handles: bytes charged, refs = handle + mappings */
    NVS_KIND_MAPPING,  /* cuMemMap ranges: key = address, bytes = size, aux = handle */
    NVS_KIND_GRAPH,    /* graph executables whose memory was measured: key = CUgraphExec */
};

struct nvs_alloc {
    uint64_t key; /* 0 = empty slot */
    uint64_t bytes;
    uint64_t aux;
    uint64_t ctx; /* the context it was made in (freed with it), 0 = none */
    uint32_t kind;
    int32_t gpu;
    int64_t refs;
};

int nvs_allocmap_put(struct nvs_alloc e);                         /* 0, or -1 out of memory */
int nvs_allocmap_take(uint64_t key, uint32_t kind, struct nvs_alloc *out); /* 1 found */
int nvs_allocmap_get(uint64_t key, uint32_t kind, struct nvs_alloc *out);  /* 1 found */
/* Adds `delta` to the entry's refs; at zero the entry is removed. 1 = removed (in *out). */
int nvs_allocmap_unref(uint64_t key, uint32_t kind, int64_t delta, struct nvs_alloc *out);
/* Removes every entry made in `ctx` (not VMM handles or mappings); calls `gone` for each. */
void nvs_allocmap_take_ctx(uint64_t ctx, void (*gone)(const struct nvs_alloc *e));
void nvs_allocmap_after_fork(void);

#endif
