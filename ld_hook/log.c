/*
 * Logging (see log.h): lines go straight to stderr, except while the thread holds a hook mutex;
 * then they wait in a small per-thread buffer until the last nvs_mutex_unlock.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

int nvs_debug_on;
static atomic_int notice_given;

/* Lines logged while holding a mutex; global-dynamic TLS (not on any hot path). */
static __thread struct {
    int depth;
    int dropped;
    size_t used;
    char buf[2048];
} pending;

static void emit(const char *line, size_t len)
{
    if (pending.depth > 0) {
        if (pending.used + len <= sizeof pending.buf) {
            memcpy(pending.buf + pending.used, line, len);
            pending.used += len;
        } else {
            pending.dropped++;
        }
        return;
    }
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

static void write_line(const char *prefix, const char *fmt, va_list ap)
{
    char buf[512];
    int n = snprintf(buf, sizeof buf, "%s", prefix);
    if (n < 0) return;
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    if (m < 0) return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2) len = sizeof buf - 2;
    buf[len++] = '\n';
    emit(buf, len);
}

void nvs_log(const char *fmt, ...)
{
    char prefix[32];
    snprintf(prefix, sizeof prefix, "nvshare[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    write_line(prefix, fmt, ap);
    va_end(ap);
}

void nvs_notice_once(const char *fmt, ...)
{
    if (atomic_exchange(&notice_given, 1)) return;
    va_list ap;
    va_start(ap, fmt);
    write_line("nvshare: ", fmt, ap);
    va_end(ap);
}

void nvs_notice_reset(void) { atomic_store(&notice_given, 0); }

void nvs_mutex_lock(pthread_mutex_t *mu)
{
    pthread_mutex_lock(mu);
    pending.depth++;
}

void nvs_mutex_unlock(pthread_mutex_t *mu)
{
    pthread_mutex_unlock(mu);
    if (--pending.depth > 0 || (pending.used == 0 && pending.dropped == 0)) return;
    if (pending.used > 0) {
        ssize_t w = write(STDERR_FILENO, pending.buf, pending.used);
        (void)w;
    }
    if (pending.dropped > 0) nvs_log("(%d debug lines dropped)", pending.dropped);
    pending.used = 0;
    pending.dropped = 0;
}
