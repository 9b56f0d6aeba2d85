/*
 * The hook's only output: debug lines under NVSHARE_DEBUG=1, one-time notices, and messages about
 * bad configuration. A line is one write() so lines from threads and processes sharing stderr do
 * not interleave. stderr can block (a full pipe nobody reads), so nothing is written while the
 * calling thread holds one of the hook's mutexes: take them with nvs_mutex_lock /
 * nvs_mutex_unlock (plain pthread mutexes, nothing to do with the GPU lock), and lines logged
 * meanwhile are kept in a per-thread buffer and written after the last unlock.
 */
#ifndef NVSHARE_LOG_H
#define NVSHARE_LOG_H

#include <pthread.h>

extern int nvs_debug_on;
void nvs_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void nvs_notice_once(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void nvs_notice_reset(void);
#define NVS_DEBUG(...)                          \
    do {                                        \
        if (nvs_debug_on) nvs_log(__VA_ARGS__); \
    } while (0)

void nvs_mutex_lock(pthread_mutex_t *mu);
void nvs_mutex_unlock(pthread_mutex_t *mu);

#endif
