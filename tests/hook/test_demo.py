"""`make demo` (scripts/demo.py) does what the README's "Try it without a GPU" says."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT
from .test_gate import overlaps


def test_the_demo_shows_two_programs_taking_turns(built: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--seconds", "3", "--quantum", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "holding" in out and "waiting" in out  # status while both compute
    assert "they overlapped 0 times" in out
    bars = [line for line in out.splitlines() if line.startswith(("  A |", "  B |"))]
    assert len(bars) == 2 and all("#" in bar for bar in bars)


def readme_by_hand_block() -> str:
    """The shell block the README gives under "Try it without a GPU", after "By hand"."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("By hand, after `make hook venv`:") :]
    match = re.search(r"```\n(.*?)```", after, re.S)
    assert match is not None
    return match.group(1)


def test_the_readmes_by_hand_demo_as_written_never_overlaps(built: Path) -> None:
    """It used to start the programs before the scheduler listened (hundreds of overlapping
    kernel pairs in the first 0.3 s), gave 1 ms kernels for the 2 ms it promised, and shared
    the metrics port with a running `make run`."""
    block = readme_by_hand_block()
    promised = re.search(r"makes each fake kernel take (\d+) ms", (ROOT / "README.md").read_text())
    assert promised is not None
    busy = socket.socket()  # a `make run` already serving metrics
    try:
        busy.bind(("0.0.0.0", 9402))
        busy.listen()
    except OSError:
        pass  # something here holds it already: the same test
    # After the block as written: wait for both programs (jobs 2 and 3), stop the scheduler.
    epilogue = 'wait %2 %3; kill %1; wait %1; echo "TRACE $D/trace"\n'
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVSHARE_")}
    done = subprocess.run(
        ["bash", "-c", block + epilogue],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    busy.close()
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    trace = Path(out.split("TRACE ")[-1].split()[0])
    try:
        kernels = [tuple(map(int, line.split())) for line in trace.read_text().splitlines()]
    finally:
        shutil.rmtree(trace.parent, ignore_errors=True)
    assert len(done.stdout.splitlines()) > 1  # the status the block asks for was answered
    assert "cannot serve" not in out and "Traceback" not in out
    by_program: dict[int, list[tuple[int, int]]] = {}
    for pid, _device, start, end in kernels:
        by_program.setdefault(pid, []).append((start, end))
    assert len(by_program) == 2, by_program.keys()
    a, b = by_program.values()
    assert overlaps(a, b) == 0
    assert min(end - start for _, _, start, end in kernels) >= int(promised.group(1)) * 1_000_000
