/* What the probe's interpreter (probe.c) shares with its command groups (probe_cases.c). */
#ifndef NVSHARE_PROBE_H
#define NVSHARE_PROBE_H

#include <stddef.h>
#include <stdint.h>

#include "../cuda_api.h"

/* Objects a test refers to by number: p/q pointers, v VMM handles, M mappings, S streams,
 * P pools, G graphs, E graph executables, C contexts, a/m arrays. */
struct handle {
    char kind;
    uint64_t value;
    uint64_t aux; /* v: size, M: size */
};
extern struct handle *handles;
extern size_t nhandles;

size_t keep(char kind, uint64_t value, uint64_t aux);
int handle_of(unsigned long long id, char kind, uint64_t *value);
void reply(CUresult r, const char *fmt, unsigned long long v);
/* 1 when `cmd` is one of the commands in probe_cases.c (it has answered). */
int probe_case(const char *cmd, const char *args);
/* Likewise for the commands that wait for the GPU (probe_waits.c). */
int probe_wait_case(const char *cmd, const char *args);

#endif
