"""Lock hand-off latency through the daemon, and what a crowd of hooks costs it.

`handoff`: N clients on one GPU in mode `on` keep the queue full: the holder releases, the next
in line receives its grant, the old holder asks again. Measured on the client side over the real
Unix socket (both socket hops and the daemon's event loop), waiting on epoll so that the client
side costs the same at any N. With `--status`, another client asks `nvsharectl status` in a loop
meanwhile: the hand-off's tail then shows how long a status keeps a grant waiting. The daemon's
CPU per hand-off (user and system, /proc) is the steadier figure on a shared machine: the client
asks again at once, so the daemon is busy most of the time and the latency follows its CPU.

`burst`: N registered hooks ask for the lock at once (as after a daemon restart) while one more
hook sends heartbeats back to back: how long until the daemon has them all in line (status shows
N-1 waiting), and the slowest heartbeat answer meanwhile.

`churn`: N hooks register one after the other, then all disconnect: seconds for each (until
status shows them all gone).

`stall`: N hooks in line for the lock while one `nvsharectl status` and one metrics scrape a
second come from other processes, and one more hook sends heartbeats back to back (answered
as soon as they are read): the slowest heartbeat answer is the longest the event loop was kept
from reading, i.e. the longest a grant could have waited behind status or metrics.

    .venv/bin/python bench/lock_handoff.py handoff [--clients 16 128 512 2000] [--handoffs 1000]
    .venv/bin/python bench/lock_handoff.py burst [--clients 2000]
    .venv/bin/python bench/lock_handoff.py churn [--clients 500 1000 2000]
    .venv/bin/python bench/lock_handoff.py stall [--clients 2000] [--seconds 20]

`--tree /tmp/old` runs the daemon of another checkout (`git worktree add /tmp/old <commit>`), so
that before and after run in one series on the same machine. Instructions per hand-off, which a
noisy machine does not move: bench/core_cost.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _daemon import BenchDaemon, machine, percentile

from appliance.cli.client import ControlClient
from appliance.wire import protocol as p

POLICY = "scheduler: {mode: 'on', timeQuantum: 3600s}\nconnections: {perUid: 8192}"


def _stop(d: BenchDaemon) -> None:
    """Stop the daemon; one still busy with thousands of disconnects (an old tree) is killed."""
    try:
        d.stop()
    except subprocess.TimeoutExpired:
        d.proc.kill()
        d.proc.wait()


def _clients(d: BenchDaemon, n: int) -> list[ControlClient]:
    return [d.client(timeout=60) for _ in range(n)]


def _waiting(d: BenchDaemon) -> int:
    with d.control() as c:
        doc = c.request(p.StatusRequest()).doc
    return sum(len(g["queue"]) for g in doc["gpus"])


def _connected(d: BenchDaemon) -> int:
    with d.control() as c:
        return len(c.request(p.StatusRequest()).doc["clients"])


STATUS_LOOP = """
import sys
from appliance.wire import protocol as p
from appliance.cli.client import ControlClient
from pathlib import Path
with ControlClient(Path(sys.argv[1])) as c:
    while True:
        c.request(p.StatusRequest())
        print("answered", flush=True)
