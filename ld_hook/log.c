/*
 * The hook's only output: debug lines under NVSHARE_DEBUG=1 and a single notice per process when
 * it falls back to running unshared. Each line is one write() so lines from threads and processes
 * sharing stderr do not interleave.
 */
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "nvshare.h"

int nvs_debug_on;
static atomic_int notice_given;

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
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
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
