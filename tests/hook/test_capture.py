"""Never break a capture: a drop that arrives while a stream capture runs waits for it to end
(the fake driver breaks a capture whose context is synchronised, as CUDA does), a capture that
outlives the quantum is handed over undrained and reported, and recording into a capture needs
no lock."""

from __future__ import annotations

import time

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

CAPTURE_GLOBAL = 0
UNDRAINED = 3


def holder_and_waiter(variant: Variant, start_probe, sock_dir: str):  # type: ignore[no-untyped-def]
    env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_IDLE_RELEASE_MS="3600000")
    a, b = start_probe(variant, env), start_probe(variant, env)
    a.ok("init")
    b.ok("init")
    a.ok("launch 1")  # a holds the lock
    return a, b


def ask_for_the_lock(b) -> None:  # type: ignore[no-untyped-def]
    b.send("launch 1")


def test_a_drop_during_a_capture_waits_for_it_and_the_capture_survives(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, tq_s=0.1) as sched:
        a, b = holder_and_waiter(variant, start_probe, sock_dir)
        s = a.ok("stream 0").split()[1]
        a.ok(f"capture_begin {s} {CAPTURE_GLOBAL}")
        a.ok(f"capture_launch {s} 3")
        ask_for_the_lock(b)
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_DROP) == 1)
        time.sleep(0.3)  # the drop is pending while a keeps capturing
        a.ok(f"capture_launch {s} 3")
        assert sched.count(MsgType.LOCK_RELEASED) == 0
        graph = a.ok(f"capture_end {s}").split()[1]  # not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_RELEASED) == 1)
        released = [f for _, t, f in sched.events if t == MsgType.LOCK_RELEASED]
        assert released == [(0,)]  # drained normally once the capture was over
        assert b.answer() == "ok"
        exe = a.ok(f"instantiate {graph}").split()[1]
        a.ok(f"graph_launch {exe} {s}")  # and the graph runs (a asks for the lock again)
        for p in (a, b):
            assert_clean(*p.finish())


def test_a_capture_that_outlives_the_quantum_is_handed_over_undrained(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, tq_s=0.1) as sched:
        a, b = holder_and_waiter(plain, start_probe, sock_dir)
        s = a.ok("stream 0").split()[1]
        a.ok(f"capture_begin {s} {CAPTURE_GLOBAL}")
        ask_for_the_lock(b)
        # the wait is bounded (a quantum, at least a second): then the lock goes, undrained
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_RELEASED) == 1, timeout=20)
        assert [f for _, t, f in sched.events if t == MsgType.LOCK_RELEASED] == [(UNDRAINED,)]
        a.ok(f"capture_launch {s} 2")  # recording goes on without the lock
        a.ok(f"capture_end {s}")  # and the capture still ends well
        assert b.answer() == "ok"
        rc, err = a.finish()
        assert_clean(rc, err)
        assert err.count("a stream capture outlived the time quantum") == 1
        assert_clean(*b.finish())


def test_recording_into_a_capture_needs_no_lock(plain: Variant, start_probe, sock_dir: str) -> None:
    with fs.FakeScheduler(sock_dir, auto_grant=False) as sched:
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_IDLE_RELEASE_MS="20")
        p = start_probe(plain, env)
        p.ok("init")
        s = p.ok("stream 0").split()[1]
        p.ok(f"capture_begin {s} {CAPTURE_GLOBAL}")
        p.ok(f"capture_launch {s} 5")  # the lock is never granted: recording does not run
        p.ok(f"capture_alloc {s} 1048576")
        p.ok(f"capture_end {s}")
        assert sched.count(MsgType.LOCK_GRANT) == 0
        assert_clean(*p.finish())
