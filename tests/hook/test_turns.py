"""Two training loops of the shape every PyTorch loop has, under the real daemon: each step
launches its kernels and then reads its loss with `.item()`, a blocking copy to pageable host
memory. While one holds the GPU the other waits, so the holder's idle window is the short
hand-off; its thread spends most of each step inside that copy. They must still take turns of a
whole quantum each, whichever starts first, instead of handing the GPU over at every step."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.conftest import RunningDaemon, start_daemon

from .conftest import Variant, assert_clean
from .test_gate import intervals

KERNELS_PER_STEP = 2
RUN_MS = 4000
KERNEL_US = {"long": 20_000, "short": 10_000}  # two different loops


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    where = Path(tempfile.mkdtemp(prefix="nvs-t-"))  # short: the socket path must fit
    d = start_daemon(where, "scheduler: {mode: 'on', timeQuantum: 1s}\n")
    yield d
    d.stop()
    shutil.rmtree(where, ignore_errors=True)


def turns(trace: Path) -> list[tuple[int, int]]:
    """(pid, steps) for each run of consecutive work of one process on the GPU."""
    work = sorted((start, pid) for pid, runs in intervals(trace).items() for start, _ in runs)
    per_step = KERNELS_PER_STEP + 1  # the copy runs on the GPU too
    return [
        (pid, len(list(run)) // per_step) for pid, run in itertools.groupby(work, lambda w: w[1])
    ]


@pytest.mark.parametrize("first", ["long", "short"])
def test_item_loops_take_turns_of_a_quantum_in_either_start_order(
    plain: Variant, start_probe, daemon: RunningDaemon, first: str
) -> None:
    trace = daemon.socket_dir.parent / "trace"
    order = [first, "short" if first == "long" else "long"]
    probes = {}
    for name in order:
        env = plain.env(
            NVSHARE_SOCKET_DIR=str(daemon.socket_dir),
            NVSHARE_FAKE_TRACE=str(trace),
            NVSHARE_FAKE_LAUNCH_US=str(KERNEL_US[name]),
        )
        probes[name] = p = start_probe(plain, env)
        p.ok("init")
        p.send(f"stepfor {RUN_MS} {KERNELS_PER_STEP}")
        time.sleep(0.3)  # the second starts while the first holds the GPU
    for p in probes.values():
        assert p.answer().startswith("ok"), p.stderr()
    got = turns(trace)
    pids = {name: p.proc.pid for name, p in probes.items()}
    for name, pid in pids.items():
        whole = [steps for who, steps in got if who == pid and steps >= 3]
        assert len(whole) >= 2, f"{name} ran in no whole turn of its own: {got}"
    # Only where a loop starts or ends may a turn be cut short.
    assert sum(1 for _, steps in got if steps < 3) <= 3, got
    for p in probes.values():
        assert_clean(*p.finish())
    assert "Traceback" not in daemon.output()
