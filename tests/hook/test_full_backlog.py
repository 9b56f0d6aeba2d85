"""A scheduler whose listen backlog is full is busy, not gone.

One process connecting and closing in a loop keeps the socket's backlog full; a program that
starts meanwhile must wait for room (up to NVSHARE_DAEMON_TIMEOUT_MS) and register, instead of
running unshared. A socket directory with no socket at all still means "no scheduler" at once.
"""

from __future__ import annotations

import os
import socket
import time

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean


def _full_listener(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A real listening socket that accepts nothing, its backlog filled by idle connections."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    fillers: list[socket.socket] = []
    for _ in range(1024):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    else:
        raise AssertionError("the backlog never filled")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
        raise AssertionError("the backlog is not full")
    except BlockingIOError:
        pass
    finally:
        probe.close()
    return listener, fillers


def test_a_program_started_while_the_backlog_is_full_registers_once_there_is_room(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    path = os.path.join(sock_dir, "scheduler.sock")
    listener, fillers = _full_listener(path)
    env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_DAEMON_TIMEOUT_MS="30000")
    p = start_probe(plain, env)
    p.ok("init")
    p.send("launch 1")  # its first connect finds the backlog full
    time.sleep(0.5)  # (shorter or longer changes nothing but what is tested)
    went_on = p.answered(0)
    with fs.FakeScheduler(sock_dir, listener=listener) as sched:
        assert not went_on, f"the program went on while the scheduler had no room: {p.stderr()}"
        for s in fillers:  # the churner goes away; the scheduler accepts again
            s.close()
        assert p.answer() == "ok"
        assert sched.wait_for(lambda: sched.count(MsgType.REGISTER) == 1)
        assert sched.count(MsgType.LOCK_REQUEST) >= 1, "the launch was not gated"
        rc, err = p.finish()
    assert_clean(rc, err)
    assert "cannot reach" not in err and "without sharing" not in err, err


def test_no_socket_at_all_still_means_no_scheduler_at_once(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # with the longest patience allowed, a wait would outlast the probe's answer bound
    env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_DAEMON_TIMEOUT_MS="600000")
    p = start_probe(plain, env)
    p.ok("init")
    p.send("launch 1")
    assert p.answered(120), "a missing socket was waited for"
    assert p.answer() == "ok"
    rc, err = p.finish()
    assert_clean(rc, err)
    assert "cannot reach the nvshare scheduler" in err
