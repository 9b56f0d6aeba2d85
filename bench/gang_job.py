"""One rank of a 2-GPU data-parallel job for bench/gangs.py, started by torchrun.

SHAPE says what one step is:

  sync  a bf16 matmul, an NCCL all-reduce of part of its result, torch.cuda.synchronize()
        (the shape the first gang benchmark used)
  item  the same matmul and all-reduce, then a one-element all-reduce whose result is read
        with .item() to decide whether to stop: the way a training loop logs its loss
  ddp   a 4-layer bf16 MLP under DistributedDataParallel (gradients all-reduced in buckets
        from a side stream while backward runs), SGD, loss.item()

Rank r writes the wall time at which it was ready to compute (process group up, before any
GPU work) on the first line of OUT/<job>-rank<r>.steps, then the time each step finished,
until it is killed. With `lone`, every rank names a job of its own (NVSHARE_GANG), so the
scheduler treats it as a single-GPU client: per-GPU locks taken one at a time.

    torchrun --nproc-per-node 2 bench/gang_job.py OUT JOB SHAPE [lone]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SIZE = 8192  # matmul side: ~1.1 TFLOP a step
REDUCE = 8 << 20  # elements all-reduced per step (16 MiB of bf16)


def collective_step(read_loss: bool) -> Callable[[], None]:
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    flag = torch.ones(1, device="cuda")

    def step() -> None:
        c = a @ b
        dist.all_reduce(c.view(-1)[:REDUCE])
        if read_loss:
            flag.fill_(c[0, 0].float())
            dist.all_reduce(flag)
            loss = flag.item()
            if loss != loss:  # NaN: a real loop would stop here
                raise SystemExit("loss is NaN")
        else:
            torch.cuda.synchronize()

    return step


def ddp_step(rank: int) -> Callable[[], None]:
    layers = [torch.nn.Linear(4096, 4096) for _ in range(4)]
    model = torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        loss = ddp(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def main(out_dir: str, job: str, shape: str, lone: bool) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    if lone:  # read by the hook when CUDA starts, below
        os.environ["NVSHARE_GANG"] = f"{job}-rank{rank}-{os.getpid()}"
    with open(os.path.join(out_dir, f"{job}-rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")  # torchrun's workers outlive a killed torchrun
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    with open(os.path.join(out_dir, f"{job}-rank{rank}.steps"), "w", buffering=1) as out:
        out.write(f"{time.time():.6f}\n")
        shapes = {
            "sync": lambda: collective_step(False),
            "item": lambda: collective_step(True),
            "ddp": lambda: ddp_step(rank),
        }
        step = shapes[shape]()
        while True:
            step()
            out.write(f"{time.time():.6f}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:] == ["lone"])
