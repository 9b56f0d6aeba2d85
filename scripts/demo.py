"""`make demo`: two programs under the hook share one GPU through the scheduler, on a machine
with no GPU at all.

The programs are the test probe (ld_hook/tests/probe.c) linked against the fake libcuda.so.1 that
the tests use: every kernel "runs" for 2 ms on a background thread, and the fake driver writes
when each one ran to a trace file. Both probes launch kernels as fast as they can for the same
few seconds, with libnvshare.so preloaded, against a scheduler in mode `on` with a short
quantum. The demo prints `nvsharectl status` while they compete, then a timeline from the
trace: the two never run at the same moment, and the lock changes hands every quantum.

    .venv/bin/python scripts/demo.py [--seconds 8] [--quantum 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "ld_hook" / "build"
BIN = Path(sys.executable).parent
WIDTH = 60  # characters of timeline


def start_scheduler(work: Path, quantum: int) -> subprocess.Popen[bytes]:
    sockets = work / "run"  # its control socket goes beside it, in work/run-control
    policy = work / "policy"
    policy.mkdir()
    (policy / "demo.yaml").write_text(
        f"scheduler: {{mode: 'on', timeQuantum: {quantum}s}}\nmetrics: {{enabled: false}}\n"
    )
    log = (work / "scheduler.log").open("wb")
    daemon = subprocess.Popen(
        [str(BIN / "nvshare-scheduler"), "--policy-dir", str(policy), "--socket-dir", str(sockets)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while not (sockets / "scheduler.sock").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"demo: the scheduler did not start:\n{(work / 'scheduler.log').read_text()}")
        time.sleep(0.05)
    return daemon


def start_program(work: Path, name: str, seconds: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "LD_PRELOAD": str(BUILD / "libnvshare.so"),
        "LD_LIBRARY_PATH": str(BUILD / "fake"),
        "NVSHARE_SOCKET_DIR": str(work / "run"),
        "NVSHARE_FAKE_TRACE": str(work / "trace"),
        "NVSHARE_FAKE_LAUNCH_US": "2000",
        "NVSHARE_GPU_MEMORY_LIMIT": "4Gi" if name == "A" else "",
    }
    program = subprocess.Popen(
        [str(BUILD / "probe"), "run"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(work / f"program-{name}.log").open("w"),
        text=True,
    )
    assert program.stdin is not None
    program.stdin.write(f"init\nlaunchfor {int(seconds * 1000)} 4\nquit\n")
    program.stdin.flush()
    return program


def timeline(trace: Path, names: dict[int, str]) -> tuple[list[str], int, int]:
    """A bar per program (# where its kernels ran), the overlapping kernel pairs, hand-offs."""
    runs = sorted(
        (int(start), int(end), int(pid))
        for pid, _, start, end in (line.split() for line in trace.read_text().splitlines())
    )
    first, last = runs[0][0], max(end for _, end, _ in runs)
    step = (last - first) / WIDTH or 1
    bars = {pid: [" "] * WIDTH for pid in names}
    overlaps = handoffs = 0
    busy_until = {pid: 0 for pid in names}
    previous = None
    for start, end, pid in runs:
        overlaps += sum(1 for other, until in busy_until.items() if other != pid and until > start)
        busy_until[pid] = max(busy_until[pid], end)
        handoffs += previous is not None and previous != pid
        previous = pid
        for cell in range(int((start - first) / step), min(WIDTH, int((end - first) / step) + 1)):
            bars[pid][cell] = "#"
    seconds = (last - first) / 1e9
    lines = [f"  {names[pid]} |{''.join(bar)}|" for pid, bar in sorted(bars.items())]
    lines.append(f"     0 s{' ' * (WIDTH - 8)}{seconds:.1f} s")
    return lines, overlaps, handoffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each program computes")
    ap.add_argument("--quantum", type=int, default=2, help="the scheduler's time quantum (s)")
    args = ap.parse_args()
    if not (BUILD / "probe").exists() or not (BUILD / "fake" / "libcuda.so.1").exists():
        sys.exit("demo: build the hook and the fake driver first: make hook")
    work = Path(tempfile.mkdtemp(prefix="nvshare-demo-"))  # short: a socket path has 108 bytes
    daemon = start_scheduler(work, args.quantum)
    try:
        print(f"scheduler running on {work}/run/scheduler.sock, mode on, quantum {args.quantum} s")
        programs = {name: start_program(work, name, args.seconds) for name in "AB"}
        time.sleep(min(1.5, args.seconds / 2))
        print("\n$ nvsharectl status   (while both compute)")
        sys.stdout.flush()
        subprocess.run(
            [str(BIN / "nvsharectl"), "status"],
            env={**os.environ, "NVSHARE_SOCKET_DIR": str(work / "run")},
            check=False,
        )
        counts = {}
        for name, program in programs.items():
            out, _ = program.communicate(timeout=args.seconds + 60)
            answers = out.split()
            counts[name] = answers[2] if len(answers) > 2 else "?"
            if program.returncode != 0:
                sys.exit(f"demo: program {name} failed; see {work}/program-{name}.log")
        names = {program.pid: name for name, program in programs.items()}
        bars, overlaps, handoffs = timeline(work / "trace", names)
        print("\nwhen each program's kernels ran (# = running):")
        print("\n".join(bars))
        print(
            f"\nA launched {counts['A']} kernels, B {counts['B']}; they overlapped {overlaps} "
            f"times and the lock changed hands {handoffs} times."
        )
        print("With mode off (`nvsharectl -S off`) the two bars would run side by side.")
        return 0 if overlaps == 0 and handoffs >= 2 else 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
