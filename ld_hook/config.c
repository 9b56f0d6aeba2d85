/*
 * Reading the environment (see config.h). Messages go through nvs_log, so they carry the pid and
 * reach stderr even without NVSHARE_DEBUG.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"

struct nvs_config nvs_cfg;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int loaded;

/* Digits only, within [min, max]. 0 on success; the caller reports a failure. */
static int parse_whole(const char *text, uint64_t min, uint64_t max, uint64_t *out)
{
    if (text == NULL || *text == '\0') return -1;
    for (const char *p = text; *p; p++)
        if (!isdigit((unsigned char)*p)) return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno == ERANGE || *end != '\0' || v < min || v > max) return -1;
    *out = v;
    return 0;
}

/* A whole number from the environment; unset or empty leaves *out untouched. */
static void whole_env(const char *name, uint64_t min, uint64_t max, uint64_t *out,
                      const char *meaning, const char *instead)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return;
    uint64_t parsed;
    if (parse_whole(v, min, max, &parsed) == 0) {
        *out = parsed;
        return;
    }
    nvs_log("%s=%s is not %s from %llu to %llu; ignored, %s", name, v, meaning,
            (unsigned long long)min, (unsigned long long)max, instead);
}

static void text_env(char *dst, size_t size, const char *name, const char *what)
{
    const char *v = getenv(name);
    dst[0] = '\0';
    if (v == NULL) return;
    if (strlen(v) >= size) {
        nvs_log("%s is %zu bytes long, more than a %s can be (%zu); not sent to the scheduler",
                name, strlen(v), what, size - 1);
        return;
    }
    memcpy(dst, v, strlen(v) + 1);
}

static void load_debug(void)
{
    const char *v = getenv("NVSHARE_DEBUG");
    nvs_debug_on = v != NULL && strcmp(v, "1") == 0;
    if (v != NULL && *v && strcmp(v, "0") != 0 && strcmp(v, "1") != 0)
        nvs_log("NVSHARE_DEBUG=%s is neither 0 nor 1; debug logging stays off", v);
}

static void load_socket_path(void)
{
    const char *dir = getenv("NVSHARE_SOCKET_DIR");
    if (dir == NULL || *dir == '\0') dir = "/var/run/nvshare";
    int n = snprintf(nvs_cfg.socket_path, sizeof nvs_cfg.socket_path, "%s/scheduler.sock", dir);
    nvs_cfg.socket_usable = n > 0 && (size_t)n < sizeof nvs_cfg.socket_path;
    if (!nvs_cfg.socket_usable) {
        nvs_cfg.socket_path[0] = '\0';
        nvs_log("NVSHARE_SOCKET_DIR=%s makes the socket path %d bytes long, more than the %zu a "
                "Unix socket allows; running without the scheduler (local limits only)",
                dir, n, sizeof nvs_cfg.socket_path - 1);
    }
}

#define REFUSED "; CUDA is not started (cuInit fails with CUDA_ERROR_INVALID_VALUE): fix or unset it"

/* A limit the process asked for and mistyped must not leave it with none: CUDA is refused. */
static void load_memory_limit(void)
{
    const char *v = getenv("NVSHARE_GPU_MEMORY_LIMIT");
    nvs_cfg.env_mem_limit = 0;
    if (v == NULL || *v == '\0') return;
    uint64_t bytes = 0;
    int r = nvs_parse_bytes(v, &bytes);
    if (r == NVS_SIZE_OK && bytes > 0) {
        nvs_cfg.env_mem_limit = bytes;
        return;
    }
    nvs_cfg.refuse_cuda = 1;
    if (r == NVS_SIZE_TOO_LARGE)
        nvs_log("NVSHARE_GPU_MEMORY_LIMIT=%s is more than 1Ei" REFUSED, v);
    else if (r == NVS_SIZE_OK)
        nvs_log("NVSHARE_GPU_MEMORY_LIMIT=%s is zero bytes (unset it for no limit of your "
                "own)" REFUSED, v);
    else
        nvs_log("NVSHARE_GPU_MEMORY_LIMIT=%s is not a byte quantity: a number with Ki, Mi, Gi, "
                "Ti, Pi, Ei or k, M, G, T, P, E (4Gi, 512Mi, 1.5G; a bare number is MiB)" REFUSED,
                v);
}

static void load_core_limit(void)
{
    const char *v = getenv("NVSHARE_GPU_CORE_LIMIT");
    uint64_t core = 0;
    nvs_cfg.env_core_limit = 0;
    if (v == NULL || *v == '\0') return;
    if (parse_whole(v, 1, 100, &core) == 0) {
        nvs_cfg.env_core_limit = (uint32_t)core;
        return;
    }
    nvs_cfg.refuse_cuda = 1;
    nvs_log("NVSHARE_GPU_CORE_LIMIT=%s is not a whole percentage from 1 to 100" REFUSED, v);
}

