/*
 * The hook's configuration, read once from the environment on the first cuInit or
 * cuGetProcAddress. Every value is parsed strictly (digits only, in range, no trailing junk,
 * no overflow); a bad one is reported in one line that says what was wrong and what applies
 * instead, and is then ignored. Except a limit the process sets on itself
 * (NVSHARE_GPU_MEMORY_LIMIT, NVSHARE_GPU_CORE_LIMIT): a mistyped one would let the program run
 * with no limit of its own, so it is reported and CUDA is refused instead (cuInit fails).
 */
#ifndef NVSHARE_CONFIG_H
#define NVSHARE_CONFIG_H

#include <stdint.h>

#include "nvshare_proto.h"

#define NVS_DEFAULT_DAEMON_TIMEOUT_MS 5000u

struct nvs_config {
    char socket_path[108];     /* sizeof(sockaddr_un.sun_path) */
    int socket_usable;         /* 0: the path did not fit; never connect */
    uint64_t env_mem_limit;    /* NVSHARE_GPU_MEMORY_LIMIT, 0 = none */
    uint32_t env_core_limit;   /* NVSHARE_GPU_CORE_LIMIT, 0 = none */
    uint32_t idle_release_ms;  /* NVSHARE_IDLE_RELEASE_MS, 0 = the daemon's policy decides */
    uint32_t daemon_timeout_ms; /* NVSHARE_DAEMON_TIMEOUT_MS: silence after which the daemon is gone */
    int single_oversub;        /* NVSHARE_ENABLE_SINGLE_OVERSUB=1: past the GPU's size (managed only) */
    char pod_namespace[NVS_NAME_LEN];
    char pod_name[NVS_POD_NAME_LEN];
    char gang[NVS_GANG_LEN];   /* the job outside pods (appliance/core/gang.py); "" = none */
    int has_priority;          /* NVSHARE_GPU_PRIORITY was given (and valid) */
    int32_t priority;          /* ... as a number: low -100, normal 0, high 100 */
    int refuse_cuda;           /* a self-set limit did not parse: cuInit fails (said once) */
};

extern struct nvs_config nvs_cfg;

void nvs_config_load(void); /* idempotent, thread-safe */
/* A size as the whole project writes it ("4Gi", "1.5G", "512" = 512 MiB; size.c says how):
 * NVS_SIZE_OK with *out in bytes, or why not. */
enum { NVS_SIZE_OK = 0, NVS_SIZE_SYNTAX = -1, NVS_SIZE_TOO_LARGE = -2 };
int nvs_parse_bytes(const char *text, uint64_t *out);
void nvs_config_after_fork(void);

#endif
