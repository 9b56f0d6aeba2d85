"""Gang locks through the real hook and daemon: two data-parallel jobs of two ranks each (one
process per fake GPU, a kernel and a collective per step, like NCCL's all-reduce) share two GPUs
in mode on. Each job holds both GPUs at once, the jobs never overlap, and a drop never leaves a
rank waiting in a collective for a peer stopped before it (the cut)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.conftest import RunningDaemon, start_daemon

from appliance.cli.client import ControlClient
from appliance.wire.protocol import StatusRequest

from .conftest import Variant, assert_clean

STEPS = 1500  # about 5 s of fake kernels per job: several quanta of 1 s


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    where = Path(tempfile.mkdtemp(prefix="nvs-g-"))  # short: the socket path must fit
    d = start_daemon(where, "scheduler: {mode: 'on', timeQuantum: 1s, dropDeadline: 10s}\n")
    yield d
    d.stop()
    shutil.rmtree(where, ignore_errors=True)


def start_job(start_probe, variant: Variant, d: RunningDaemon, name: str, **env: str):  # type: ignore[no-untyped-def]
    """Two ranks of job `name`, rank r on fake GPU r; their collectives meet in a directory."""
    meet = d.socket_dir.parent / f"meet-{name}"
    meet.mkdir()
    ranks = []
    for rank in (0, 1):
        p = start_probe(
            variant,
            variant.env(
                NVSHARE_SOCKET_DIR=str(d.socket_dir),
                NVSHARE_FAKE_GPU_COUNT="2",
                NVSHARE_FAKE_TRACE=str(d.socket_dir.parent / "trace"),
                NVSHARE_FAKE_COLLECTIVE_DIR=str(meet),
                NVSHARE_FAKE_COLLECTIVE_RANKS="2",
                **env,
            ),
        )
        p.ok("init")
        p.ok(f"primary {rank}")
        ranks.append(p)
    return ranks


def kernels(trace: Path) -> dict[int, list[tuple[int, int, int]]]:
    """Per pid: (start, end, device) of every kernel it ran."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for line in trace.read_text().splitlines():
        pid, dev, start, end = (int(x) for x in line.split())
        out.setdefault(pid, []).append((start, end, dev))
    return out


def status(d: RunningDaemon) -> dict:  # type: ignore[type-arg]
    with ControlClient(d.socket_dir) as c:
        return c.request(StatusRequest()).doc  # type: ignore[no-any-return]


@pytest.mark.parametrize("every", [1, 4], ids=["synchronised-each-step", "running-ahead"])
def test_two_gangs_take_turns_with_both_gpus(
    variant: Variant, start_probe, daemon: RunningDaemon, every: int
) -> None:
    jobs = {name: start_job(start_probe, variant, daemon, name, NVSHARE_GANG=name) for name in "ab"}
    # Job a's ranks ask first and make it a gang. (Started at the same moment, a rank of each
    # job could be granted a GPU as a lone client before its job is known to be a gang, and run
    # beside the other job until then: tests/core/test_gang.py shows how that untangles.)
    for p in jobs["a"]:
        p.ok("launch 1")
    for p in itertools.chain(*jobs.values()):
        assert p.proc.stdin is not None
        p.proc.stdin.write(f"train {STEPS} {every}\n")
        p.proc.stdin.flush()
    steps = {name: [int(p.answer().split()[1]) for p in ranks] for name, ranks in jobs.items()}
    assert steps == {"a": [STEPS, STEPS], "b": [STEPS, STEPS]}
    doc = status(daemon)
    assert doc["counters"].get("drops_overdue", 0) == 0  # every drop met its cut in time
    for p in itertools.chain(*jobs.values()):
        assert_clean(*p.finish())
    by_pid = kernels(daemon.socket_dir.parent / "trace")
    job_of = {p.proc.pid: name for name, ranks in jobs.items() for p in ranks}
    spans = {
        name: [k for pid, ks in by_pid.items() if job_of[pid] == name for k in ks] for name in "ab"
    }
    # both ranks of a job ran on their own GPU, and the two jobs never ran at the same time
    assert {dev for pid, ks in by_pid.items() for _, _, dev in ks} == {0, 1}
    merged = sorted(
        [(s, e, "a") for s, e, _ in spans["a"]] + [(s, e, "b") for s, e, _ in spans["b"]]
    )
    last_end = {"a": 0, "b": 0}
    turns = 0
    for i, (s, e, who) in enumerate(merged):
        other = "b" if who == "a" else "a"
        assert s >= last_end[other], "the two gangs' kernels overlapped"
        last_end[who] = max(last_end[who], e)
        turns += i > 0 and merged[i - 1][2] != who
    assert turns >= 2  # the GPUs changed hands (at a quantum, or idle while the other waited)


def test_a_gang_member_reports_its_job_and_status_shows_the_gang(
    plain: Variant, start_probe, daemon: RunningDaemon
) -> None:
    ranks = start_job(
        start_probe, plain, daemon, "solo", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
    for p in ranks:
        p.ok("launch 1")
    gangs = {
        c["gang"] for c in status(daemon)["clients"] if c["pid"] in {p.proc.pid for p in ranks}
    }
    assert gangs == {f"uid:{os.getuid()}:torch/@127.0.0.1:29500"}
