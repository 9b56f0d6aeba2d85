/* Starting the hook's threads (see thread.h). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "thread.h"

struct start {
    void *(*fn)(void *);
    void *arg;
    char name[16];
};

/* The name is set by the thread itself: a detached thread may be gone before its creator looks. */
static void *trampoline(void *p)
{
    struct start s = *(struct start *)p;
    free(p);
    pthread_setname_np(pthread_self(), s.name);
    return s.fn(s.arg);
}

int nvs_thread_start(const char *name, void *(*fn)(void *), void *arg)
{
    struct start *s = malloc(sizeof *s);
    if (s == NULL) return -1;
    s->fn = fn;
    s->arg = arg;
    strncpy(s->name, name, sizeof s->name - 1);
    s->name[sizeof s->name - 1] = '\0';
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* The new thread inherits the creator's mask: block everything around the create. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    int rc = pthread_create(&t, &attr, trampoline, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) free(s);
    return rc;
}
