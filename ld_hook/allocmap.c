/*
 * The live-allocation map (see allocmap.h): open addressing with linear probing and
 * backward-shift deletion, grown at half load. The slot is the top bits of a multiplicative hash
 * (Fibonacci hashing): the low bits of device pointers and driver handles are mostly alignment
 * zeros, and the top bits of the product mix every input bit.
 */
#include <pthread.h>
#include <stdlib.h>

#include "allocmap.h"
#include "log.h"

static struct {
    pthread_mutex_t mu;
    struct nvs_alloc *slots;
    size_t cap, used;
    unsigned shift; /* 64 - log2(cap) */
} live = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t slot_of(uint64_t key, uint32_t kind, unsigned shift)
{
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> shift);
}

static int same(const struct nvs_alloc *e, uint64_t key, uint32_t kind)
{
    return e->key == key && e->kind == kind;
}

static int grow(void)
{
    size_t cap = live.cap ? live.cap * 2 : 1024;
    unsigned shift = (unsigned)(64 - __builtin_ctzll(cap));
    struct nvs_alloc *slots = calloc(cap, sizeof *slots);
    if (slots == NULL) return -1;
    for (size_t i = 0; i < live.cap; i++) {
        struct nvs_alloc e = live.slots[i];
        if (e.key == 0) continue;
        size_t s = slot_of(e.key, e.kind, shift);
        while (slots[s].key != 0) s = (s + 1) & (cap - 1);
        slots[s] = e;
    }
    free(live.slots);
    live.slots = slots;
    live.cap = cap;
    live.shift = shift;
    return 0;
}

/* With live.mu held: the slot of (key, kind), or the empty slot that ends its probe run. */
static size_t find(uint64_t key, uint32_t kind)
{
    size_t s = slot_of(key, kind, live.shift);
    while (live.slots[s].key != 0 && !same(&live.slots[s], key, kind)) s = (s + 1) & (live.cap - 1);
    return s;
}

/* With live.mu held: empty slot s, pulling later members of its probe run into the hole. */
static void remove_at(size_t s)
{
    size_t mask = live.cap - 1, hole = s;
    live.used--;
    for (size_t j = (s + 1) & mask; live.slots[j].key != 0; j = (j + 1) & mask) {
        size_t home = slot_of(live.slots[j].key, live.slots[j].kind, live.shift);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            live.slots[hole] = live.slots[j];
            hole = j;
        }
    }
    live.slots[hole].key = 0;
}

int nvs_allocmap_put(struct nvs_alloc e)
{
    nvs_mutex_lock(&live.mu);
    if ((live.used + 1) * 2 > live.cap && grow() != 0) {
        nvs_mutex_unlock(&live.mu);
        return -1;
    }
    size_t s = find(e.key, e.kind);
    if (live.slots[s].key == 0) live.used++;
    live.slots[s] = e;
    nvs_mutex_unlock(&live.mu);
    return 0;
}

static int lookup(uint64_t key, uint32_t kind, struct nvs_alloc *out, int take)
{
    int found = 0;
    nvs_mutex_lock(&live.mu);
    if (live.cap > 0 && key != 0) {
        size_t s = find(key, kind);
        if (live.slots[s].key != 0) {
            *out = live.slots[s];
            found = 1;
            if (take) remove_at(s);
        }
    }
    nvs_mutex_unlock(&live.mu);
    return found;
}

int nvs_allocmap_take(uint64_t key, uint32_t kind, struct nvs_alloc *out)
{
    return lookup(key, kind, out, 1);
}

int nvs_allocmap_get(uint64_t key, uint32_t kind, struct nvs_alloc *out)
{
    return lookup(key, kind, out, 0);
}

int nvs_allocmap_unref(uint64_t key, uint32_t kind, int64_t delta, struct nvs_alloc *out)
{
    int removed = 0;
    nvs_mutex_lock(&live.mu);
    if (live.cap > 0 && key != 0) {
        size_t s = find(key, kind);
        if (live.slots[s].key != 0) {
            live.slots[s].refs += delta;
            *out = live.slots[s];
            if (live.slots[s].refs <= 0) {
                remove_at(s);
                removed = 1;
            }
        }
    }
    nvs_mutex_unlock(&live.mu);
    return removed;
}

void nvs_allocmap_take_ctx(uint64_t ctx, void (*gone)(const struct nvs_alloc *e))
{
    if (ctx == 0) return;
    enum { BATCH = 64 };
    for (;;) {
        struct nvs_alloc taken[BATCH];
        int n = 0;
        nvs_mutex_lock(&live.mu);
        for (size_t i = 0; i < live.cap && n < BATCH; i++) {
            struct nvs_alloc *e = &live.slots[i];
            if (e->key == 0 || e->ctx != ctx || e->kind == NVS_KIND_VMM || e->kind == NVS_KIND_MAPPING)
                continue;
            taken[n++] = *e;
            remove_at(i);
            i--; /* the shift may have pulled another entry into slot i */
        }
        nvs_mutex_unlock(&live.mu);
        for (int k = 0; k < n; k++) gone(&taken[k]);
        if (n < BATCH) return;
    }
}

void nvs_allocmap_after_fork(void)
{
    pthread_mutex_init(&live.mu, NULL);
    free(live.slots);
    live.slots = NULL;
    live.cap = live.used = 0;
    live.shift = 0;
}
