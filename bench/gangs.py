"""Two 2-GPU NCCL jobs sharing two GPUs under the hook in mode `on`, run after run.

Each job is `torchrun --nproc-per-node 2 bench/gang_job.py` with a step SHAPE (`item`: matmul,
all-reduce, a loss read with .item(); `ddp`: DistributedDataParallel with gradient buckets and
loss.item(); `sync`: matmul, all-reduce, torch.cuda.synchronize()), libnvshare.so preloaded
and NCCL_NVLS_ENABLE=0, under one daemon (mode on, time quantum TQ). --runs lists the runs:

  solo:SHAPE        one job alone: the rate the pairs are measured against
  A+B@S             job a of shape A, then S seconds later job b of shape B; each job's ranks
                    hold both GPUs together (gang locks)
  lone:A+B@S        the same, every rank naming a job of its own (NVSHARE_GANG): per-GPU locks
                    taken one at a time, as before gang locks

A pair is measured over WINDOW seconds from SETTLE after the later job's first step (a window
of whole pairs of quanta counts alternating turns exactly). Each job's work is its steps in the
window over its shape's solo rate; reported are the split of that work between the jobs, their
sum (`combined`, 1.0 = one job alone), each job's first step after it was ready to compute
(start-up included) and longest gap between two steps up to the window's end, the daemon's
drop counters, every gang's longest wait from its drop to its next grant (from the daemon's
--debug log; `--waits-from-log FILE` reads a saved one), and how many 50 ms slices of the
window saw steps of both jobs finish (0 when the jobs never overlap). Targets (issue 22,
item 3): split within 50/50 +- 5, combined >= 0.97, no wait beyond TQ + the drop deadline
(5 s). Needs two GPUs, PyTorch with NCCL, the appliance importable (PYTHONPATH) and
ld_hook/build/libnvshare.so built.

    python3 bench/gangs.py [--tq 5] [--window 20] [--settle 1] [--runs solo:item,item+item@0.5]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _daemon import BenchDaemon, gpus

from appliance.cli.client import ControlClient
from appliance.policy.model import SchedulerSettings
from appliance.wire import protocol as p

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
SLICE_S = 0.05


DROP_DEADLINE_S = SchedulerSettings().drop_deadline_s  # the daemon runs with the default
DEFAULT_RUNS = (
    "solo:item,solo:ddp,item+item@0.5,item+item@0,item+item@3,item+item@1,ddp+item@0.5,"
    "item+ddp@0.5,ddp+item@3,ddp+ddp@0.5,ddp+ddp@0,item+ddp@2"
)


def start_job(
    d: BenchDaemon, out: Path, name: str, shape: str, port: int, lone: bool
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "LD_PRELOAD": str(HOOK),
        "NVSHARE_SOCKET_DIR": str(d.socket_dir),
        "NCCL_NVLS_ENABLE": "0",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += [str(ROOT / "bench" / "gang_job.py"), str(out), name, shape]
    log = (out / f"{name}.log").open("w")
    return subprocess.Popen(
        [*cmd, *(["lone"] if lone else [])],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_jobs(jobs: list[subprocess.Popen[bytes]], out: Path) -> None:
    """Kill the ranks by the PIDs they wrote (a job killed mid-quantum is one the daemon must
    survive anyway; torchrun's workers are not in its process group), then torchrun."""
    for pid_file in out.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for j in jobs:
        j.send_signal(signal.SIGTERM)
    for j in jobs:
        try:
            j.wait(10)
        except subprocess.TimeoutExpired:
            j.kill()
            j.wait()


def marks_of(out: Path, name: str, rank: int = 0) -> list[float]:
    """[ready, step end, step end, ...] as the rank wrote them."""
    path = out / f"{name}-rank{rank}.steps"
    if not path.exists():
        return []
    return [float(x) for x in path.read_text().split()]


def counters(d: BenchDaemon) -> dict[str, int]:
    with ControlClient(d.socket_dir) as c:
        doc = c.request(p.StatusRequest()).doc
    return {k: v for k, v in doc["counters"].items() if k.startswith(("drops_", "grants"))}


def longest_gap(marks: list[float], end: float) -> float:
    """The longest time between two steps up to `end` (0 with fewer than two)."""
    kept = [t for t in marks[1:] if t < end] + [end]
    return max((b - a for a, b in itertools.pairwise(kept)), default=0.0)


def waits_in_log(log: str) -> dict[str, float]:
    """From the daemon's --debug log: for each gang, the longest time from its being dropped to
    its next grant (what a job waits for its turn, start-up not included)."""
    stamp = re.compile(r"^(\S+ \S+) DEBUG nvshare\.scheduler: (.*)$")
    gang_of: dict[str, str] = {}
    dropped: dict[str, float] = {}
    longest: dict[str, float] = {}
    current = ""
    for line in log.splitlines():
        m = stamp.match(line)
        if m is None:
            continue
        t = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if g := re.match(r"grant gpus \[.*\] -> gang (\S+)", m[2]):
            current = g[1]
            if current in dropped:
                waited = t - dropped.pop(current)
                longest[current] = max(longest.get(current, 0.0), waited)
        elif c := re.match(r"grant gpu \S+ -> client (\d+)", m[2]):
            gang_of[c[1]] = current
        elif d := re.match(r"drop client (\d+) ", m[2]):
            gang = gang_of.get(d[1], "")
            dropped.setdefault(gang, t)
    return {g: round(w, 2) for g, w in longest.items() if g.startswith("uid:")}


def measure(
    d: BenchDaemon,
    jobs: list[tuple[str, str, float]],
    lone: bool,
    port: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Start `jobs` (name, shape, delay after the first) and measure them over the window.
    Every run's jobs get ports of their own: a job's rendezvous names its gang."""
    out = Path(tempfile.mkdtemp(prefix="nvs-gangs-"))
    before = counters(d)
    procs = []
    try:
        for i, (name, shape, delay) in enumerate(jobs):
            time.sleep(delay)
            procs.append(start_job(d, out, name, shape, port + i, lone))
        deadline = time.time() + args.start_timeout
        while not all(len(marks_of(out, n)) > 1 for n, _, _ in jobs):
            if time.time() > deadline or any(j.poll() is not None for j in procs):
                logs = {n: (out / f"{n}.log").read_text()[-3000:] for n, _, _ in jobs}
                raise RuntimeError(f"a job did not start: {logs}")
            time.sleep(0.1)
        start = max(marks_of(out, n)[1] for n, _, _ in jobs) + args.settle
        end = start + args.window
        time.sleep(max(0.0, end - time.time()) + 0.5)
    finally:
        stop_jobs(procs, out)
    after = counters(d)
    marks = {n: marks_of(out, n) for n, _, _ in jobs}
    steps = {n: [t for t in m[1:] if start <= t < end] for n, m in marks.items()}
    rank1 = {n: len([t for t in marks_of(out, n, 1)[1:] if start <= t < end]) for n in marks}
    slices = [{int((t - start) / SLICE_S) for t in ts} for ts in steps.values()]
    return {
        "shapes": {n: shape for n, shape, _ in jobs},
        "steps": {n: len(ts) for n, ts in steps.items()},
        "steps_rank1": rank1,
        "first_step_s": {n: round(m[1] - m[0], 2) for n, m in marks.items()},
        "longest_gap_s": {n: round(longest_gap(m, end), 2) for n, m in marks.items()},
        "slices_with_both_jobs": len(set.intersection(*slices)) if len(slices) > 1 else 0,
        "slices": int(args.window / SLICE_S),
        "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }


def judge(run: dict[str, Any], solo: dict[str, float], tq: float) -> None:
    """Add each job's work against its shape alone, the split, the sum and the verdicts."""
    work = {n: run["steps"][n] / solo[shape] for n, shape in run["shapes"].items()}
    total = sum(work.values())
    run["work_vs_solo"] = {n: round(w, 4) for n, w in work.items()}
    run["combined"] = round(total, 4)
    run["split_pct"] = [round(100 * w / total, 1) if total else 0.0 for w in work.values()]
    run["fair"] = all(abs(s - 50) <= 5 for s in run["split_pct"])
    run["throughput_ok"] = total >= 0.97
    run["waits_ok"] = max(run["longest_gap_s"].values()) <= tq + DROP_DEADLINE_S


def parse_run(spec: str) -> tuple[bool, list[tuple[str, str, float]]]:
    """`solo:item` -> one job; `[lone:]a+b@s` -> job a, then job b s seconds later."""
    if spec.startswith("solo:"):
        return False, [("solo", spec[5:], 0.0)]
    lone = spec.startswith("lone:")
    pair, _, delay = spec.removeprefix("lone:").partition("@")
    first, second = pair.split("+")
    return lone, [("a", first, 0.0), ("b", second, float(delay or 0))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tq", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--waits-from-log", type=Path, help="only read a saved daemon log's waits")
    args = ap.parse_args()
    if args.waits_from_log is not None:
        print(json.dumps(waits_in_log(args.waits_from_log.read_text()), indent=1))
        return
    d = BenchDaemon(f"scheduler: {{mode: 'on', timeQuantum: {args.tq:g}s}}", args=["--debug"])
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "tq_s": args.tq,
        "window_s": args.window,
        "gpus": gpus()[:2],
        "runs": [],
    }
    solo: dict[str, float] = {}
    try:
        for i, spec in enumerate(args.runs.split(",")):
            lone, jobs = parse_run(spec)
            run = {"run": spec, **measure(d, jobs, lone, 29500 + 10 * i, args)}
            if spec.startswith("solo:"):
                solo[jobs[0][1]] = run["steps"]["solo"]
            elif all(shape in solo for _, shape, _ in jobs):
                judge(run, solo, args.tq)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        d.stop()
        log = d.log.read_text()
        results["waits_after_drop_s"] = waits_in_log(log)
        if args.json:
            args.json.with_suffix(".daemon.log").write_text(log)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    pairs = [r for r in results["runs"] if "fair" in r]
    for key in ("fair", "throughput_ok", "waits_ok"):
        print(f"{key}: {sum(r[key] for r in pairs)} of {len(pairs)} runs")
    longest = max(results["waits_after_drop_s"].values(), default=0.0)
    print(f"longest wait of a gang from its drop to its next grant: {longest} s")


if __name__ == "__main__":
    main()
