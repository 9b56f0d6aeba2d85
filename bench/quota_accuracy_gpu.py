"""Compute-quota accuracy on a real GPU: the throughput a client with a quota gets, relative to
the same work alone and unlimited, per scenario, at the shipped defaults (a 500 ms window, all
of an overshoot carried as debt).

Real daemon, real hook, real GPU (the CPU counterpart on the fake driver is quota_accuracy.py).
Workloads, each a process that waits for "go" and then works as fast as the lock lets it:
`torch` (tests/gpu/torch_worker.py: 4096x4096 fp32 matmuls, 5 per synchronise), `torch graph`
(a torch.cuda.graph of 10 of them, replayed twice per synchronise: a deep queue when a drop
comes), `cuda` (tests/gpu/programs.cu: a compute-bound FMA kernel of about 1 ms per
synchronise) and `cuda graph` (a CUDA graph of 20 such kernels, launched twice per synchronise).
A client's throughput is the work it completed (synchronises, a partly covered one in
proportion) in whole windows after the first two; over whole windows the count does not depend
on where the quota's windows start. Its share is that over what the same work alone and
unlimited completes in the same time. NVML's SM clock is sampled during each measurement: a GPU
that is busy a quarter of the time may run at a higher clock than one busy all of it, and
then does more than its share of work in its share of time.

    bash tests/gpu/run.sh quota_table      # on the GPU machine: builds, then runs this
    python3 bench/quota_accuracy_gpu.py [--windows 16] [--window S] [--scenario "alone 25" ...]

`--window` sets `scheduler.computeWindow` (and the windows measured) to S seconds instead of the
default: a cost paid at each hand-off shrinks with longer windows, one paid while holding does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from _daemon import BenchDaemon, gpus

from appliance.policy.model import SchedulerSettings

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
PROGRAMS = os.environ.get("NVSHARE_GPU_PROGRAMS", "/tmp/nvshare-programs")
WORKER = ROOT / "tests" / "gpu" / "torch_worker.py"
WINDOW_S = SchedulerSettings().compute_window_s
WARM_WINDOWS = 2
WORKLOADS = {
    "torch": [sys.executable, str(WORKER), "quota", "loop"],
    "torch graph": [sys.executable, str(WORKER), "quota", "graph"],
    "cuda": [PROGRAMS, "quota", "loop"],
    "cuda graph": [PROGRAMS, "quota", "graph"],
}
# (scenario, workload, the clients' core limits)
SCENARIOS: list[tuple[str, str, tuple[int, ...]]] = [
    *((f"{w} alone {x}", w, (x,)) for w in ("torch", "cuda") for x in (25, 50, 75)),
    *((f"{w} two {a}/{b}", w, (a, b)) for w in ("torch", "cuda") for a, b in ((25, 75), (30, 70))),
    ("torch graph 30", "torch graph", (30,)),
    ("cuda graph 30", "cuda graph", (30,)),
]


@dataclass(frozen=True)
class Row:
    scenario: str
    limit: int
    share: float  # of the same work alone and unlimited
    sm_clock_mhz: float  # mean over the measurement; the unlimited run's is in `alone_clock`
    alone_clock_mhz: float


@dataclass(frozen=True)
class Measured:
    work: dict[int, float]  # synchronises completed per client (by limit)
    sm_clock_mhz: float


class ClockSampler:
    """NVML's SM clock of GPU 0, every 50 ms, from `start` until `stop`."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            clock = self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)
            self._samples.append(int(clock))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return statistics.fmean(self._samples) if self._samples else 0.0


def completed(batches: list[tuple[float, float]], begin: float, end: float) -> float:
    """Synchronises completed within [begin, end), a partly covered one in proportion."""
    done = 0.0
    for t0, t1 in batches:
        if t1 > t0:
            done += max(0.0, min(t1, end) - max(t0, begin)) / (t1 - t0)
    return done


def _tail(errors: IO[str]) -> str:
    errors.seek(0)
    return errors.read()[-2000:]


def run_clients(
    d: BenchDaemon, workload: str, limits: tuple[int, ...], windows: int, window_s: float
) -> Measured:
    seconds = (WARM_WINDOWS + windows) * window_s + 0.5
    errors = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and stall a client
    procs = {}
    for limit in limits:
        env = {**os.environ, "LD_PRELOAD": str(HOOK), "NVSHARE_SOCKET_DIR": str(d.socket_dir)}
        if limit < 100:
            env["NVSHARE_GPU_CORE_LIMIT"] = str(limit)
        procs[limit] = subprocess.Popen(
            [*WORKLOADS[workload], str(seconds)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    for limit, proc in procs.items():
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith("ready"):
            proc.wait(60)
            raise RuntimeError(f"{workload} at {limit}% did not start: {_tail(errors)}")
    start = time.monotonic()
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    begin = start + WARM_WINDOWS * window_s
    clock = ClockSampler()
    time.sleep(max(0.0, begin - time.monotonic()))
    clock.start()
    time.sleep(windows * window_s)
    mhz = clock.stop()
    work = {}
    for limit, proc in procs.items():
        out, _ = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"{workload} at {limit}% ended {proc.returncode}: {_tail(errors)}")
        batches = [
            (float(t0), float(t1))
            for _, t0, t1 in (line.split() for line in out.splitlines() if line.startswith("b"))
        ]
        work[limit] = completed(batches, begin, begin + windows * window_s)
    return Measured(work, mhz)


def table(names: list[str] | None, windows: int, window_s: float = WINDOW_S) -> list[Row]:
    rows: list[Row] = []
    alone: dict[str, Measured] = {}
    policy = f"scheduler: {{mode: 'on', computeWindow: {window_s:g}s}}"  # the rest at defaults
    d = BenchDaemon(policy, args=["--debug"])  # every grant and drop, for a second look
    try:
        for name, workload, limits in SCENARIOS:
            if names and name not in names:
                continue
            if workload not in alone:
                alone[workload] = run_clients(d, workload, (100,), windows, window_s)
            base = alone[workload]
            got = run_clients(d, workload, limits, windows, window_s)
            for limit in limits:
                share = got.work[limit] / base.work[100]
                rows.append(Row(name, limit, share, got.sm_clock_mhz, base.sm_clock_mhz))
                print(
                    f"  {name} [{limit}]: {share * 100:.1f}% (SM clock {got.sm_clock_mhz:.0f} "
                    f"MHz, unlimited {base.sm_clock_mhz:.0f} MHz)",
                    flush=True,
                )
    finally:
        d.stop()
        if "OUT" in os.environ:
            shutil.copy(d.log, Path(os.environ["OUT"]) / "quota_daemon.log")
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| scenario | limit | measured | error | SM clock (MHz) | unlimited's |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = r.share * 100
        lines.append(
            f"| {r.scenario} | {r.limit} | {measured:.1f} | {measured - r.limit:+.1f} | "
            f"{r.sm_clock_mhz:.0f} | {r.alone_clock_mhz:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=16, help="measured windows per scenario")
    ap.add_argument("--window", type=float, default=WINDOW_S, help="computeWindow, seconds")
    ap.add_argument("--scenario", action="append", help="only these (repeatable)")
    args = ap.parse_args()
    gpu = "\n".join(gpus())
    print(f"GPU: {gpu}; {args.windows} measured windows of {args.window:g} s per scenario")
    rows = table(args.scenario, args.windows, args.window)
    print(markdown(rows))
    out = Path(os.environ.get("OUT", ".")) / "quota_accuracy_gpu.json"
    out.write_text(json.dumps({"gpu": gpu, "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
