"""The hook against the real node daemon (nvshare-scheduler) over its real socket: serialised
kernels in mode on with quantum hand-over, free-running in mode off, a killed daemon, a killed
lock holder, limits changed live through the policy directory, a lender taking its GPU back,
and a GPU kept for a lender whose requests come at a steady pace."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon

from appliance.cli.client import ControlClient
from appliance.wire.protocol import StatusRequest

from .conftest import Probe, Variant, assert_clean, holder_and_waiter
from .test_gate import intervals, overlaps, run_pair

MiB = 1 << 20


@pytest.fixture
def daemon_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="nvs-d-"))  # short: the socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def running(daemon_dir: Path) -> Iterator[list[RunningDaemon]]:
    started: list[RunningDaemon] = []
    yield started
    for d in started:
        d.stop()


def start(running: list[RunningDaemon], where: Path, policy: str) -> RunningDaemon:
    d = start_daemon(where, policy)
    running.append(d)
    return d


def test_mode_on_serialises_and_the_quantum_hands_over(
    variant: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'on', timeQuantum: 1s}\n")
    trace = daemon_dir / "trace"
    run_pair(variant, start_probe, str(d.socket_dir), trace, 2500)
    a, b = intervals(trace).values()
    assert overlaps(a, b) == 0
    # the quantum moved the GPU between them more than once: their kernels interleave in runs
    merged = sorted([(s, 0) for s, _ in a] + [(s, 1) for s, _ in b])
    switches = sum(1 for x, y in itertools.pairwise(merged) if x[1] != y[1])
    assert switches >= 2
    assert "Traceback" not in d.output()


def test_mode_off_runs_concurrently(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'off'}\n")
    trace = daemon_dir / "trace"
    run_pair(plain, start_probe, str(d.socket_dir), trace, 600)
    a, b = intervals(trace).values()
    assert overlaps(a, b) > 0


def test_killing_the_daemon_leaves_the_holder_running(
    variant: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'on', timeQuantum: 1s}\n")
    p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=str(d.socket_dir)))
    p.ok("init")
    p.ok("launch 5")  # holds the lock now
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    p.ok("launchfor 300")
    rc, err = p.finish()
    assert_clean(rc, err)
    assert err.count("nvshare: ") == 1 and "lost the connection" in err


def test_killing_the_holder_hands_the_lock_over(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # A quantum of an hour: only the holder's death can hand the GPU over before the test times out.
    d = start(running, daemon_dir, "scheduler: {mode: 'on', timeQuantum: 1h}\n")
    env = plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir), NVSHARE_IDLE_RELEASE_MS="3600000")
    holder, waiter = holder_and_waiter(start_probe, plain, env)
    os.kill(holder.proc.pid, signal.SIGKILL)
    assert waiter.answer() == "ok"
    assert_clean(*waiter.finish())


def write_policy(d: RunningDaemon, limit: str) -> None:
    tmp = d.policy_dir / ".policy.yaml.tmp"
    tmp.write_text(f"memory: {{chunk: 2Mi}}\ndefaults: {{memoryLimit: {limit}}}\n")
    tmp.rename(d.policy_dir / "policy.yaml")


def until(p, line: str, want: str) -> None:  # type: ignore[no-untyped-def]
    """Repeat `line` until the answer starts with `want` (the policy reload is asynchronous)."""
    deadline = time.monotonic() + 20
    while not (got := p.do(line)).startswith(want):
        assert time.monotonic() < deadline, f"{line!r} still gives {got!r}, wanted {want!r}"
        time.sleep(0.02)
    if got.startswith("ok") and line.startswith("alloc"):
        p.ok(f"free {got.split()[1]}")


def test_live_limit_raise_lower_and_remove(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'off'}\n")
    write_policy(d, "8Mi")
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir)))
    p.ok("init")
    until(p, "total", f"ok {8 * MiB}")
    held = p.ok(f"alloc mem {6 * MiB}").split()[1]
    assert p.do(f"alloc mem {4 * MiB}") == "err 2"

    write_policy(d, "16Mi")  # raise: the next allocation fits
    until(p, f"alloc mem {4 * MiB}", "ok")
    write_policy(d, "4Mi")  # lower below usage: what is allocated stays, new ones are refused
    until(p, "info", f"ok 0 {4 * MiB}")
    assert p.do("alloc mem 1") == "err 2"
    p.ok(f"free {held}")
    p.ok(f"alloc mem {4 * MiB}")
    write_policy(d, "null")  # removed
    until(p, f"alloc mem {64 * MiB}", "ok")
    assert_clean(*p.finish())
    assert "Traceback" not in d.output()


def shown_priorities(d: RunningDaemon, probes: dict[str, Probe]) -> dict[str, int | str]:
    with ControlClient(d.socket_dir) as c:
        rows = c.request(StatusRequest()).doc["clients"]
    by_pid = {row["pid"]: row["priority"] for row in rows}
    return {value: by_pid.get(p.proc.pid, "absent") for value, p in probes.items()}


def test_without_a_pod_watch_a_trusted_claim_shares_its_pods_limit(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    """A workstation groups processes by the pod they claim: `limit set --pod` used to say the
    override waits for the pod, and then a 2 GiB allocation under the pod's 1 GiB succeeded."""
    d = start(
        running,
        daemon_dir,
        f"scheduler: {{mode: 'off'}}\nmemory: {{chunk: 2Mi}}\n"
        f"trust: {{podClaimUids: [{os.getuid()}]}}\n",
    )
    ctl = subprocess.run(
        [str(BIN / "nvsharectl"), "limit", "set", "--pod", "ml/trainer", "1Gi"],
        env=d.env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ctl.returncode == 0, ctl.stderr
    assert "no process claims that pod yet; the override waits for one" in ctl.stdout
    env = plain.env(
        NVSHARE_SOCKET_DIR=str(d.socket_dir),
        NVSHARE_POD_NAMESPACE="ml",
        NVSHARE_POD_NAME="trainer",
    )
    a = start_probe(plain, env)
    a.ok("init")
    until(a, "total", f"ok {1024 * MiB}")
    assert a.do(f"alloc mem {2048 * MiB}") == "err 2"  # CUDA_ERROR_OUT_OF_MEMORY
    a.ok(f"alloc mem {600 * MiB}")
    b = start_probe(plain, env)
    b.ok("init")
    until(b, "total", f"ok {1024 * MiB}")
    assert b.do(f"alloc mem {600 * MiB}") == "err 2"  # one ledger for the pod's processes
    b.ok(f"alloc mem {300 * MiB}")
    assert_clean(*a.finish())
    assert_clean(*b.finish())
    assert "ignored" not in d.output() and "Traceback" not in d.output()


def test_a_pod_name_of_253_characters_gets_its_limit_end_to_end(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    """Kubernetes allows pod names of 253 characters; the wire used to hold 63, so `limit set`
    refused longer ones and a hook could not name its pod."""
    name = ("p" * 62 + ".") * 3 + "q" * 64
    assert len(name) == 253
    d = start(
        running,
        daemon_dir,
        f"scheduler: {{mode: 'off'}}\ntrust: {{podClaimUids: [{os.getuid()}]}}\n",
    )
    nvsharectl = [str(BIN / "nvsharectl")]
    ctl = subprocess.run(
        [*nvsharectl, "limit", "set", "--pod", f"ml/{name}", "1Gi"],
        env=d.env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ctl.returncode == 0, ctl.stderr
    env = plain.env(
        NVSHARE_SOCKET_DIR=str(d.socket_dir), NVSHARE_POD_NAMESPACE="ml", NVSHARE_POD_NAME=name
    )
    a = start_probe(plain, env)
    a.ok("init")
    until(a, "total", f"ok {1024 * MiB}")  # the hook's register carried the whole name
    assert a.do(f"alloc mem {2048 * MiB}") == "err 2"
    for view in (["limit", "list"], ["status", "--wide"]):
        shown = subprocess.run(
            [*nvsharectl, *view], env=d.env, capture_output=True, text=True, timeout=30
        )
        assert shown.returncode == 0 and f"ml/{name}" in shown.stdout, shown.stdout
    assert_clean(*a.finish())
    assert "Traceback" not in d.output()


def test_a_process_lowers_its_own_priority_through_its_environment(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'off'}\n")
    probes = {}
    for value in ("low", "-7", "high", "urgent"):
        probes[value] = start_probe(
            plain, plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir), NVSHARE_GPU_PRIORITY=value)
        )
        probes[value].ok("init")
        probes[value].ok("launch 1")  # connected and registered
    # low and -7 lower it; high would raise it above the policy's normal; urgent is no priority
    want = {"low": -100, "-7": -7, "high": 0, "urgent": 0}
    deadline = time.monotonic() + 5
    while (shown := shown_priorities(d, probes)) != want:
        assert time.monotonic() < deadline, shown
        time.sleep(0.02)
    rc, err = probes["urgent"].finish()
    assert_clean(rc, err)
    assert "NVSHARE_GPU_PRIORITY=urgent is not low, normal, high or a whole number" in err
    for value in ("low", "-7", "high"):
        rc, err = probes[value].finish()
        assert_clean(rc, err)
        assert "NVSHARE_GPU_PRIORITY" not in err
    assert "Traceback" not in d.output()


def test_policy_idle_release_reaches_the_hook(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # Quantum and idle release of an hour, no idle hand-off: an idle holder keeps the GPU,
    # although the hook's own default (1 s, when neither the policy nor NVSHARE_IDLE_RELEASE_MS
    # says) would let go.
    d = start(
        running,
        daemon_dir,
        "scheduler: {mode: 'on', timeQuantum: 1h, idleRelease: 1h, idleHandoff: 0}\n",
    )
    env = {
        k: v
        for k, v in plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir)).items()
        if k != "NVSHARE_IDLE_RELEASE_MS"
    }
    holder, waiter = holder_and_waiter(start_probe, plain, env)
    ready = waiter.answered(3.0)
    assert not ready, "the idle holder let go before the policy's idle release"
    assert_clean(*holder.finish())  # the holder exits: now the waiter runs
    assert waiter.answer() == "ok"
    assert_clean(*waiter.finish())


