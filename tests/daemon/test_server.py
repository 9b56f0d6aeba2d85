"""The daemon over its real socket: lock traffic, bad peers, permissions, nvsharectl."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.cli.client import ControlClient
from appliance.wire import framing
from appliance.wire import protocol as p

from .conftest import BIN, RunningDaemon, start_daemon, track

GPU = "GPU-11111111-2222-3333-4444-555555555555"


def register(d: RunningDaemon, **kw: object) -> tuple[ControlClient, p.Registered]:
    c = ControlClient.as_hook(d.socket_dir, timeout=5)
    track(c._sock)
    reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=16 << 30, **kw))  # type: ignore[arg-type]
    assert isinstance(reply, p.Registered)
    return c, reply


def test_lock_is_serialised_and_handed_over_on_release(daemon: RunningDaemon) -> None:
    a, ra = register(daemon)
    b, _ = register(daemon)
    assert ra.limits.mode is p.WireMode.ON
    assert isinstance(a.request(p.LockRequest()), p.LockGrant)
    seq = b.send(p.LockRequest())
    a.send(p.LockReleased(p.ReleaseReason.IDLE))
    got_seq, grant = b.receive()
    assert isinstance(grant, p.LockGrant) and got_seq == seq


def test_killed_holder_hands_the_lock_over_at_once(daemon: RunningDaemon) -> None:
    a, _ = register(daemon)
    b, _ = register(daemon)
    a.request(p.LockRequest())
    b.send(p.LockRequest())
    a.close()  # the kernel closes the socket of a process killed with -9 just the same
    start = time.monotonic()
    _, grant = b.receive()
    assert isinstance(grant, p.LockGrant)
    assert time.monotonic() - start < 2.0  # at once, not after the 2 s quantum


def test_quantum_preempts_the_holder_when_someone_waits(daemon: RunningDaemon) -> None:
    a, _ = register(daemon)
    b, _ = register(daemon)
    a.request(p.LockRequest())
    b.send(p.LockRequest())
    _, terms = a.receive()  # someone waits: hand over when idle for scheduler.idleHandoff
    assert terms == p.LockTerms(tq_ms=2000, idle_release_us=5000)
    _, drop = a.receive()
    assert isinstance(drop, p.LockDrop)
    a.send(p.LockReleased(p.ReleaseReason.DROPPED))
    assert isinstance(b.receive()[1], p.LockGrant)


def test_garbage_closes_only_that_connection(daemon: RunningDaemon) -> None:
    good, _ = register(daemon)
    bad = track(socket.socket(socket.AF_UNIX))
    bad.connect(str(daemon.socket_dir / "scheduler.sock"))
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    data = bad.recv(4096)
    frames = framing.FrameDecoder().feed(data)
    reply = framing.decode_body(frames[0])  # type: ignore[arg-type]
    assert isinstance(reply, p.Result) and "bad magic" in reply.message
    assert bad.recv(10) == b""  # closed
    assert isinstance(good.request(p.LockRequest()), p.LockGrant)


def test_unknown_type_and_bad_version_get_error_frames(daemon: RunningDaemon) -> None:
    s = track(socket.socket(socket.AF_UNIX))
    s.connect(str(daemon.socket_dir / "scheduler.sock"))
    s.sendall(p.HEADER.pack(p.MAGIC, p.VERSION, 777, 0, 0, 1))
    s.sendall(p.HEADER.pack(p.MAGIC, 9, p.MsgType.LOCK_REQUEST, 0, 0, 2))
    s.sendall(framing.encode(p.LockRequest(), seq=3))
    dec = framing.FrameDecoder()
    replies: list[p.Result] = []
    while len(replies) < 3:
        replies += [framing.decode_body(f) for f in dec.feed(s.recv(4096))]  # type: ignore[arg-type]
    assert [r.status for r in replies] == [
        p.Status.UNKNOWN_TYPE,
        p.Status.BAD_VERSION,
        p.Status.NOT_REGISTERED,
    ]


def test_a_hook_of_another_release_is_told_and_logged_once_a_minute(
    daemon: RunningDaemon,
) -> None:
    """A program that loaded the hook of an older release before the node was upgraded speaks
    another protocol version: it gets an error frame for each frame, and the daemon's log says
    once (not per frame) what it is and that it runs unshared until it is restarted."""
    old = track(socket.socket(socket.AF_UNIX))
    old.connect(str(daemon.socket_dir / "scheduler.sock"))
    for seq in range(1, 4):
        old.sendall(p.HEADER.pack(p.MAGIC, p.VERSION - 1, p.MsgType.REGISTER, 0, 0, seq))
    dec = framing.FrameDecoder()
    replies: list[p.Result] = []
    while len(replies) < 3:
        replies += [framing.decode_body(f) for f in dec.feed(old.recv(4096))]  # type: ignore[arg-type]
    assert {r.status for r in replies} == {p.Status.BAD_VERSION}
    said = f"protocol version {p.VERSION - 1} is not supported (we speak {p.VERSION})"
    deadline = time.monotonic() + 5
    while said not in daemon.output():
        assert time.monotonic() < deadline, daemon.output()
        time.sleep(0.02)
    line = next(x for x in daemon.output().splitlines() if said in x)
    assert f"pid {os.getpid()}" in line and "another release" in line and "restarted" in line
    assert daemon.output().count(said) == 1


def test_a_client_that_never_reads_does_not_stall_others(daemon: RunningDaemon) -> None:
    hog = track(socket.socket(socket.AF_UNIX))
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect(str(daemon.control_path))
    hog.settimeout(5)
    try:
        for i in range(3000):  # thousands of status replies that nobody reads
            hog.sendall(framing.encode(p.StatusRequest(), seq=i))
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass  # the daemon stopped reading from the hog, or gave up on it, as it should
    other, _ = register(daemon)
    start = time.monotonic()
    assert isinstance(other.request(p.LockRequest()), p.LockGrant)
    assert time.monotonic() - start < 5


def test_half_closed_client_is_treated_as_gone(daemon: RunningDaemon) -> None:
    a, _ = register(daemon)
    b, _ = register(daemon)
    a.request(p.LockRequest())
    b.send(p.LockRequest())
    a._sock.shutdown(socket.SHUT_WR)
    assert isinstance(b.receive()[1], p.LockGrant)


def nvsharectl(
    d: RunningDaemon, *args: str, user: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "nvsharectl"), *args],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=30,
        user=user,
    )


def test_nvsharectl_set_tq_and_anti_thrash(daemon: RunningDaemon) -> None:
    r = nvsharectl(daemon, "-T", "45")
    assert r.returncode == 0 and "time quantum set to 45 s" in r.stdout
    r = nvsharectl(daemon, "--anti-thrash", "off")
    assert r.returncode == 0 and "mode set to off" in r.stdout
    register(daemon)
    r = nvsharectl(daemon, "status", "--json")
    import json

    doc = json.loads(r.stdout)
    assert doc["gpus"][0]["time_quantum_s"] == 45 and doc["gpus"][0]["mode"] == "off"
    assert doc["gpus"][0]["tq_source"] == "nvsharectl"
    r = nvsharectl(daemon)
    assert r.returncode == 0 and f"{GPU[4:12]}  mode off (nvsharectl)" in r.stdout


def test_nvsharectl_rejects_bad_tq_before_asking(daemon: RunningDaemon) -> None:
    r = nvsharectl(daemon, "-T", "0")
    assert r.returncode == 2 and "--set-tq" in r.stderr


def as_user(uid: int, fn: Callable[[], bytes]) -> bytes:
    """Run fn in a forked child that dropped to `uid`; return what it produced."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, fn())
        except BaseException as exc:
            os.write(w, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return data


def reachable_daemon(args: list[str] | None = None) -> tuple[RunningDaemon, Path]:
    # pytest's tmp_path lives under a root-only directory; nobody must reach this socket.
    tmp = Path(tempfile.mkdtemp(prefix="nvshare-perm-"))
    tmp.chmod(0o755)
    daemon = start_daemon(tmp, "scheduler: {timeQuantum: 2s}\n", args=args)
    daemon.socket_dir.chmod(0o755)
    return daemon, tmp


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user (uid 65534) needs root"
)


