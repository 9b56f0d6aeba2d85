"""The hook's side of the scheduler protocol, against a scripted fake scheduler: lazy start,
registration, serialised kernels in mode on, free-running in mode off, quantum hand-over, idle
release, fail-soft without or after losing the daemon, reconnection, and fork."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.wire.protocol import LockTerms, MsgType, Result, Status, WireMode

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

MiB = 1 << 20


def intervals(trace: Path) -> dict[int, list[tuple[int, int]]]:
    by_pid: dict[int, list[tuple[int, int]]] = {}
    for line in trace.read_text().splitlines():
        pid, _dev, start, end = (int(x) for x in line.split())
        by_pid.setdefault(pid, []).append((start, end))
    return by_pid


def overlaps(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    merged = sorted([(s, e, 0) for s, e in a] + [(s, e, 1) for s, e in b])
    count, last_end = 0, [0, 0]
    for s, e, who in merged:
        if s < last_end[1 - who]:
            count += 1
        last_end[who] = max(last_end[who], e)
    return count


def test_a_process_that_never_calls_cuinit_stays_asleep(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_DEBUG="1")
    p = start_probe(plain, env, "no-cuinit")
    rc, err = p.finish()
    assert rc == 0 and err == ""  # no log line, not even under NVSHARE_DEBUG
    assert sched.events == []  # no connection reached the listening socket


def test_registration_carries_identity_and_env_limits(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    env = plain.env(
        NVSHARE_SOCKET_DIR=sock_dir,
        NVSHARE_GPU_MEMORY_LIMIT="1Gi",
        NVSHARE_POD_NAMESPACE="ml",
        NVSHARE_POD_NAME="trainer-0",
        NVSHARE_FAKE_GPU_UUID="GPU-0123abcd-4567-89ef-0123-456789abcdef",
        NVSHARE_FAKE_GPU_MEM=str(80 << 30),
    )
    p = start_probe(plain, env)
    p.ok("init")
    p.ok("launch 1")
    assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
    (c,) = sched.clients
    assert c.uuid == "GPU-0123abcd-4567-89ef-0123-456789abcdef"
    assert (c.env_mem_limit, c.gpu_total_mem) == (1 << 30, 80 << 30)
    assert c.pod == ("ml", "trainer-0")
    assert c.pid == p.proc.pid
    assert_clean(*p.finish())


def run_pair(
    variant: Variant,
    start_probe,
    sock_dir: str,
    trace: Path,
    ms: int,
    prepare: tuple[str, ...] = (),
) -> None:
    """Two probes launch for `ms` at the same time, after running the `prepare` commands."""
    env = variant.env(
        NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_TRACE=str(trace), NVSHARE_FAKE_LAUNCH_US="2000"
    )
    a, b = start_probe(variant, env), start_probe(variant, env)
    for p in (a, b):
        p.ok("init")
        for command in prepare:
            p.ok(command)
    for p in (a, b):
        assert p.proc.stdin is not None
        p.proc.stdin.write(f"launchfor {ms} 4\n")
        p.proc.stdin.flush()
    for p in (a, b):
        assert p.proc.stdout is not None
        assert p.proc.stdout.readline().startswith("ok"), p.stderr()
    for p in (a, b):
        assert_clean(*p.finish())


def test_mode_on_never_overlaps_and_the_quantum_hands_over(
    variant: Variant, start_probe, sock_dir: str, tmp_path: Path
) -> None:
    sched = fs.FakeScheduler(sock_dir, tq_s=0.2)
    trace = tmp_path / "trace"
    try:
        run_pair(variant, start_probe, sock_dir, trace, 1500)
    finally:
        sched.stop()
    runs = intervals(trace)
    assert len(runs) == 2
    a, b = runs.values()
    assert overlaps(a, b) == 0
    assert sched.count(MsgType.LOCK_DROP) >= 2  # preempted while the other one waited ...
    released = [f for _, t, f in sched.events if t == MsgType.LOCK_RELEASED]
    assert (0,) in released  # ... and handed back with reason DROPPED


def test_mode_off_runs_concurrently(
    plain: Variant, start_probe, sock_dir: str, tmp_path: Path
) -> None:
    sched = fs.FakeScheduler(sock_dir, limits=fs.limits(mode=WireMode.OFF))
    trace = tmp_path / "trace"
    try:
        run_pair(plain, start_probe, sock_dir, trace, 600)
    finally:
        sched.stop()
    a, b = intervals(trace).values()
    assert overlaps(a, b) > 0
    assert sched.count(MsgType.LOCK_REQUEST) == 0  # mode off: never asks for the lock


def test_idle_holder_releases_early(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_IDLE_RELEASE_MS="100")
    p = start_probe(plain, env)
    p.ok("init")
    p.ok("launch 3")
    assert sched.wait_for(
        lambda: any(t == MsgType.LOCK_RELEASED and f == (1,) for _, t, f in sched.events)
    )
    p.ok("launch 1")  # asks again after an early release
    assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 2)
    assert_clean(*p.finish())


@pytest.mark.parametrize("window_us", [10_000, 400])
def test_new_terms_shorten_the_idle_window_of_a_held_lock(
    variant: Variant, start_probe, sock_dir: str, window_us: int
) -> None:
    # Granted with an hour of idle release: only the new terms (someone waits) make it let go,
    # at once, idle for 200 ms already. The drainer watches the short window: under the
    # sanitizers too. The window travels in microseconds: 400 us (a holder that outranks every
    # waiter is told less than a millisecond) read as milliseconds would hold 200 ms more.
    with fs.FakeScheduler(sock_dir, idle_release_ms=3_600_000) as sched:
        p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("launch 3")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        p.ok("sleep 200")
        assert sched.count(MsgType.LOCK_RELEASED) == 0
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, window_us).pack())
        assert sched.wait_for(
            lambda: any(t == MsgType.LOCK_RELEASED and f == (1,) for _, t, f in sched.events),
            timeout=0.15,
        )
        p.ok("launch 1")  # asks again, and holds again
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 2)
        assert_clean(*p.finish())


@pytest.mark.parametrize("loop", ["launchfor 600 1", "eventfor 600", "copyfor 600"])
def test_a_holder_waiting_for_its_work_is_not_idle(
    variant: Variant, start_probe, sock_dir: str, loop: str
) -> None:
    # Kernels of 60 ms, each waited for (in cuCtxSynchronize, on an event, by a blocking copy)
    # under terms of a 10 ms idle window: the waits are the GPU working, so the hold lasts the
    # whole loop (one grant), where counting only submissions would hand the lock over at
    # every step.
    with fs.FakeScheduler(sock_dir, idle_release_ms=3_600_000) as sched:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_LAUNCH_US="60000")
        p = start_probe(variant, env)
        p.ok("init")
        p.ok("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, 10_000).pack())
        p.ok(loop)
        assert sched.count(MsgType.LOCK_GRANT) == 1
        assert sched.count(MsgType.LOCK_REQUEST) == 1
        # Once it stops waiting and submitting, the short window applies.
        assert sched.wait_for(
            lambda: any(t == MsgType.LOCK_RELEASED and f == (1,) for _, t, f in sched.events)
        )
        assert_clean(*p.finish())


def test_terms_never_open_the_gate_of_a_client_that_waits(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # Terms meant for a hold that just ended can cross the client's next request: they must
    # not be taken for a grant.
    with fs.FakeScheduler(sock_dir, auto_grant=False) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.send("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_REQUEST) == 1)
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, 5_000).pack())
        assert not p.answered(0.3), "the launch ran on terms, without a grant"
        sched.grant_waiting()
        assert p.answer() == "ok"
        assert_clean(*p.finish())


def test_without_a_daemon_the_program_runs_and_says_so_once(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=sock_dir))
    p.ok("init")
    p.ok("launch 20")
    p.ok("alloc mem 1048576")
    p.ok("sleep 300")  # a few reconnect attempts happen meanwhile
    p.ok("launch 20")
    rc, err = p.finish()
    assert_clean(rc, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("nvshare")]
    assert len(lines) == 1 and lines[0].startswith("nvshare: cannot reach the nvshare scheduler")


def test_daemon_death_while_holding_the_lock_then_reconnect(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    sched = fs.FakeScheduler(sock_dir)
    env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_GPU_MEMORY_LIMIT="64Mi")
    p = start_probe(variant, env)
    p.ok("init")
    p.ok("launch 5")
    assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
    sched.stop()  # like kill -9 while this client holds the lock
    p.ok("launch 50")  # keeps running, ungated
    assert p.do("alloc mem 134217728") == "err 2"  # the local limit still holds
    back = fs.FakeScheduler(sock_dir)
    try:
        assert back.wait_for(lambda: back.count(MsgType.REGISTER) == 1)  # re-registered on its own
        # the hook installs the connection when REGISTERED arrives: from then on it asks again
        for _ in range(100):
            p.ok("launch 1")
            if back.wait_for(lambda: back.count(MsgType.LOCK_GRANT) == 1, timeout=0.05):
                break
        assert back.count(MsgType.LOCK_GRANT) == 1  # gating resumed
        rc, err = p.finish()
        assert_clean(rc, err)
        assert len(re.findall(r"^nvshare: ", err, re.M)) == 1
        assert "lost the connection to the nvshare scheduler" in err
    finally:
        back.stop()


def test_fork_child_without_cuda_stays_silent_and_with_cuda_registers(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
    p.ok("init")
    p.ok("launch 1")
    assert p.do("fork 0") == "ok 0"
    assert sched.count(MsgType.REGISTER) == 1
    assert p.do("fork 1") == "ok 0"
    assert sched.wait_for(lambda: sched.count(MsgType.REGISTER) == 2)
    pids = {c for c, t, f in sched.events if t == MsgType.REGISTER}
    assert len(pids) == 2
    p.ok("launch 1")  # the parent's own connection is intact
    assert_clean(*p.finish())


@pytest.mark.parametrize("ms", [300])
def test_unknown_frames_and_errors_do_not_stop_the_program(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str, ms: int
) -> None:
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_DEBUG="1"))
    p.ok("init")
    p.ok("launch 1")
    assert sched.wait_for(lambda: len(sched.clients) == 1)
    sched.send_raw(99, b"\x01\x02")
    sched.clients[0].send(Result(Status.INVALID, 99, "nope"), 7)
    p.ok(f"launchfor {ms}")
    rc, err = p.finish()
    assert_clean(rc, err)
    assert "ignoring frame type 99" in err and "nope" in err


def test_a_process_on_the_second_gpu_registers_and_gates_only_that_gpu(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_GPU_COUNT="2"))
    p.ok("init 1")
    p.ok("launch 3")
    p.ok("alloc mem 1")
    assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
    assert [c.uuid for c in sched.clients] == ["GPU-10111213-1415-1617-1819-1a1b1c1d1e20"]
    assert_clean(*p.finish())


def test_while_the_lock_is_held_submissions_need_no_round_trip(
    plain: Variant, start_probe, sched: fs.FakeScheduler, sock_dir: str
) -> None:
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
    p.ok("init")
    for _ in range(20):
        p.ok("launch 50")
        p.ok("copy")
    assert sched.count(MsgType.LOCK_REQUEST) == 1
    assert_clean(*p.finish())


def test_switching_the_mode_off_lets_a_waiting_client_run(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    sched = fs.FakeScheduler(sock_dir)  # mode on, no quantum: only the mode switch can help
    try:
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_IDLE_RELEASE_MS="3600000")
        holder, waiter = start_probe(plain, env), start_probe(plain, env)
        holder.ok("init")
        holder.ok("launch 1")
        waiter.ok("init")
        assert waiter.proc.stdin is not None and waiter.proc.stdout is not None
        waiter.proc.stdin.write("launch 1\n")
        waiter.proc.stdin.flush()
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_REQUEST) == 2)
        sched.push_limits(fs.limits(mode=WireMode.OFF))
        assert waiter.proc.stdout.readline().strip() == "ok"
        for p in (holder, waiter):
            assert_clean(*p.finish())
    finally:
        sched.stop()