def test_an_idle_holder_hands_over_to_a_waiter_after_the_idle_handoff(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # An hour of quantum and idle release: only the hand-off while someone waits lets go.
    policy = "scheduler: {mode: 'on', timeQuantum: 1h, idleRelease: 1h, idleHandoff: 20ms}\n"
    d = start(running, daemon_dir, policy)
    env = {
        k: v
        for k, v in plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir)).items()
        if k != "NVSHARE_IDLE_RELEASE_MS"
    }
    holder, waiter = holder_and_waiter(start_probe, plain, env)
    assert waiter.answer() == "ok"  # the idle holder handed the lock over, alive
    holder.ok("launch 1")  # and asks for it again like anyone
    assert_clean(*waiter.finish())
    assert_clean(*holder.finish())


def test_usage_inside_a_reservation_reaches_status(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    d = start(running, daemon_dir, "scheduler: {mode: 'off'}\nmemory: {chunk: 64Mi}\n")
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=str(d.socket_dir)))
    p.ok("init")
    held = p.ok(f"alloc mem {3 * MiB}").split()[1]  # charged 4 MiB, inside the first chunk

    def used() -> int:
        with ControlClient(d.socket_dir) as c:
            return int(c.request(StatusRequest()).doc["clients"][0]["memory_used"])

    deadline = time.monotonic() + 20
    while used() != 4 * MiB:
        assert time.monotonic() < deadline, f"status still shows {used()} bytes used"
        time.sleep(0.05)
    p.ok(f"free {held}")
    while used() != 0:
        assert time.monotonic() < deadline, f"status still shows {used()} bytes used"
        time.sleep(0.05)
    assert_clean(*p.finish())