/* The job this process belongs to: NVSHARE_GANG, else torch.distributed's rendezvous, which
 * torchrun and mp.spawn scripts give every rank alike (two jobs on one node cannot share a
 * MASTER_ADDR:MASTER_PORT, and TORCHELASTIC_RUN_ID is often just "none"). */
static void load_gang(void)
{
    const char *named = getenv("NVSHARE_GANG");
    const char *port = getenv("MASTER_PORT");
    char job[2 * NVS_GANG_LEN];
    nvs_cfg.gang[0] = '\0';
    if (named != NULL && *named != '\0') {
        snprintf(job, sizeof job, "%s", named);
    } else if (port != NULL && *port != '\0') {
        const char *run = getenv("TORCHELASTIC_RUN_ID");
        const char *addr = getenv("MASTER_ADDR");
        snprintf(job, sizeof job, "torch/%s@%s:%s", run ? run : "", addr ? addr : "", port);
    } else {
        return;
    }
    if (strlen(job) >= sizeof nvs_cfg.gang) {
        nvs_log("the job name %.40s... is %zu bytes long, more than %zu; this process takes its "
                "GPUs' locks on its own, not with its job's other processes",
                job, strlen(job), sizeof nvs_cfg.gang - 1);
        return;
    }
    memcpy(nvs_cfg.gang, job, strlen(job) + 1);
}

/* NVSHARE_GPU_PRIORITY: the daemon takes it only where it lowers the priority its policy and
 * annotations give this process (a job that lets others go first). */
static void load_priority(void)
{
    static const struct {
        const char *name;
        int32_t value;
    } names[] = {{"low", -100}, {"normal", 0}, {"high", 100}};
    const char *v = getenv("NVSHARE_GPU_PRIORITY");
    nvs_cfg.has_priority = 0;
    if (v == NULL || *v == '\0') return;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(v, names[i].name) == 0) {
            nvs_cfg.priority = names[i].value;
            nvs_cfg.has_priority = 1;
            return;
        }
    }
    uint64_t magnitude;
    int negative = v[0] == '-';
    if (parse_whole(v + negative, 0, negative ? -NVS_MIN_PRIORITY : NVS_MAX_PRIORITY, &magnitude) ==
        0) {
        nvs_cfg.priority = negative ? -(int32_t)magnitude : (int32_t)magnitude;
        nvs_cfg.has_priority = 1;
        return;
    }
    nvs_log("NVSHARE_GPU_PRIORITY=%s is not low, normal, high or a whole number from %d to %d; "
            "ignored, the scheduler's priority applies",
            v, NVS_MIN_PRIORITY, NVS_MAX_PRIORITY);
}

void nvs_config_load(void)
{
    if (atomic_load_explicit(&loaded, memory_order_acquire)) return;
    pthread_mutex_lock(&load_mu);
    if (!atomic_load_explicit(&loaded, memory_order_relaxed)) {
        load_debug();
        load_socket_path();
        nvs_cfg.refuse_cuda = 0;
        load_memory_limit();
        load_core_limit();
        uint64_t idle = 0, timeout = NVS_DEFAULT_DAEMON_TIMEOUT_MS, oversub = 0;
        whole_env("NVSHARE_IDLE_RELEASE_MS", 1, 86400000, &idle, "a whole number of milliseconds",
                  "the policy's idle release applies");
        whole_env("NVSHARE_DAEMON_TIMEOUT_MS", 100, 600000, &timeout,
                  "a whole number of milliseconds", "5000 applies");
        whole_env("NVSHARE_ENABLE_SINGLE_OVERSUB", 0, 1, &oversub, "0 or 1",
                  "no process goes past the GPU's size unless the policy says so");
        nvs_cfg.single_oversub = oversub == 1;
        nvs_cfg.idle_release_ms = (uint32_t)idle;
        nvs_cfg.daemon_timeout_ms = (uint32_t)timeout;
        text_env(nvs_cfg.pod_namespace, sizeof nvs_cfg.pod_namespace, "NVSHARE_POD_NAMESPACE",
                 "namespace");
        text_env(nvs_cfg.pod_name, sizeof nvs_cfg.pod_name, "NVSHARE_POD_NAME", "pod name hint");
        load_gang();
        load_priority();
        atomic_store_explicit(&loaded, 1, memory_order_release);
    }
    pthread_mutex_unlock(&load_mu);
}

void nvs_config_after_fork(void) { pthread_mutex_init(&load_mu, NULL); }
