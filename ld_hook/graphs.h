/*
 * Graph memory. A graph's allocation nodes take no memory when they are captured or added: the
 * driver reserves it for them in the device's graph pool when the graph is uploaded or launched
 * (and may at instantiation), keeps it reserved across launches, and gives it back only when
 * cuDeviceGraphMemTrim finds it unused (a destroyed executable's memory stays in the pool until
 * then). So the hook reads a graph's allocation nodes when it is instantiated, and before an
 * instantiation, upload or launch that can make the driver reserve them it charges the growth
 * they can need (their bytes beyond what the pool holds unused); over the limit the call is
 * refused with CUDA_ERROR_OUT_OF_MEMORY and never reaches the driver. After the call the charge
 * is set to what the driver really reserves (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT).
 */
#ifndef NVSHARE_GRAPHS_H
#define NVSHARE_GRAPHS_H

#include "gpus.h"

/* Before an upload or launch of `exec`: CUDA_ERROR_OUT_OF_MEMORY when its memory, not yet
 * reserved, does not fit; else CUDA_SUCCESS with the growth charged. */
CUresult nvs_graph_admit(CUgraphExec exec, CUstream s);
/* After it (r: the driver's answer): the charges settle to what the driver reserves. */
void nvs_graph_ran(CUgraphExec exec, CUstream s, CUresult r);
/* Re-reads g's graph memory and settles its charge (no limit check); 1 when it went down. */
int nvs_graphs_settle(struct nvs_gpu *g);
void nvs_graphs_after_fork(void);

#endif
