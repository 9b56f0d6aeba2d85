/*
 * The limits the node daemon last published, for a process that cannot register (the daemon
 * absent, restarting, overloaded, or refusing it a connection): rather than no limit at all, it
 * applies the memory limit the daemon wrote for its pod, or the node's default, into
 * `<NVSHARE_SOCKET_DIR>/limits` (format: appliance/daemon/limits_file.py).
 *
 * The file counts only when a tenant cannot have written it: a regular file owned by root or by
 * this process's user, writable by no one else, in a directory of the same kind. Its pod line is
 * found by the pod UID in /proc/self/cgroup, or, in a private cgroup namespace that hides it, in
 * the kubelet paths of /proc/self/mountinfo (both the kernel's word, not the environment's).
 */
#ifndef NVSHARE_FALLBACK_H
#define NVSHARE_FALLBACK_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Bytes this process should hold at most until it registers; 0 = nothing published applies.
 * Reads the file at most once every few seconds (never on a hot path). Thread-safe. */
uint64_t nvs_fallback_memory_limit(void);
void nvs_fallback_after_fork(void);

/* Exposed for tests: the pod UID (36 characters, dashes) a cgroup or mountinfo text names,
 * into out[37]; 1 when found. */
int nvs_pod_uid_in(FILE *f, int mountinfo, char out[37]);
/* The limit `f` (a published file) gives a process of pod `pod_uid` ("" for none); 0 = none,
 * -1 when it is not a published file. */
int nvs_published_limit(FILE *f, const char *pod_uid, uint64_t *bytes);

#endif
