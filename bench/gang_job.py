"""One rank of a 2-GPU data-parallel job for bench/gangs.py, started by torchrun.

Every step: a bf16 matmul on the rank's GPU, an NCCL all-reduce of its result across the job's
ranks, and a synchronisation (as a training loop reading its loss does). Rank r writes the wall
time each step finished to OUT/<job>-rank<r>.steps, one line per step, until it is killed.
With `lone`, every rank names a job of its own (NVSHARE_GANG), so the scheduler treats it as a
single-GPU client: per-GPU locks taken one at a time, as before gang locks.

    torchrun --nproc-per-node 2 bench/gang_job.py OUT JOB [lone]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

SIZE = 8192  # matmul side: ~1.1 TFLOP a step
REDUCE = 8 << 20  # elements all-reduced per step (16 MiB of bf16)


def main(out_dir: str, job: str, lone: bool) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    if lone:  # read by the hook when CUDA starts, below
        os.environ["NVSHARE_GANG"] = f"{job}-rank{rank}-{os.getpid()}"
    with open(os.path.join(out_dir, f"{job}-rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")  # torchrun's workers outlive a killed torchrun
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    with open(os.path.join(out_dir, f"{job}-rank{rank}.steps"), "w", buffering=1) as out:
        while True:
            c = a @ b
            dist.all_reduce(c.view(-1)[:REDUCE])
            torch.cuda.synchronize()
            out.write(f"{time.time():.6f}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["lone"])
