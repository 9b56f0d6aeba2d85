"""sd_notify against a real AF_UNIX datagram socket, as systemd listens on one."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.daemon.sdnotify import notify, watchdog_interval


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield sock, path
    sock.close()


def test_ready_and_status_arrive_as_one_datagram(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify("READY=1", "STATUS=serving 0 clients", environ={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 0 clients"


def test_reloading_carries_the_monotonic_clock(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notify("RELOADING=1", environ={"NOTIFY_SOCKET": path})
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    state, stamp = sock.recv(4096).decode().split("\n")
    assert state == "RELOADING=1"
    assert stamp.startswith("MONOTONIC_USEC=")
    assert before <= int(stamp.removeprefix("MONOTONIC_USEC=")) <= after


def test_abstract_socket_address() -> None:
    name = f"nvshare-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(10)
        assert notify("STOPPING=1", environ={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"STOPPING=1"


def test_outside_systemd_nothing_is_sent(tmp_path: Path) -> None:
    assert notify("READY=1", environ={}) is False
    assert notify("WATCHDOG=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) is False


def test_watchdog_interval_is_ours_only() -> None:
    mine = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": mine}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "15000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None