@pytest.mark.parametrize(("each_mib", "together"), [(60, False), (30, True)])
def test_mode_auto_runs_together_only_while_memory_fits(
    plain: Variant,
    start_probe,
    daemon_dir: Path,
    running: list[RunningDaemon],
    each_mib: int,
    together: bool,
) -> None:
    # A GPU declared at 100 MiB: two clients of 60 MiB must take turns, two of 30 MiB run at once.
    d = start(
        running,
        daemon_dir,
        "scheduler: {mode: auto, timeQuantum: 1s}\nmemory: {chunk: 2Mi}\n"
        "gpus: [{match: {}, memory: 100Mi}]\n",
    )
    trace = daemon_dir / "trace"
    run_pair(plain, start_probe, str(d.socket_dir), trace, 1500, (f"alloc mem {each_mib * MiB}",))
    a, b = intervals(trace).values()
    assert (overlaps(a, b) > 0) is together


def test_a_stopped_daemon_is_treated_as_gone_until_it_continues(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # A quantum of an hour: only the daemon's silence can let the waiter run.
    d = start(running, daemon_dir, "scheduler: {mode: 'on', timeQuantum: 1h}\n")
    env = plain.env(
        NVSHARE_SOCKET_DIR=str(d.socket_dir),
        NVSHARE_DAEMON_TIMEOUT_MS="500",
        NVSHARE_IDLE_RELEASE_MS="3600000",
    )
    holder, waiter = holder_and_waiter(start_probe, plain, env)
    time.sleep(0.2)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        assert waiter.answer() == "ok"  # the hung daemon no longer gates it
        holder.ok(f"alloc mem {256 * MiB}")  # a reservation nobody answers: decided locally
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)

    def registered() -> set[int]:
        with ControlClient(d.socket_dir) as c:
            return {int(x["pid"]) for x in c.request(StatusRequest()).doc["clients"]}

    deadline = time.monotonic() + 20
    while registered() != {holder.proc.pid, waiter.proc.pid}:  # both came back on their own
        assert time.monotonic() < deadline, f"registered: {registered()}"
        time.sleep(0.1)
    for p in (holder, waiter):
        rc, err = p.finish()
        assert_clean(rc, err)
        assert err.count("nvshare: ") == 1
        assert "stopped answering" in err or "did not answer a memory reservation" in err


