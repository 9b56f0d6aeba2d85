/*
 * The most memory a graph's allocation nodes can hold at once, per GPU: what the driver may need
 * to reserve for it. Summing the nodes over-counts a graph that frees and allocates again inside
 * itself (a compiled model's temporaries), so the allocations are ordered along the graph's
 * dependencies instead.
 */
#ifndef NVSHARE_GRAPH_PEAK_H
#define NVSHARE_GRAPH_PEAK_H

#include <stdint.h>

#include "cuda_min.h"
#include "gpus.h"

/* Adds to bytes[gpu] the peak of `graph`'s allocation nodes on each GPU (2 MiB granules; child
 * graphs each counted at their own peak, live throughout). A safe upper bound: it never says
 * less than an order the dependencies allow can hold; where the driver does not tell the
 * dependencies, it is the plain sum. */
void nvs_graph_peak(CUgraph graph, uint64_t bytes[NVS_MAX_GPUS]);

#endif
