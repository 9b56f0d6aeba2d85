"""The lock is the lock, against the fake driver and a scripted scheduler: no submission reaches
the driver after LOCK_RELEASED even with a slow gate-to-enqueue gap and many submitting threads;
every submission path passes the gate of its stream's GPU; a release drains every context the
process used (more than 32, green ones, the new primary after a reset)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean
from .test_gate import intervals, overlaps

SECOND_GPU = "GPU-10111213-1415-1617-1819-1a1b1c1d1e20"


def launch_pair(a, b, a_cmd: str, b_cmd: str) -> None:  # type: ignore[no-untyped-def]
    for p, cmd in ((a, a_cmd), (b, b_cmd)):
        p.send(cmd)
    for p in (a, b):
        answer = p.answer()
        assert answer.startswith("ok"), (answer, p.stderr())


@pytest.mark.parametrize("load", ["launchfor 1500 4", "threads 4 1500"])
def test_no_kernel_reaches_the_driver_after_release_despite_a_slow_enqueue(
    variant: Variant, start_probe, sock_dir: str, tmp_path: Path, load: str
) -> None:
    # 2 ms inside the driver between the gate and the enqueue: the window a release must close
    with fs.FakeScheduler(sock_dir, tq_s=0.1) as sched:
        trace = tmp_path / "trace"
        env = variant.env(
            NVSHARE_SOCKET_DIR=sock_dir,
            NVSHARE_FAKE_TRACE=str(trace),
            NVSHARE_FAKE_LAUNCH_US="1000",
            NVSHARE_FAKE_SUBMIT_DELAY_US="2000",
        )
        a, b = start_probe(variant, env), start_probe(variant, env)
        for p in (a, b):
            p.ok("init")
        launch_pair(a, b, load, load)
        for p in (a, b):
            assert_clean(*p.finish())
    first, second = intervals(trace).values()
    assert overlaps(first, second) == 0
    assert sched.count(MsgType.LOCK_DROP) >= 4  # the lock really moved back and forth


def test_every_submission_path_waits_for_the_lock(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, auto_grant=False) as sched:
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_IDLE_RELEASE_MS="20")
        p = start_probe(plain, env)
        p.ok("init")
        s = p.ok("stream 0").split()[1]
        names = p.ok("submit list").split()[1:]
        assert len(names) >= 38
        for name in names:
            requests, releases = (
                sched.count(MsgType.LOCK_REQUEST),
                sched.count(MsgType.LOCK_RELEASED),
            )
            p.send(f"submit {name} {s}")
            assert sched.wait_for(lambda n=requests: sched.count(MsgType.LOCK_REQUEST) > n), name
            ready = p.answered(0.05)
            assert not ready, f"{name} reached the driver without the lock"
            sched.grant_waiting()
            assert p.answer() == "ok", name
            # idle: the lock goes back, so the next path has to ask again
            assert sched.wait_for(lambda n=releases: sched.count(MsgType.LOCK_RELEASED) > n), name
        assert_clean(*p.finish())


def test_work_is_gated_on_the_gpu_of_its_stream(plain: Variant, start_probe, sock_dir: str) -> None:
    with fs.FakeScheduler(sock_dir) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_GPU_COUNT="2"))
        p.ok("init")  # the current context is on GPU 0
        s = p.ok("stream 1").split()[1]
        p.ok(f"launch_on {s} 3")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        (client,) = [c for c in sched.clients if sched.holder is c]
        assert client.uuid == SECOND_GPU  # GPU 1's lock, not the current context's GPU 0
        assert_clean(*p.finish())


@pytest.mark.parametrize("where", ["40 contexts", "green context", "after a reset"])
def test_a_release_drains_every_context_the_process_used(
    variant: Variant, start_probe, sock_dir: str, tmp_path: Path, where: str
) -> None:
    with fs.FakeScheduler(sock_dir, tq_s=0.1):
        trace = tmp_path / "trace"
        env = variant.env(
            NVSHARE_SOCKET_DIR=sock_dir,
            NVSHARE_FAKE_TRACE=str(trace),
            NVSHARE_FAKE_LAUNCH_US="2000",
            NVSHARE_IDLE_RELEASE_MS="3600000",
        )
        a, b = start_probe(variant, env), start_probe(variant, env)
        a.ok("init")
        b.ok("init")
        if where == "40 contexts":
            ctxs = [a.ok("ctx_create 0").split()[1] for _ in range(40)]
            s = a.ok(f"ctx_stream {ctxs[-1]}").split()[1]
        elif where == "green context":
            s = a.ok("green 0").split()[1]
        else:
            a.ok("launch 1")
            a.ok("reset 0")
            a.ok("primary 0")  # a new primary context: the one to drain now
            s = "0"  # the legacy stream of the current context
        a.ok("launch 1")  # takes the lock
        a.ok(f"queue_on {s} 100")  # 200 ms of work, not waited for
        b.ok("launch 20")  # asks for the lock: a's drop must wait for that work
        for p in (a, b):
            assert_clean(*p.finish())
    first, second = intervals(trace).values()
    assert overlaps(first, second) == 0
