"""Bounded resources: no user or pod can use up the daemon's files, park memory in it with
frames it never finishes, or delay anyone's status by flooding its own.

Each attack runs from a helper process (`FLOOD`) the test places on the host or in a pod; the
victims are a hooked program and nvsharectl's status, measured while the attack goes on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.wire import protocol as p
from appliance.wire import socket_dirs

from .conftest import GiB, Stage, eventually, listed_pods, wait_listed

OOM = "err 2"
MEMORY = "nvshare.com/gpu-memory-limit"

# Opens N connections to a socket, each sending SEND (a Python bytes expression), reports how many
# the daemon kept open after a moment, then waits for its stdin to close and reports again.
FLOOD = """
import socket, sys, time
path, n, send = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3])
sys.stdin.readline()  # placed where the test wants it
conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        if send:
            s.sendall(send)
    except OSError:
        break
    conns.append(s)
time.sleep(0.5)
def is_open(s):
    s.setblocking(False)
    try:
        while s.recv(1 << 16):
            pass  # an answer (the refusal says why), then the end: closed
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
def open_ones():
    return sum(is_open(s) for s in conns)
print(open_ones(), flush=True)
sys.stdin.readline()
print(open_ones(), flush=True)
"""


class Flood:
    def __init__(
        self,
        stage: Stage,
        path: Path,
        n: int,
        send: str = "b''",
        pod: str | None = None,
        user: int | None = None,
    ) -> None:
        python = sys.executable if user is None else OTHER_PYTHON
        self.proc = subprocess.Popen(
            [python, "-c", FLOOD, str(path), str(n), send],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            user=user,
        )
        if pod:
            stage.proc.pod(self.proc.pid, pod)
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kept(self) -> int:
        assert self.proc.stdout is not None
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def floods() -> Iterator[list[Flood]]:
    started: list[Flood] = []
    yield started
    for f in started:
        f.close()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def status_latency(stage: Stage, rounds: int = 20) -> float:
    with stage.control(timeout=10) as c:
        worst = 0.0
        for _ in range(rounds):
            start = time.monotonic()
            assert isinstance(c.request(p.StatusRequest()), p.JsonBody)
            worst = max(worst, time.monotonic() - start)
    return worst


@pytest.fixture
def listed_pod(stage: Stage) -> Iterator[str]:
    """A pod the daemon's pod watch lists on its node (annotated 2Gi); its UID."""
    with listed_pods(stage, flood={MEMORY: "2Gi"}) as uids:
        yield uids["flood"]


def test_idle_connections_of_a_pod_are_capped_and_nobody_else_notices(
    stage: Stage, hooked: Any, floods: list[Flood], listed_pod: str
) -> None:
    stage.policy = "connections: {perPod: 50}\ndefaults: {memoryLimit: 1Gi}\n"
    stage.start()
    listed = hooked(pod=listed_pod)
    listed.ok("init")
    wait_listed(stage, listed, 2 * GiB)
    flood = Flood(stage, stage.socket_dir / socket_dirs.SOCKET_NAME, 300, pod=listed_pod)
    floods.append(flood)
    # The rest were told why and closed; the pod's program counts to the pod's 50 if it
    # connected after the watch listed the pod, else to its user.
    assert flood.kept() in (49, 50)
    started = time.monotonic()
    victim = hooked()
    victim.ok("init")
    assert victim.do(f"alloc mem {2 * GiB}") == OOM  # registered, with its limit: not unlimited
    assert time.monotonic() - started < 4  # no registration timeout on the way
    assert status_latency(stage) < 1.0
    assert stage.output().count("refusing connections") == 1  # one line a minute, not a storm


# What another user can run: the system's Python (the test's may live in root's home).
OTHER_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(OTHER_PYTHON, os.X_OK),
    reason="a second user (uid 65534) needs root and a system-wide python3",
)
def test_idle_connections_of_another_user_are_capped(
    stage: Stage, hooked: Any, floods: list[Flood]
) -> None:
    stage.policy = "connections: {perUid: 100}\ndefaults: {memoryLimit: 1Gi}\n"
    stage.start()
    flood = Flood(stage, stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME, 1100, user=65534)
    floods.append(flood)
    assert flood.kept() == 100
    victim = hooked()
    victim.ok("init")
    assert victim.do(f"alloc mem {2 * GiB}") == OOM
    assert status_latency(stage) < 1.0


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(OTHER_PYTHON, os.X_OK),
    reason="a second user (uid 65534) needs root and a system-wide python3",
)
def test_under_a_hard_limit_of_1024_files_one_user_leaves_room_for_the_others(
    stage: Stage, hooked: Any, floods: list[Flood]
) -> None:
    """Issue 24 item 9: with a hard open-files limit of 1,024 the daemon can hold 896
    connections, and the default perUid cap (1,024) let one user take every one of them: the
    next program of another user could not even connect (status neither)."""
    stage.policy = "defaults: {memoryLimit: 1Gi}\n"
    stage.open_files = 1024
    stage.start()
    flood = Flood(stage, stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME, 1000, user=65534)
    floods.append(flood)
    kept = flood.kept()
    assert 0 < kept <= 448, f"one user holds {kept} of the daemon's 896 connections"
    victim = hooked()
    victim.ok("init")
    victim.ok("alloc mem 1024")  # registers
    pids = {c["pid"] for c in stage.status()["clients"]}  # status answered, too
    assert victim.proc.pid in pids


def test_frames_parked_short_of_their_end_cost_little_and_not_for_long(
    stage: Stage, floods: list[Flood]
) -> None:
    stage.start()
    assert stage.daemon is not None
    before = rss(stage.daemon.pid)
    body = 64 << 10  # the most a control frame may carry
    header = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.QUERY, 0, body, 1)
    parked = f"{header!r} + b'{{' * {body - 1}"  # all of the frame but its last byte
    flood = Flood(stage, stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME, 300, parked)
    floods.append(flood)
    assert flood.kept() == 300
    grown = rss(stage.daemon.pid) - before
    assert grown < 48 << 20, f"RSS grew {grown >> 20} MiB for 300 parked frames"
    assert status_latency(stage, 5) < 1.0
    # past the read deadline (5 s) every one of them is closed
    assert flood.proc.stdin is not None
    time.sleep(7)
    flood.proc.stdin.write("\n")
    flood.proc.stdin.flush()
    assert flood.kept() == 0


def test_a_status_flood_that_never_reads_delays_no_one(stage: Stage, floods: list[Flood]) -> None:
    stage.start()
    request = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.STATUS_REQUEST, 0, 0, 1)
    for _ in range(4):
        flood = Flood(
            stage, stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME, 50, f"{request!r} * 20000"
        )
        floods.append(flood)
    eventually(lambda: all(f.kept() >= 0 for f in floods), "the floods started")
    assert status_latency(stage) < 1.0  # a few ms in bench/results/abuse.md
    time.sleep(1)  # flooders whose answers pile up are paused, not served, and nothing breaks
    assert status_latency(stage) < 1.0
    assert "Traceback" not in stage.output()
