"""Two 2-GPU NCCL jobs sharing two GPUs under the hook in mode `on`, against one job alone.

Each job is `torchrun --nproc-per-node 2 bench/gang_job.py` (matmul + all-reduce + sync per
step) with libnvshare.so preloaded and NCCL_NVLS_ENABLE=0, under one daemon (mode on, time
quantum TQ). Phases, one after the other, each measured over the same window of WINDOW seconds
that starts SETTLE seconds after the last job's first step:

  solo   one job alone
  gangs  two jobs at once; each job's ranks hold both GPUs together (gang locks)
  lone   two jobs at once, every rank naming a job of its own (NVSHARE_GANG): per-GPU locks
         taken one at a time, as before gang locks

It reports steps per job in the window, the two jobs' combined steps against the solo job's,
the split between them, the daemon's drop counters, and how many 50 ms slices of the window saw
steps of both jobs finish (0 when the jobs never overlap). Needs two GPUs, PyTorch with NCCL,
the appliance importable (PYTHONPATH) and ld_hook/build/libnvshare.so built.

    python3 bench/gangs.py [--tq 5] [--window 40] [--settle 5] [--phases solo,gangs,lone]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import BenchDaemon

from appliance.cli.client import ControlClient
from appliance.wire import protocol as p

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
SLICE_S = 0.05


def start_job(
    d: BenchDaemon, out: Path, name: str, port: int, lone: bool
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
    cmd += [str(ROOT / "bench" / "gang_job.py"), str(out), name, *(["lone"] if lone else [])]
    log = (out / f"{name}.log").open("w")
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop_jobs(jobs: list[subprocess.Popen[bytes]], out: Path) -> None:
    """torchrun stops its workers on SIGTERM; any rank still alive after that is killed by the
    PID it wrote (workers are not in torchrun's process group)."""
    for j in jobs:
        j.send_signal(signal.SIGTERM)
    for j in jobs:
        try:
            j.wait(10)
        except subprocess.TimeoutExpired:
            j.kill()
            j.wait()
    for pid_file in out.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def steps_of(out: Path, name: str, rank: int = 0) -> list[float]:
    path = out / f"{name}-rank{rank}.steps"
    if not path.exists():
        return []
    return [float(x) for x in path.read_text().split()]


def counters(d: BenchDaemon) -> dict[str, int]:
    with ControlClient(d.socket_dir) as c:
        doc = c.request(p.StatusRequest()).doc
    return {k: v for k, v in doc["counters"].items() if k.startswith(("drops_", "grants"))}


def phase(
    d: BenchDaemon, names: list[str], lone: bool, port: int, args: argparse.Namespace
) -> dict[str, object]:
    """Every phase's jobs get ports of their own: a job's rendezvous names its gang."""
    out = Path(tempfile.mkdtemp(prefix="nvs-gangs-"))
    before = counters(d)
    jobs = [start_job(d, out, n, port + i, lone) for i, n in enumerate(names)]
    try:
        deadline = time.time() + args.start_timeout
        while not all(steps_of(out, n) for n in names):
            if time.time() > deadline or any(j.poll() is not None for j in jobs):
                logs = {n: (out / f"{n}.log").read_text()[-3000:] for n in names}
                raise RuntimeError(f"a job did not start: {logs}")
            time.sleep(0.2)
        start = time.time() + args.settle
        end = start + args.window
        time.sleep(end - time.time() + 0.5)
    finally:
        stop_jobs(jobs, out)
    after = counters(d)
    steps = {n: [t for t in steps_of(out, n) if start <= t < end] for n in names}
    rank1 = {n: len([t for t in steps_of(out, n, 1) if start <= t < end]) for n in names}
    slices = [{int((t - start) / SLICE_S) for t in ts} for ts in steps.values()]
    both = len(set.intersection(*slices)) if len(slices) > 1 else 0
    return {
        "steps": {n: len(ts) for n, ts in steps.items()},
        "steps_rank1": rank1,
        "slices_with_both_jobs": both,
        "slices": int(args.window / SLICE_S),
        "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tq", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=40.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--phases", default="solo,gangs,lone")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    d = BenchDaemon(f"scheduler: {{mode: 'on', timeQuantum: {args.tq:g}s}}", args=["--debug"])
    results: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "tq_s": args.tq,
        "window_s": args.window,
        "gpus": subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")[:2],
    }
    try:
        for i, name in enumerate(args.phases.split(",")):
            names = ["solo"] if name == "solo" else [f"{name}-a", f"{name}-b"]
            results[name] = r = phase(d, names, name == "lone", 29500 + 10 * i, args)
            print(name, json.dumps(r), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        d.stop()
        if args.json:
            args.json.with_suffix(".daemon.log").write_text(d.log.read_text())
    solo = results.get("solo")
    for name in ("gangs", "lone"):
        pair = results.get(name)
        if isinstance(solo, dict) and isinstance(pair, dict):
            a, b = pair["steps"].values()
            if not a + b:
                continue
            pair["combined_vs_solo"] = round((a + b) / solo["steps"]["solo"], 4)
            pair["split"] = [round(a / (a + b), 4), round(b / (a + b), 4)]
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
