"""Fail-soft means any failure: a scheduler that stops answering (it does not die, it hangs) is
treated as gone within NVSHARE_DAEMON_TIMEOUT_MS; a grant is read while a release synchronises;
the daemon's absolute reservation is what the hook keeps; an idle surplus goes back to the pod;
and while the daemon is away, a pod's processes share its limit instead of each taking all of it.
"""

from __future__ import annotations

import struct
import time

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean, holder_and_waiter

MiB = 1 << 20
OOM = "err 2"


def test_a_scheduler_that_stops_answering_is_treated_as_gone(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, chunk=16 * MiB) as sched:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_DAEMON_TIMEOUT_MS="500")
        p = start_probe(variant, env)
        p.ok("init")
        p.ok("launch 1")
        p.ok(f"alloc mem {2 * MiB}")
        sched.silent.set()  # alive, listening, but answering nothing: like SIGSTOP
        p.ok(f"alloc mem {64 * MiB}")  # its reservation is never answered: decided locally
        p.ok("launch 5")
        grants = sched.count(MsgType.LOCK_GRANT)
        sched.silent.clear()  # answering again: the hook registers anew and gating resumes
        deadline = time.monotonic() + 20
        while sched.count(MsgType.LOCK_GRANT) == grants:
            assert time.monotonic() < deadline, "gating did not resume"
            p.ok("launch 1")
            time.sleep(0.05)
        rc, err = p.finish()
        assert_clean(rc, err)
        notices = [line for line in err.splitlines() if line.startswith("nvshare: ")]
        assert len(notices) == 1, notices
        assert "stopped answering" in notices[0] or "did not answer a memory" in notices[0]


def test_a_waiter_stops_waiting_when_the_scheduler_hangs(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # mode on, no quantum: only the hang can free the waiter
    with fs.FakeScheduler(sock_dir) as sched:
        env = plain.env(
            NVSHARE_SOCKET_DIR=sock_dir,
            NVSHARE_DAEMON_TIMEOUT_MS="500",
            NVSHARE_IDLE_RELEASE_MS="3600000",
        )
        holder, waiter = holder_and_waiter(start_probe, plain, env)
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_REQUEST) == 2)
        sched.silent.set()
        assert waiter.answer() == "ok"  # its heartbeat went unanswered
        rc, err = waiter.finish()
        assert_clean(rc, err)
        assert "the nvshare scheduler stopped answering" in err
        sched.silent.clear()
        assert_clean(*holder.finish())


def test_a_grant_is_read_while_a_release_synchronises(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, tq_s=0.1, chunk=16 * MiB) as sched:
        env = variant.env(
            NVSHARE_SOCKET_DIR=sock_dir,
            NVSHARE_FAKE_LAUNCH_US="50000",
            NVSHARE_IDLE_RELEASE_MS="3600000",
        )
        a, b = start_probe(variant, env), start_probe(variant, env)
        a.ok("init")
        b.ok("init")
        a.ok("launch 1")
        a.ok("queue_on 0 40")  # 2 s of queued work: a release has to wait for it
        b.send("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_DROP) == 1)
        a.ok(f"alloc mem {64 * MiB}")  # needs a MEM_GRANT while the drainer synchronises
        assert sched.count(MsgType.LOCK_RELEASED) == 0  # answered before the release went out
        for p in (a, b):
            assert_clean(*p.finish())


def test_the_hook_keeps_the_reservation_the_daemon_reports(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, chunk=16 * MiB) as sched:
        sched.grant_reserved_extra = 16 * MiB  # the daemon's ledger holds more than this grant
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok(f"alloc mem {2 * MiB}")  # granted 16 MiB; the daemon says 32 MiB are reserved

        def returns() -> list[tuple[int, ...]]:
            return [f for _, t, f in sched.events if t == MsgType.MEM_RETURN and f[0] > 0]

        assert sched.wait_for(lambda: returns())  # idle: the surplus goes back
        assert returns()[0] == (30 * MiB, 2 * MiB)  # the daemon's 32, not the grant's 16
        assert sched.total_reserved() == 2 * MiB
        assert_clean(*p.finish())


def test_an_idle_surplus_goes_back_to_the_pod(plain: Variant, start_probe, sock_dir: str) -> None:
    with fs.FakeScheduler(sock_dir, chunk=64 * MiB, pod_limit=64 * MiB):
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir)
        a, b = start_probe(plain, env), start_probe(plain, env)
        a.ok("init")
        b.ok("init")
        held = a.ok(f"alloc mem {48 * MiB}").split()[1]  # a reserves the whole 64 MiB
        a.ok(f"free {held}")
        assert b.do(f"alloc mem {32 * MiB}") == OOM  # still reserved by a ...
        b.eventually(f"alloc mem {32 * MiB}", "ok")  # ... until a's idle surplus went back
        for p in (a, b):
            assert_clean(*p.finish())


def test_while_unreachable_a_pods_processes_share_its_limit(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    for processes, room in ((2, 32), (1, 64)):
        sched = fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=64 * MiB), chunk=8 * MiB)
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok(f"alloc mem {8 * MiB}")
        if processes > 1:
            sched.send_raw(MsgType.LEDGER_PEERS, struct.pack("<II", processes, 0))
            p.eventually("sleep 1", "ok")  # (the frame is read by the hook's reader)
            time.sleep(0.2)
        sched.stop()  # the daemon is gone
        p.ok(f"alloc mem {(room - 8) * MiB}")
        assert p.do(f"alloc mem {2 * MiB}") == OOM, processes
        assert_clean(*p.finish())
