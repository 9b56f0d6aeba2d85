/*
 * The hook's own threads (service, connection readers, drainers): detached, named "nvshare-..."
 * so they are recognisable in top and gdb, and with every signal blocked, so the program's signal
 * handlers never run on a thread it does not know about.
 */
#ifndef NVSHARE_THREAD_H
#define NVSHARE_THREAD_H

/* 0 on success. `name` has at most 15 characters. */
int nvs_thread_start(const char *name, void *(*fn)(void *), void *arg);

#endif
