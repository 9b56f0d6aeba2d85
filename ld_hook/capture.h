/*
 * Stream captures in progress, per GPU. A capture records work into a graph; synchronising the
 * device it records on invalidates it (and in the default global mode, so does almost any
 * synchronising call from any thread). So a lock release waits for captures to end before it
 * drains, and fences new ones out while it synchronises.
 */
#ifndef NVSHARE_CAPTURE_H
#define NVSHARE_CAPTURE_H

#include "gpus.h"

int nvs_capture_active(const struct nvs_gpu *g);
/* Waits until g has no capture or the deadline passes; returns the captures still running. */
int nvs_capture_wait_idle(const struct nvs_gpu *g, uint64_t deadline_ns);
/* 0: no capture runs on g and none can begin until nvs_capture_unfence; else the count running. */
int nvs_capture_fence(const struct nvs_gpu *g);
void nvs_capture_unfence(const struct nvs_gpu *g);
int nvs_stream_capturing(CUstream s);
/* For the hook's own threads: their driver calls never count as unsafe during a capture. */
void nvs_capture_relax_thread(void);
void nvs_capture_after_fork(void);

#endif
