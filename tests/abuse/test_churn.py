"""Connection churn: one process connecting and closing in a loop must not make the CUDA programs
starting meanwhile run unshared.

It used to fill the hooks' socket backlog (asyncio's 100), and every hook that found it full
took that for "no scheduler" and ran ungated. Now the backlog is the kernel's maximum, a hook
waits for room up to NVSHARE_DAEMON_TIMEOUT_MS, and the churner's pod is refused past
`connections.newPerSecond` before asyncio makes anything of its connections, so the daemon
drains the backlog faster than the churner fills it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import GiB, Stage, eventually, listed_pods, wait_listed

MEMORY = "nvshare.com/gpu-memory-limit"
PROGRAMS = 15

# Connects and closes in a loop, from several threads, until killed; says "churning" once its
# threads run.
CHURN = """
import socket, sys, threading
path = sys.argv[1]
sys.stdin.readline()  # placed where the test wants it
def churn():
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            pass
        s.close()
threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
print("churning", flush=True)
threads[0].join()
"""


@pytest.fixture
def pods(stage: Stage) -> Iterator[dict[str, str]]:
    with listed_pods(stage, churner={MEMORY: "1Gi"}, honest={}) as uids:
        yield uids


@pytest.fixture
def churner(stage: Stage) -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(pod: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHURN, str(stage.socket_dir / "scheduler.sock")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        stage.proc.pod(proc.pid, pod)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "churning"
        time.sleep(1.0)  # its loop is well under way (the drill holds either way)

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def test_programs_starting_under_connection_churn_all_register(
    stage: Stage, hooked: Any, churner: Any, pods: dict[str, str]
) -> None:
    stage.start()
    churner_pod = pods["churner"]
    listed = hooked(pod=churner_pod)  # a program of its pod, to see the watch list the pod
    listed.ok("init")
    wait_listed(stage, listed, GiB)
    churner(churner_pod)
    programs = [
        hooked(pod=pods["honest"] if n % 2 else None, NVSHARE_DAEMON_TIMEOUT_MS="5000")
        for n in range(PROGRAMS)
    ]
    for program in programs:
        program.ok("init")
    for program in programs:
        program.send("launch 1")  # the first use registers, all at once
    for program in programs:
        assert program.answer() == "ok"
    fell_open = [p.proc.pid for p in programs if "without sharing" in p.stderr()]
    assert not fell_open, f"{len(fell_open)} of {PROGRAMS} ran unshared: {programs[0].stderr()}"
    pids = {p.proc.pid for p in programs}
    eventually(
        lambda: pids <= {c["pid"] for c in stage.status()["clients"]}, "every program registered"
    )
    # past its burst (or its cap of connections not yet closed), refused, and said once
    assert stage.output().count(f"refusing connections: pod {churner_pod}") == 1
