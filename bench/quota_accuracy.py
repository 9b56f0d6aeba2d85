"""Compute-quota accuracy against the fake driver: the GPU time each client gets, per scenario.

Real daemon, real hook, probe processes on the fake libcuda.so.1, whose kernels run on a worker
thread for NVSHARE_FAKE_LAUNCH_US each and are traced (start and end, per process). A client
launches batches of kernels and synchronises, as fast as the lock lets it, for the whole run.
Its share is its kernels' busy time over a span, relative to the same work alone and unlimited
over the same span: the first 1 s and the first 8 s from its first kernel (as a user times a
loop), and whole windows in the steady state (after the first two); what a throughput benchmark on a
GPU measures. Workloads: `pytorch` (2-3 ms kernels, 5 per synchronise: a few ms of drain),
`graph` (20-30 ms kernels, 2 per synchronise: up to 60 ms of drain, as a CUDA graph replay),
`kernel` (1-1.2 ms kernels one at a time). Kernel times vary at random, so drops land anywhere
in a batch, as they do on a GPU.

    make -C ld_hook && .venv/bin/python bench/quota_accuracy.py [--before DIR] [--seconds 14]

`--before DIR` runs the same scenarios against the appliance of another checkout (for example
`git worktree add /tmp/before <commit>`) in the same run, side by side. Both run nvshare's quota
fork's settings (window 2 s, sample interval 50 ms, carry-over 25 %, drop-tail billing 70 %),
which the built-in defaults were before 2026-11-27 (now 500 ms and 100 %: README).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _daemon import BenchDaemon, machine

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "ld_hook" / "build"
WINDOW_S = 2.0
POLICY = (
    "scheduler: {mode: 'on', computeWindow: 2s, quotaSampleInterval: 50ms, "
    "carryOverPercent: 25, dropTailBillingPercent: 70}"
)
# kernel time (at least, and up to this much more at random), kernels per synchronise
WORKLOADS = {"pytorch": (2000, 1000, 5), "graph": (20000, 10000, 2), "kernel": (1000, 200, 1)}
SCENARIOS: list[tuple[str, str, tuple[int, ...]]] = [
    ("alone 25", "pytorch", (25,)),
    ("alone 50", "pytorch", (50,)),
    ("alone 75", "pytorch", (75,)),
    ("two 25/75", "pytorch", (25, 75)),
    ("two 30/70", "pytorch", (30, 70)),
    ("graph 30", "graph", (30,)),
    ("kernel 30", "kernel", (30,)),
]


SPANS = ("first 1 s", "first 8 s", "steady")  # what `run_clients` measures each share over


@dataclass(frozen=True)
class Row:
    scenario: str
    limit: int
    share: dict[str, float]  # per span, of the same work alone and unlimited


def run_clients(
    workload: str, limits: tuple[int, ...], seconds: float, tree: Path | None
) -> dict[int, dict[str, float]]:
    """Busy time per client (by limit) over each span: from the start (the first kernel
    launched), and the steady state (whole windows after the first two)."""
    launch_us, jitter_us, batch = WORKLOADS[workload]
    d = BenchDaemon(POLICY, tree=tree)
    trace = Path(tempfile.mkdtemp(prefix="nvs-quota-")) / "trace"
    try:
        procs = {}
        for limit in limits:
            env = {
                **os.environ,
                "LD_PRELOAD": str(BUILD / "libnvshare.so"),
                "LD_LIBRARY_PATH": str(BUILD / "fake"),
                "NVSHARE_SOCKET_DIR": str(d.socket_dir),
                "NVSHARE_FAKE_LAUNCH_US": str(launch_us),
                "NVSHARE_FAKE_LAUNCH_JITTER_US": str(jitter_us),
                "NVSHARE_FAKE_TRACE": str(trace),
            }
            if limit < 100:
                env["NVSHARE_GPU_CORE_LIMIT"] = str(limit)
            procs[limit] = subprocess.Popen(
                [str(BUILD / "probe"), "run"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        start = time.monotonic_ns()
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write(f"init\nlaunchfor {int(seconds * 1000)} {batch}\nquit\n")
            proc.stdin.flush()
        for proc in procs.values():
            proc.communicate(timeout=seconds + 60)
        pids = {proc.pid: limit for limit, proc in procs.items()}
        kernels = [tuple(int(x) for x in line.split()) for line in trace.read_text().splitlines()]
        first = min((t0 for pid, _d, t0, _t1 in kernels if pid in pids), default=start)
        steady = start + int(2 * WINDOW_S * 1e9)
        spans = {
            "first 1 s": (first, first + 10**9),
            "first 8 s": (first, first + 8 * 10**9),
            "steady": (steady, steady + int((int(seconds / WINDOW_S) - 3) * WINDOW_S * 1e9)),
        }
        out: dict[int, dict[str, float]] = {limit: {} for limit in limits}
        for name, (begin, end) in spans.items():
            busy = dict.fromkeys(limits, 0.0)
            for pid, _dev, t0, t1 in kernels:
                if pid in pids:
                    busy[pids[pid]] += max(0, min(t1, end) - max(t0, begin)) / 1e9
            for limit, b in busy.items():
                out[limit][name] = b / ((end - begin) / 1e9)
        return out
    finally:
        d.stop()


def scenarios(seconds: float, tree: Path | None) -> list[Row]:
    rows = []
    alone: dict[str, dict[str, float]] = {}
    for name, workload, limits in SCENARIOS:
        if workload not in alone:
            alone[workload] = run_clients(workload, (100,), seconds, tree)[100]
        busy = run_clients(workload, limits, seconds, tree)
        rows += [
            Row(name, limit, {k: v / alone[workload][k] for k, v in busy[limit].items()})
            for limit in limits
        ]
        print(f"  {name}: " + ", ".join(f"{r.share}" for r in rows[-len(limits) :]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, help="another checkout, run side by side")
    ap.add_argument("--seconds", type=float, default=14.0)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print("this tree:")
    now = scenarios(args.seconds, None)
    before = None
    if args.before:
        print(f"before ({args.before}):")
        before = scenarios(args.seconds, args.before)
    trees = [("", now)] + ([("before, ", before)] if before else [])
    print("| scenario | limit | " + " | ".join(f"{t}{s}" for t, _ in trees for s in SPANS) + " |")
    print("|---|---:|" + "---:|" * len(SPANS) * len(trees))
    for i, r in enumerate(now):
        cells = [f"{rows[i].share[s] * 100:.1f}" for _, rows in trees for s in SPANS]
        print(f"| {r.scenario} | {r.limit} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