@needs_root
def test_only_root_changes_state_but_anyone_reads_status() -> None:
    daemon, tmp = reachable_daemon()
    try:
        _check_permissions(daemon)
    finally:
        daemon.stop()
        shutil.rmtree(tmp)


@needs_root
def test_members_of_the_admin_group_may_change_state() -> None:
    daemon, tmp = reachable_daemon(["--admin-group", "nogroup"])  # gid 65534, nobody's group
    try:

        def ask() -> bytes:
            with ControlClient(daemon.socket_dir) as c:
                return repr(c.request(p.SetTq(7))).encode()

        reply = as_user(65534, ask).decode()
        assert "Status.OK" in reply and "time quantum set to 7 s" in reply
    finally:
        daemon.stop()
        shutil.rmtree(tmp)


def _check_permissions(daemon: RunningDaemon) -> None:
    def ask(message: object) -> bytes:
        with ControlClient(daemon.socket_dir) as c:
            return repr(c.request(message)).encode()

    refused = as_user(65534, lambda: ask(p.SetTq(5))).decode()
    assert "PERMISSION" in refused and "only root may set the time quantum" in refused
    assert "nothing changed" in refused
    status = as_user(65534, lambda: ask(p.StatusRequest())).decode()
    assert "JsonBody" in status and "STATUS_REPLY" in status
    with ControlClient(daemon.socket_dir) as c:
        doc = c.request(p.StatusRequest()).doc
    assert doc["default_time_quantum_s"] == 2  # unchanged


def test_nvsharectl_without_daemon_is_one_clear_line(tmp_path: Path) -> None:
    env = {"NVSHARE_SOCKET_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [str(BIN / "nvsharectl"), "status"], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no nvshare scheduler is running" in r.stderr
