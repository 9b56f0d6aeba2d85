"""Two ordinary PyTorch training loops on one GPU, mode `on`, TQ 5 s: do they take turns?

Each loop: ten 4096x4096 fp16 matmuls, then one of the ways a training loop waits for its step
(`--shapes`):
    item    loss = c.float().mean().item()      (a blocking copy to pageable memory)
    cpu     c.float().mean().cpu()              (likewise)
    event   torch.cuda.Event recorded, then .synchronize()
    pinned  a blocking copy_ of a slice into page-locked host memory
    sync    torch.cuda.synchronize()            (the shape the project's own checks use)
Both workers prepare (CUDA context, tensors, one warm-up step) before either starts; then the
first starts its loop, the second 0.5 s later, each for `--seconds`. With `--cold` they prepare
nothing: the first step of each loop also creates the context and loads cuBLAS and the kernels.
Both start orders are run.
Reported per run: each loop's steps in every 5 s window of the time both ran, the split of the
steps over that time (identical loops: the split of the GPU), each loop's longest wait between
two steps, and the daemon's lock counters. Target: 50/50 +- 5, no wait beyond TQ + the drop
deadline (5 s + 5 s).

    python3 bench/turns.py [--seconds 20] [--shapes item,cpu,event,pinned] [--json OUT] [--hook SO]
    (needs PyTorch and a GPU; run from the repository root after tests/gpu/setup.sh)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _daemon import BenchDaemon, machine, stamp_hook_lines

from appliance.wire.protocol import StatusRequest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
TQ_S = 5.0
DROP_DEADLINE_S = 5.0
STAGGER_S = 0.5
POLICY = "scheduler: {mode: 'on', timeQuantum: 5s}\n"


# ------------------------------------------------------------------ the worker (under the hook)


def _await(go: Path) -> float:
    while not go.exists():
        time.sleep(0.001)
    return time.monotonic()


def _step(shape: str) -> Callable[[], None]:
    """One step of the loop, ending in its way of waiting for the GPU."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    pinned = torch.empty(4096, dtype=torch.float16, pin_memory=True)
    event = torch.cuda.Event()
    waits: dict[str, Callable[[Any], object]] = {
        "item": lambda c: c.float().mean().item(),
        "cpu": lambda c: c.float().mean().cpu(),
        "event": lambda c: (event.record(), event.synchronize()),
        "pinned": lambda c: pinned.copy_(c[0]),
        "sync": lambda c: torch.cuda.synchronize(),
    }
    wait = waits[shape]

    def step() -> None:
        c = a
        for _ in range(10):
            c = torch.matmul(a, b)
        wait(c)

    return step


def worker(shape: str, seconds: float, cold: bool, ready: Path, go: Path, out: Path) -> None:
    marks: dict[str, float] = {}
    if cold:  # nothing done before the start: CUDA, cuBLAS and the kernels load in the loop
        ready.touch()
        start = _await(go)
        step = _step(shape)
        marks["prepared"] = time.monotonic()  # torch imported, the context and tensors made
    else:
        step = _step(shape)
        step()  # warm-up: cuBLAS, kernels loaded, the wait done once
        ready.touch()
        start = _await(go)
    ends = []
    while time.monotonic() - start < seconds:
        step()
        ends.append(time.monotonic())
    out.write_text(json.dumps({"start": start, "ends": ends, "marks": marks}))


# ------------------------------------------------------------------ the driver


