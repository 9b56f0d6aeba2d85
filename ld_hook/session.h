/*
 * The session: starts the hook once CUDA is initialised, routes what the scheduler says (typed
 * events from the connection) to the gate and the ledger, and runs the service thread that keeps
 * time for them (heartbeats, liveness, reconnects, idle release, usage reports, returning an
 * idle reservation, re-reading pool and graph reservations).
 */
#ifndef NVSHARE_SESSION_H
#define NVSHARE_SESSION_H

void nvs_start(void); /* after a successful real cuInit; idempotent */
void nvs_session_after_fork(void);

#endif