@dataclass(frozen=True, slots=True)
class Renamed(Variant):
    """The same probe program under another executable name, for policy rules to match."""

    exe: Path = Path()

    @property
    def probe(self) -> Path:
        return self.exe


def high_and_normal(
    plain: Variant,
    start_probe,
    running: list[RunningDaemon],
    where: Path,
    *,
    scheduler: str,
    launch_us: int,
    **env: str,
) -> tuple[RunningDaemon, Probe, Probe, Path]:
    """A daemon in mode on (with `scheduler`'s further settings) whose rules make `*/probe-high`
    a high priority, and two probes under it: one run as probe-high, which has launched once
    and holds the GPU, and one plain; kernels of `launch_us`, traced to the returned file."""
    d = start(
        running,
        where,
        f"scheduler: {{mode: 'on', timeQuantum: 1h, idleRelease: 1h, {scheduler}}}\n"
        "rules: [{name: serving, match: {executable: '*/probe-high'}, priority: high}]\n",
    )
    exe = where / "probe-high"
    shutil.copy2(plain.probe, exe)
    trace = where / "trace"
    environment = plain.env(
        NVSHARE_SOCKET_DIR=str(d.socket_dir),
        NVSHARE_FAKE_LAUNCH_US=str(launch_us),
        NVSHARE_FAKE_TRACE=str(trace),
        **env,
    )
    high = start_probe(Renamed(plain.name, plain.build, plain.runtime, exe), environment)
    high.ok("init")
    high.ok("launch 1")
    low = start_probe(plain, environment)
    low.ok("init")
    return d, high, low, trace


