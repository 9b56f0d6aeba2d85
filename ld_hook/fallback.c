/*
 * The last published limits (see fallback.h).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "fallback.h"
#include "log.h"
#include "nvshare.h"

#define REREAD_NS 5000000000ull
#define MAX_FILE_BYTES (4u << 20)
#define UID_LEN 36

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t cached_limit, read_at_ns;
static int have_read, reported_untrusted;

/* "pod" then a UID written 8-4-4-4-12 with '-' or '_' (systemd slices use '_'). */
static int uid_at(const char *p, char out[UID_LEN + 1])
{
    static const int dash[] = {8, 13, 18, 23};
    for (int i = 0, d = 0; i < UID_LEN; i++) {
        char c = p[i];
        if (d < 4 && i == dash[d]) {
            if (c != '-' && c != '_') return 0;
            out[i] = '-';
            d++;
        } else {
            if (!isxdigit((unsigned char)c) || isupper((unsigned char)c)) return 0;
            out[i] = c;
        }
    }
    out[UID_LEN] = '\0';
    return 1;
}

/* Only the kubelet's own layout names a pod (as appliance/host/cgroup.py decides, for the same
 * reason: any user may copy those names inside the cgroup subtree systemd delegates to it). */
#define MAX_PARTS 64
struct parts {
    int n;
    const char *s[MAX_PARTS];
    size_t len[MAX_PARTS];
};

static int is(const char *s, size_t n, const char *lit) { return strlen(lit) == n && memcmp(s, lit, n) == 0; }

