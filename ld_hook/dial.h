/*
 * A connected socket to the node scheduler (NVSHARE_SOCKET_DIR's socket), its peer checked:
 * only root or this process's own user may be the scheduler.
 */
#ifndef NVSHARE_DIAL_H
#define NVSHARE_DIAL_H

#include <stdint.h>

#define NVS_DIAL_NO_SOCKET (-1) /* nobody answers */
#define NVS_DIAL_IMPOSTOR (-2)  /* a process of another user answers: not trusted */
#define NVS_DIAL_BUSY (-3)      /* a listener is there but took no connection */

/* A connected socket (blocking reads), or one of the NVS_DIAL_ codes. With `patience_ns` 0 the
 * connect does not block; otherwise it waits in the kernel for room in the backlog up to that. */
int nvs_dial(uint64_t patience_ns);

/* nvs_dial, waiting for a busy socket up to `timeout_ns` in all (a refused one retried with
 * backoff); a missing one fails at once. */
int nvs_dial_patiently(uint64_t timeout_ns);

/* One request and its one reply (of reply_type, exactly reply_len bytes) on a connection of its
 * own, needing no registration: 0 when answered, -1 when the daemon is absent, refused it or did
 * not answer within the daemon timeout (at most 2 s). Never waits on a full backlog. */
int nvs_dial_ask(uint16_t type, const void *body, uint32_t len, uint16_t reply_type, void *reply,
                 uint32_t reply_len);

#endif