def test_a_lender_takes_its_gpu_back_beside_the_borrowers_queued_work(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # Kernels of 50 ms. A high-priority program holds the GPU and goes idle while a normal one
    # waits: the waiter borrows it (idle hand-off), and the high one is told its GPU is lent.
    # When it submits again it does not wait for the daemon's answer (the daemon is stopped
    # then, to show it), nor for the borrower's drain: its kernel runs beside the borrower's
    # queued ones (in mode on nothing else overlaps), and the daemon, once it runs again, grants
    # it the GPU with the borrower's drop.
    d, high, low, trace = high_and_normal(
        plain,
        start_probe,
        running,
        daemon_dir,
        scheduler="idleHandoff: 20ms",
        launch_us=50000,
        NVSHARE_DAEMON_TIMEOUT_MS="600000",  # a stopped daemon is waited for, not given up on
    )
    stream = low.ok("stream 0").split()[1]
    low.send(f"queue_on {stream} 30")  # granted once the high one has been idle for 20 ms
    deadline = time.monotonic() + 20
    while len(intervals(trace).get(low.proc.pid, [])) < 3:
        assert time.monotonic() < deadline, "the idle high-priority holder never lent the GPU"
        time.sleep(0.02)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        high.send("launch 1")  # takes it back
        assert high.answered(10), "the lender waited for the daemon's answer"
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert high.answer() == "ok"
    runs = intervals(trace)
    taken_back = runs[high.proc.pid][1]
    assert overlaps([taken_back], runs[low.proc.pid]) > 0
    assert low.answer() == "ok"  # the borrower finishes once the GPU is idle again
    with ControlClient(d.socket_dir) as c:
        counters = c.request(StatusRequest()).doc["counters"]
    assert counters["drops_priority"] == 1 and counters.get("drops_overdue", 0) == 0
    assert_clean(*high.finish())
    assert_clean(*low.finish())
    assert "Traceback" not in d.output()


@pytest.mark.parametrize("bound", ["", "borrowerQueue: 0"])
def test_a_borrower_of_a_higher_priority_keeps_its_queue_short(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon], bound: str
) -> None:
    # Kernels of 2 ms. The high-priority program goes idle and lends its GPU to the normal
    # one, which queues 40 launches at once: told the default bound (0.5 ms) with its grant, it
    # has at most a few on the GPU at a time; with the bound off, all of them.
    settings = "idleHandoff: 20ms" + (f", {bound}" if bound else "")
    d, high, low, _ = high_and_normal(
        plain, start_probe, running, daemon_dir, scheduler=settings, launch_us=2000
    )
    most = int(low.ok("queuedepth 40").split()[1])
    assert most >= 35 if bound else most <= 4
    assert_clean(*high.finish())
    assert_clean(*low.finish())
    assert "Traceback" not in d.output()


def test_a_steady_lender_finds_its_gpu_already_given_back(
    plain: Variant, start_probe, daemon_dir: Path, running: list[RunningDaemon]
) -> None:
    # Kernels of 10 ms. A low-priority trainer launches two and synchronises, again and again;
    # a high-priority loop makes a one-kernel request every 300 ms and lends the GPU between
    # them. Taken back at once, a request's kernel runs beside the trainer's queued ones; once
    # its pace is steady, the daemon drops the trainer ahead of the request (`reclaim`) and the
    # request runs on a GPU nobody else is using.
    d, high, low, trace = high_and_normal(
        plain,
        start_probe,
        running,
        daemon_dir,
        scheduler="idleHandoff: 20ms, reclaimAhead: 100ms",
        launch_us=10000,
    )
    low.send("launchfor 9000 2")
    requests, period = 20, 0.3
    start_at = time.monotonic() + period
    for i in range(requests):
        time.sleep(max(0.0, start_at + i * period - time.monotonic()))
        high.ok("launch 1")
    assert low.answer().startswith("ok")
    runs = intervals(trace)
    served = runs[high.proc.pid][1:]  # the requests, after the first launch
    alone = [r for r in served if overlaps([r], runs[low.proc.pid]) == 0]
    with ControlClient(d.socket_dir) as c:
        counters = c.request(StatusRequest()).doc["counters"]
    # Six requests teach the pace; a late one (a loaded machine) costs six more.
    assert counters.get("drops_reclaim", 0) >= 3, counters
    assert len(alone) >= 3, f"{len(alone)} of {len(served)} requests ran alone; {counters}"
    assert_clean(*high.finish())
    assert_clean(*low.finish())
    assert "Traceback" not in d.output()