def run_pair(
    shape: str, seconds: float, order: tuple[str, str], hook: Path, cold: bool, trace: bool = False
) -> dict[str, Any]:
    """Workers a and b prepare together; order[0] starts its loop first, order[1] 0.5 s later.
    Their results as first and second; with `trace`, also the hooks' debug lines and the
    daemon's log, timed (`timeline`)."""
    daemon = BenchDaemon(POLICY, args=["--debug"] if trace else None)
    tmp = Path(tempfile.mkdtemp(prefix="nvs-turns-"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "LD_PRELOAD": str(hook),
        "NVSHARE_SOCKET_DIR": str(daemon.socket_dir),
        **({"NVSHARE_DEBUG": "1"} if trace else {}),
    }
    names = ("a", "b")
    procs = {}
    lines: dict[str, list[tuple[float, str]]] = {n: [] for n in names}
    try:
        for n in names:
            procs[n] = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "worker",
                    shape,
                    str(seconds),
                    str(int(cold)),
                    str(tmp / n),
                ],
                env=env,
                stderr=subprocess.PIPE if trace else None,
            )
            stamp_hook_lines(procs[n], lines[n], time.monotonic)  # (traced: the workers' clock)
        deadline = time.monotonic() + 180
        while not all((tmp / f"{n}.ready").exists() for n in names):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"workers did not start: {[p.poll() for p in procs.values()]}")
            time.sleep(0.01)
        (tmp / f"{order[0]}.go").touch()
        time.sleep(STAGGER_S)
        (tmp / f"{order[1]}.go").touch()
        for p in procs.values():
            p.wait(seconds + 120)
        res: dict[str, Any] = {
            role: json.loads((tmp / f"{n}.json").read_text())
            for role, n in zip(("first", "second"), order, strict=True)
        }
        with daemon.control() as c:
            counters = c.request(StatusRequest()).doc["counters"]
        res["lock"] = {
            k: v for k, v in counters.items() if k.startswith(("grants", "drops", "releases"))
        }
        if trace:
            t0 = res["first"]["start"]
            res["timeline"] = {
                role: [(round(t - t0, 4), text) for t, text in lines[n] if "nvshare" in text]
                for role, n in zip(("first", "second"), order, strict=True)
            }
            res["timeline"]["daemon"] = daemon.log.read_text().splitlines()[-400:]
        return res
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        daemon.stop()


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Steps per TQ window over the time both ran, the split, and the longest waits."""
    first, second = res["first"], res["second"]
    both_from = max(first["start"], second["start"])
    both_to = min(first["ends"][-1] if first["ends"] else both_from, second["ends"][-1])
    span = max(0.0, both_to - both_from)
    windows = max(1, int(span // TQ_S + (1 if span % TQ_S > 0.5 else 0)))
    out: dict[str, Any] = {"both_ran_s": round(span, 2), "lock": res["lock"]}
    if "timeline" in res:
        out["timeline"] = res["timeline"]
        out["marks"] = {
            name: {k: round(v - first["start"], 3) for k, v in res[name]["marks"].items()}
            | {"start": round(res[name]["start"] - first["start"], 3)}
            | {
                "first_step": round(res[name]["ends"][0] - first["start"], 3)
                if res[name]["ends"]
                else None
            }
            for name in ("first", "second")
        }
    counts = {}
    for name in ("first", "second"):
        ends = [t for t in res[name]["ends"] if both_from <= t <= both_to]
        counts[name] = len(ends)
        out[f"{name}_per_window"] = [
            sum(1 for t in ends if both_from + i * TQ_S <= t < both_from + (i + 1) * TQ_S)
            for i in range(windows)
        ]
        marks = [res[name]["start"], *res[name]["ends"]]
        out[f"{name}_longest_wait_s"] = round(
            max((y - x for x, y in itertools.pairwise(marks)), default=0.0), 2
        )
        out[f"{name}_steps_total"] = len(res[name]["ends"])
    total = counts["first"] + counts["second"]
    out["split"] = [
        round(100 * counts["first"] / total, 1) if total else 0.0,
        round(100 * counts["second"] / total, 1) if total else 0.0,
    ]
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        shape, seconds, cold, base = sys.argv[2], float(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
        worker(
            shape,
            seconds,
            cold == "1",
            base.with_suffix(".ready"),
            base.with_suffix(".go"),
            base.with_suffix(".json"),
        )
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--shapes", default="item,cpu,event,pinned")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cold", action="store_true", help="no warm-up: each loop starts cold")
    ap.add_argument("--hook", type=Path, default=HOOK, help="another build, e.g. an older commit's")
    ap.add_argument(
        "--trace", action="store_true", help="keep the hooks' and the daemon's debug lines, timed"
    )
    ap.add_argument("--orders", default="ab,ba", help="which loop starts first, e.g. ab")
    args = ap.parse_args()
    report: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for shape in args.shapes.split(","):
        # The loops are identical: the one that starts first holds the GPU when the other arrives.
        for first, second in args.orders.split(","):
            order = (first, second)
            s = summarise(run_pair(shape, args.seconds, order, args.hook, args.cold, args.trace))
            report[f"{shape}/{order[0]}_first"] = s
            brief = {k: v for k, v in s.items() if k != "timeline"}
            print(f"{shape:7s} {order[0]} first: {json.dumps(brief)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