"""


class StatusLoop:
    """Another process asking for status back to back (its own process: parsing a large
    document here would hold this process's GIL and delay the measurement, not the daemon)."""

    def __init__(self, d: BenchDaemon) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", STATUS_LOOP, str(d.socket_dir)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # the first status answered: it runs

    def stop(self) -> int:
        """Stop it; the statuses it had answered."""
        self._proc.kill()
        out, _ = self._proc.communicate()
        return 1 + out.count("answered")


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used, user and system (`/proc/PID/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def handoff(
    n: int,
    handoffs: int,
    tree: Path | None,
    status: bool,
    *,
    daemon_args: list[str] | None = None,
    started: Callable[[BenchDaemon], None] = lambda d: None,
) -> tuple[list[float], int, float]:
    """(every hand-off's latency, statuses answered, the daemon's CPU seconds per hand-off);
    `started` is called with the daemon."""
    d = BenchDaemon(POLICY, tree=tree, args=daemon_args)
    started(d)
    try:
        clients = _clients(d, n)
        holder = clients[0]
        assert isinstance(holder.request(p.LockRequest()), p.LockGrant)
        for c in clients[1:]:
            c.send(p.LockRequest())
        while _waiting(d) < n - 1:  # else the first hand-off waits for the n requests (max)
            time.sleep(0.02)
        sel = selectors.DefaultSelector()
        for c in clients:
            sel.register(c._sock, selectors.EVENT_READ, c)
        poller = StatusLoop(d) if status else None
        latencies = []
        cpu_before = _cpu_s(d.proc.pid)
        for _ in range(handoffs):
            t0 = time.perf_counter()
            holder.send(p.LockReleased(p.ReleaseReason.IDLE))
            granted = None
            while granted is None:
                ready = sel.select(60)
                assert ready, "no grant within 60 s"
                for key, _ in ready:
                    c = key.data
                    if any(isinstance(msg, p.LockGrant) for msg in c.receive_read()):
                        granted = c
            latencies.append(time.perf_counter() - t0)
            holder.send(p.LockRequest())  # back of the queue
            holder = granted
        cpu = (_cpu_s(d.proc.pid) - cpu_before) / max(handoffs, 1)
        asked = poller.stop() if poller is not None else 0
        for c in clients:
            c.close()
        return latencies, asked, cpu
    finally:
        _stop(d)


def burst(n: int, tree: Path | None) -> tuple[float, float, int]:
    """(seconds until all n are in line, slowest heartbeat answer, heartbeats answered)."""
    d = BenchDaemon(POLICY, tree=tree)
    try:
        clients = _clients(d, n)
        beat = d.client(timeout=60)
        stop = threading.Event()
        answers: list[float] = []

        def beats() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert isinstance(beat.request(p.Heartbeat()), p.HeartbeatAck)
                answers.append(time.perf_counter() - t0)

        thread = threading.Thread(target=beats, daemon=True)
        thread.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        for c in clients:
            c.send(p.LockRequest())
        while _waiting(d) < n - 1:
            time.sleep(0.02)
        handled = time.perf_counter() - t0
        time.sleep(0.05)
        stop.set()
        thread.join()
        for c in [*clients, beat]:
            c.close()
        return handled, max(answers), len(answers)
    finally:
        _stop(d)


READERS = """
import sys, time, urllib.request
from appliance.wire import protocol as p
from appliance.cli.client import ControlClient
from pathlib import Path
while True:
    t0 = time.monotonic()
    with ControlClient(Path(sys.argv[1])) as c:
        c.request(p.StatusRequest())
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/metrics", timeout=30).read()
    print("read", flush=True)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
"""


def stall(n: int, seconds: float, tree: Path | None) -> tuple[list[float], int]:
    """(every heartbeat's round trip, status+scrape pairs read) with n hooks in line."""
    port = 19000 + (n % 1000)
    d = BenchDaemon(POLICY, tree=tree, metrics_port=port)
    try:
        clients = _clients(d, n)
        for c in clients:
            c.send(p.LockRequest())
        while _waiting(d) < n - 1:
            time.sleep(0.05)
        beat = d.client(timeout=60)
        readers = subprocess.Popen(
            [sys.executable, "-c", READERS, str(d.socket_dir), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert readers.stdout is not None
        readers.stdout.readline()  # (the first scrape starts the metrics up)
        rtts = []
        watched = bool(os.environ.get("NVSHARE_LOOPWATCH"))  # bench/loopwatch: this window
        if watched:
            d.proc.send_signal(signal.SIGUSR1)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            assert isinstance(beat.request(p.Heartbeat()), p.HeartbeatAck)
            rtts.append(time.perf_counter() - t0)
        if watched:
            d.proc.send_signal(signal.SIGUSR2)
        readers.kill()
        out, _ = readers.communicate()
        for c in [*clients, beat]:
            c.close()
        return rtts, out.count("read")
    finally:
        _stop(d)


def churn(n: int, tree: Path | None) -> tuple[float, float]:
    """(seconds to register n one after the other, seconds until n disconnects are handled)."""
    d = BenchDaemon(POLICY, tree=tree)
    try:
        t0 = time.perf_counter()
        clients = _clients(d, n)
        registered = time.perf_counter() - t0
        t1 = time.perf_counter()
        for c in clients:
            c.close()
        while _connected(d):
            time.sleep(0.02)
        return registered, time.perf_counter() - t1
    finally:
        _stop(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["handoff", "burst", "churn", "stall"])
    ap.add_argument("--seconds", type=float, default=20.0, help="stall: how long to measure")
    ap.add_argument("--clients", type=int, nargs="+", default=[16, 128, 512, 2000])
    ap.add_argument("--handoffs", type=int, default=1000)
    ap.add_argument("--status", action="store_true", help="status asked back to back meanwhile")
    ap.add_argument("--tree", type=Path, help="the checkout whose daemon to run")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of client sockets
    print(f"machine: {machine()}; tree: {args.tree or 'this one'}")
    if args.what == "handoff":
        print(
            "| clients | hand-offs | p50 (ms) | p99 (ms) | max (ms) | status answered "
            "| daemon CPU per hand-off (µs) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.clients:
            lat, asked, cpu = handoff(n, args.handoffs, args.tree, args.status)
            print(
                f"| {n} | {len(lat)} | {percentile(lat, 50) * 1e3:.3f} | "
                f"{percentile(lat, 99) * 1e3:.3f} | {max(lat) * 1e3:.3f} | {asked} | "
                f"{cpu * 1e6:.1f} |",
                flush=True,
            )
    elif args.what == "burst":
        print("| requests at once | all in line after (s) | slowest heartbeat (ms) | heartbeats |")
        print("|---:|---:|---:|---:|")
        for n in args.clients:
            handled, slowest, beats = burst(n, args.tree)
            print(f"| {n} | {handled:.3f} | {slowest * 1e3:.1f} | {beats} |", flush=True)
    elif args.what == "stall":
        print("| clients | heartbeats | p50 (ms) | p99 (ms) | p99.9 (ms) | max (ms) | reads |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.clients:
            rtts, reads = stall(n, args.seconds, args.tree)
            ms = [percentile(rtts, q) * 1e3 for q in (50, 99, 99.9)]
            print(
                f"| {n} | {len(rtts)} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} | "
                f"{max(rtts) * 1e3:.1f} | {reads} |",
                flush=True,
            )
    else:
        print("| clients | register all (s) | each (ms) | disconnect all (s) | each (ms) |")
        print("|---:|---:|---:|---:|---:|")
        for n in args.clients:
            reg, gone = churn(n, args.tree)
            print(
                f"| {n} | {reg:.3f} | {reg / n * 1e3:.3f} | {gone:.3f} | {gone / n * 1e3:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
