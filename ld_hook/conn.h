/*
 * One connection per (process, GPU) to the node scheduler. This module only moves frames: it
 * connects and registers, reads frames on its own thread and checks every one (version, length,
 * enums, ranges) before handing a typed event to the handler the session installed, and sends
 * frames from an outbox without ever blocking. It also decides when the daemon is gone: EOF, a
 * frame it cannot parse, or no answer to a request (heartbeats included) within
 * NVSHARE_DAEMON_TIMEOUT_MS.
 * Lock order: a caller may hold its own module's mutex while queueing, never while calling
 * nvs_conn_use or nvs_conn_flush.
 */
#ifndef NVSHARE_CONN_H
#define NVSHARE_CONN_H

#include "frames.h"
#include "gpus.h"

typedef void (*nvs_event_handler)(struct nvs_gpu *g, const struct nvs_event *e);

void nvs_conn_init(nvs_event_handler handler);
/* First use of g: connect and register, waiting at most the daemon timeout. No locks held. */
void nvs_conn_use(struct nvs_gpu *g);
/* Appends a frame to g's outbox (no syscall); *seq gets its sequence number. 0 when queued. */
int nvs_conn_queue(struct nvs_gpu *g, uint16_t type, const void *body, uint32_t len, uint64_t *seq);
void nvs_conn_flush(struct nvs_gpu *g); /* no locks held */
void nvs_conn_fail(struct nvs_gpu *g, const char *why); /* treat the daemon as gone */
void nvs_conn_tick(struct nvs_gpu *g, uint64_t now_ns); /* heartbeat, liveness, reconnect */
void nvs_conn_after_fork(void);


#endif