static int ends_with(const char *s, size_t n, const char *suffix)
{
    size_t k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

static int is_qos(const char *s, size_t n) { return is(s, n, "burstable") || is(s, n, "besteffort"); }

static int is_unit(const char *s, size_t n)
{
    static const char *const kinds[] = {".slice", ".service", ".scope", ".socket",
                                        ".mount", ".swap",    ".target"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (ends_with(s, n, kinds[i])) return 1;
    return 0;
}

/* "<stem>-pod<uid>.slice": the stem is the kubepods root or its QoS slice, and the `above`
 * components just over it are the slices its name spells, one per level ("kubepods.slice",
 * "kubepods-burstable.slice"); all of them from the top, or the lowest ones where `relative`. */
static int systemd_parents(const char *stem, size_t n, const struct parts *p, int first, int i,
                           int relative)
{
    size_t root = n;
    if (ends_with(stem, n, "-burstable")) root -= 10;
    else if (ends_with(stem, n, "-besteffort")) root -= 11;
    if (!is(stem, root, "kubepods") && !ends_with(stem, root, "-kubepods")) return 0;
    if (n >= 4 && memcmp(stem, "user", 4) == 0 && (n == 4 || stem[4] == '-')) return 0;
    int levels = 1;
    for (size_t k = 0; k < n; k++) levels += stem[k] == '-';
    int above = i - first;
    if (relative ? above > levels : above != levels) return 0;
    for (int k = 0; k < above; k++) {
        int level = levels - above + k, dashes = 0;
        size_t end = n;
        for (size_t j = 0; j < n; j++)
            if (stem[j] == '-' && dashes++ == level) {
                end = j;
                break;
            }
        const char *c = p->s[first + k];
        size_t len = p->len[first + k];
        if (len != end + 6 || memcmp(c, stem, end) != 0 || memcmp(c + end, ".slice", 6) != 0)
            return 0;
    }
    return 1;
}

/* "pod<uid>" under "kubepods" or "kubepods/<qos>", that under plain directories only. */
static int cgroupfs_parents(const struct parts *p, int first, int i, int relative)
{
    int top = i;
    if (top > first && is_qos(p->s[top - 1], p->len[top - 1])) top--;
    if (relative && top == first) return 1;
    if (top == first || !is(p->s[top - 1], p->len[top - 1], "kubepods")) return 0;
    for (int k = first; k < top - 1; k++)
        if (is_unit(p->s[k], p->len[k]) || is_qos(p->s[k], p->len[k]) ||
            is(p->s[k], p->len[k], "kubepods"))
            return 0;
    return 1;
}

/* One line of /proc/<pid>/cgroup ("N:controllers:/path"). */
static int pod_in_cgroup_line(const char *line, char out[UID_LEN + 1])
{
    const char *path = strchr(line, ':');
    if (path != NULL) path = strchr(path + 1, ':');
    if (path == NULL) return 0;
    struct parts p = {0};
    for (const char *c = path + 1; *c != '\0' && *c != '\n';) {
        size_t len = strcspn(c, "/\n");
        if (len > 0) {
            if (p.n == MAX_PARTS) return 0;
            p.s[p.n] = c;
            p.len[p.n++] = len;
        }
        c += len;
        if (*c == '/') c++;
    }
    int first = 0;
    while (first < p.n && is(p.s[first], p.len[first], "..")) first++;
    for (int i = first; i < p.n; i++)
        if (is(p.s[i], p.len[i], "..")) return 0;
    for (int i = first; i < p.n; i++) {
        const char *c = p.s[i];
        size_t len = p.len[i];
        const size_t tail = 4 + UID_LEN + 6; /* "-pod" <uid> ".slice" */
        if (len > tail && memcmp(c + len - tail, "-pod", 4) == 0 && ends_with(c, len, ".slice") &&
            uid_at(c + len - tail + 4, out) && systemd_parents(c, len - tail, &p, first, i, first > 0))
            return 1;
        if (len == 3 + UID_LEN && memcmp(c, "pod", 3) == 0 && uid_at(c + 3, out) &&
            cgroupfs_parents(&p, first, i, first > 0))
            return 1;
    }
    return 0;
}

/* A mount's root under kubelet's pods directory: ".../pods/<uid>/..." (etc-hosts, volumes). */
static int pod_in_mountinfo_line(const char *line, char out[UID_LEN + 1])
{
    const char *root = line;
    for (int field = 0; field < 3 && root != NULL; field++) {
        root = strchr(root, ' ');
        if (root != NULL) root++;
    }
    if (root == NULL) return 0;
    const char *end = strchr(root, ' ');
    if (end == NULL) end = root + strlen(root);
    for (const char *p = strstr(root, "/pods/"); p != NULL && p + 6 + UID_LEN < end;
         p = strstr(p + 1, "/pods/"))
        if (uid_at(p + 6, out) && p[6 + UID_LEN] == '/') return 1;
    return 0;
}

int nvs_pod_uid_in(FILE *f, int mountinfo, char out[UID_LEN + 1])
{
    char line[4096];
    while (fgets(line, sizeof line, f) != NULL)
        if (mountinfo ? pod_in_mountinfo_line(line, out) : pod_in_cgroup_line(line, out)) return 1;
    return 0;
}

static int own_pod_uid(char out[UID_LEN + 1])
{
    static const struct {
        const char *path;
        int mountinfo;
    } sources[] = {{"/proc/self/cgroup", 0}, {"/proc/self/mountinfo", 1}};
    for (size_t i = 0; i < sizeof sources / sizeof sources[0]; i++) {
        FILE *f = fopen(sources[i].path, "re");
        if (f == NULL) continue;
        int found = nvs_pod_uid_in(f, sources[i].mountinfo, out);
        fclose(f);
        if (found) return 1;
    }
    out[0] = '\0';
    return 0;
}

int nvs_published_limit(FILE *f, const char *pod_uid, uint64_t *bytes)
{
    char line[256], kind[16], key[64];
    unsigned long long value;
    if (fgets(line, sizeof line, f) == NULL || strcmp(line, "nvshare-limits 1\n") != 0) return -1;
    int have_default = 0, have_pod = 0;
    uint64_t fallback = 0, pod = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        if (sscanf(line, "%15s %llu", kind, &value) == 2 && strcmp(kind, "default") == 0) {
            fallback = value;
            have_default = 1;
        } else if (sscanf(line, "%15s %63s %llu", kind, key, &value) == 3 &&
                   strcmp(kind, "pod") == 0 && pod_uid[0] != '\0' && strcmp(key, pod_uid) == 0) {
            pod = value;
            have_pod = 1;
        }
    }
    *bytes = have_pod ? pod : have_default ? fallback : 0;
    return 0;
}

/* Root's or ours, and writable by no one else. */
static const char *untrusted(const struct stat *st, int want_dir)
{
    if (want_dir ? !S_ISDIR(st->st_mode) : !S_ISREG(st->st_mode)) return "not a regular file";
    if (st->st_uid != 0 && st->st_uid != geteuid()) return "owned by another user";
    if (st->st_mode & (S_IWGRP | S_IWOTH)) return "writable by others";
    if (!want_dir && st->st_size > MAX_FILE_BYTES) return "too large";
    return NULL;
}

static uint64_t read_published(void)
{
    char dir[sizeof nvs_cfg.socket_path], path[sizeof nvs_cfg.socket_path + 8];
    memcpy(dir, nvs_cfg.socket_path, sizeof dir);
    char *slash = strrchr(dir, '/');
    if (!nvs_cfg.socket_usable || slash == NULL) return 0;
    *slash = '\0';
    snprintf(path, sizeof path, "%s/limits", dir[0] ? dir : "/");
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat file, parent;
    const char *why = fstat(fd, &file) != 0 ? "cannot be read" : untrusted(&file, 0);
    if (why == NULL) why = stat(dir[0] ? dir : "/", &parent) != 0 ? "cannot be read" : untrusted(&parent, 1);
    FILE *f = why == NULL ? fdopen(fd, "re") : NULL;
    if (f == NULL) {
        close(fd);
        if (why != NULL && !reported_untrusted++)
            nvs_log("ignoring %s: %s, so a tenant could have written it", path, why);
        return 0;
    }
    char pod[UID_LEN + 1];
    own_pod_uid(pod);
    uint64_t bytes = 0;
    if (nvs_published_limit(f, pod, &bytes) != 0) bytes = 0;
    fclose(f);
    NVS_DEBUG("published limits in %s: %llu bytes for pod %s", path, (unsigned long long)bytes,
              pod[0] ? pod : "(none)");
    return bytes;
}

uint64_t nvs_fallback_memory_limit(void)
{
    uint64_t now = nvs_now_ns();
    nvs_mutex_lock(&mu);
    if (!have_read || nvs_elapsed(now, read_at_ns) >= REREAD_NS) {
        cached_limit = read_published();
        read_at_ns = now;
        have_read = 1;
    }
    uint64_t limit = cached_limit;
    nvs_mutex_unlock(&mu);
    return limit;
}

void nvs_fallback_after_fork(void)
{
    pthread_mutex_init(&mu, NULL);
    have_read = 0; /* the child re-reads: it may have moved to another cgroup */
}
