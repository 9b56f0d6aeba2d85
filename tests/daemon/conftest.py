"""A real daemon process on a real Unix socket in a temp dir, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[str]
    socket_dir: Path
    policy_dir: Path
    log: Path

    @property
    def control_path(self) -> Path:
        return self.socket_dir.with_name(self.socket_dir.name + "-control") / "control.sock"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "NVSHARE_SOCKET_DIR": str(self.socket_dir)}

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listening(path: Path) -> bool:
    """The socket file appears at bind(), a moment before listen(): wait for a connect."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def start_daemon(
    tmp: Path,
    policy_yaml: str = "",
    *,
    extra_env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> RunningDaemon:
    policy_dir = tmp / "policy"
    policy_dir.mkdir(exist_ok=True)
    if policy_yaml:
        (policy_dir / "policy.yaml").write_text(policy_yaml)
    socket_dir = tmp / "run"
    log = tmp / "daemon.log"
    env = {**os.environ, "NVSHARE_SOCKET_DIR": str(socket_dir), **(extra_env or {})}
    if "metrics:" not in policy_yaml:
        (policy_dir / "zz-test-metrics.yaml").write_text("metrics: {enabled: false}\n")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "nvshare-scheduler"), "--policy-dir", str(policy_dir), *(args or [])],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = RunningDaemon(proc, socket_dir, policy_dir, log)
    deadline = time.monotonic() + 20
    # Both sockets: the hooks' one, and nvsharectl's, which a test may talk to at once.
    while not (_listening(socket_dir / "scheduler.sock") and _listening(running.control_path)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not start:\n{log.read_text()}")
        time.sleep(0.02)
    return running


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    d = start_daemon(tmp_path, "scheduler: {mode: 'on', timeQuantum: 2s}\n")
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[list[socket.socket]]:
    """Sockets a test opened (through `track`) are closed when it ends."""
    yield OPEN
    while OPEN:
        OPEN.pop().close()


OPEN: list[socket.socket] = []


def track(sock: socket.socket) -> socket.socket:
    OPEN.append(sock)
    return sock
