"""`make run` as the README tells a new user to use it: one daemon, stopped with make."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .conftest import ROOT


def make_run(socket_dir: Path, policy_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                "make",
                "-s",
                "-C",
                str(ROOT),
                "run",
                f"SOCKET_DIR={socket_dir}",
                f"POLICY_DIR={policy_dir}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_make_run_twice_refuses_and_stopping_make_stops_the_daemon(tmp_path: Path) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="nvs-run-"))  # short enough for a socket path
    control_dir = socket_dir.with_name(socket_dir.name + "-control")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "p.yaml").write_text("metrics: {enabled: false}\n")
    first = make_run(socket_dir, policy, tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 60
        while not (socket_dir / "scheduler.sock").exists():
            assert first.poll() is None and time.monotonic() < deadline, (
                tmp_path / "first.log"
            ).read_text()
            time.sleep(0.1)
        daemon_pid = int((control_dir / "scheduler.lock").read_text())
        assert int(Path(f"/proc/{daemon_pid}/stat").read_text().split()[3]) == first.pid  # exec'd
        second = make_run(socket_dir, policy, tmp_path / "second.log")
        assert second.wait(60) != 0
        assert (
            f"another nvshare scheduler (pid {daemon_pid}) is serving"
            in (tmp_path / "second.log").read_text()
        )
        first.send_signal(signal.SIGTERM)  # what stopping `make run` does
        first.wait(30)
        deadline = time.monotonic() + 10
        while alive(daemon_pid):
            assert time.monotonic() < deadline, "the daemon outlived make"
            time.sleep(0.05)
        assert not (socket_dir / "scheduler.sock").exists()
    finally:
        if first.poll() is None:
            first.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
        shutil.rmtree(control_dir, ignore_errors=True)
