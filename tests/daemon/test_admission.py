"""Running out of files is said once a minute, in a line, not once per failed accept with a
traceback; the daemon raises its own open-files limit; and a user or pod opening connections in
a loop is refused past its rate, alone."""

from __future__ import annotations

import logging
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from appliance.policy.model import ConnectionSettings
from appliance.serve.admission import Admission, EveryMinute, raise_open_files

# The daemon's own socket server, short of files: every connection past its limit fails in
# accept(), over and over, for three seconds.
SERVER = """
import asyncio, logging, os, resource, sys
import uvloop
from pathlib import Path
from appliance.serve.server import SchedulerServer
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
async def main():
    server = SchedulerServer(
        socket_dir=Path(sys.argv[1]), control_dir=Path(sys.argv[1]) / "control",
        dispatch=lambda event: None, status=None, queries={}, view=None, open_files=1000,
    )
    await server.start()
    print("listening", flush=True)
    await asyncio.sleep(3)
    sys.stderr.flush()
    os._exit(0)  # as it was: whatever the loop would say on the way out is not the point
uvloop.run(main())
"""


def test_accept_failing_for_want_of_files_is_one_line() -> None:
    base = Path(tempfile.mkdtemp(prefix="nvs-ad-"))  # short: socket paths have 108 bytes
    path = base / "scheduler.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    clients = []
    for _ in range(100):
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(str(path))
        except BlockingIOError:
            pass  # the backlog is full: still a pending accept
        clients.append(c)
    _, err = server.communicate(timeout=30)
    for c in clients:
        c.close()
    shutil.rmtree(base, ignore_errors=True)
    assert err.count("cannot accept connections") == 1, err
    assert "Too many open files" in err and "Traceback" not in err


def test_what_is_unsaid_is_counted() -> None:
    now = [0.0]
    notes = EveryMinute(clock=lambda: now[0])
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("nvshare.server")
    logger.addHandler(handler)
    try:
        for _ in range(5):
            notes.warn("k", "refusing %s", "x")
        now[0] = 61.0
        notes.warn("k", "refusing %s", "x")
    finally:
        logger.removeHandler(handler)
    assert said == ["refusing x", "refusing x (4 more like it in the last minute)"]


def test_the_open_files_limit_is_raised_toward_what_is_wanted() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        want = 512 if hard == resource.RLIM_INFINITY else min(512, hard)
        assert raise_open_files(512) == want
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_opening_connections_in_a_loop_is_refused_past_the_rate_and_only_for_that_tenant() -> None:
    now = [0.0]
    caps = ConnectionSettings(per_uid=8, per_pod=4, new_per_second=2)
    admission = Admission(total=1000, caps=lambda: caps, clock=lambda: now[0])
    churner, honest, pod = ("uid", "1001"), ("uid", "1002"), ("pod", "p-1")
    for _ in range(8):  # a burst up to its cap passes at once
        assert admission.admit(churner) is None
        admission.release(churner)  # connect, close, connect again
    refusal = admission.admit(churner)
    assert refusal is not None and "connections.newPerSecond=2" in refusal
    assert "uid 1001" in refusal and "perUid=8" in refusal
    assert admission.admit(honest) is None  # another user is not held back
    for _ in range(4):
        assert admission.admit(pod) is None
        admission.release(pod)
    assert admission.admit(pod) is not None  # a pod's burst is its perPod cap
    now[0] = 1.0  # two more a second
    assert admission.admit(churner) is None
    admission.release(churner)
    assert admission.admit(churner) is None
    admission.release(churner)
    assert admission.admit(churner) is not None
    now[0] = 1000.0  # an idle tenant has its whole burst again, and no more
    for _ in range(8):
        assert admission.admit(churner) is None
        admission.release(churner)
    assert admission.admit(churner) is not None


def test_past_the_open_files_limit_no_tenant_or_two_takes_every_connection() -> None:
    caps = ConnectionSettings(per_uid=1024, per_pod=256, new_per_second=64)
    admission = Admission(total=96, caps=lambda: caps, clock=lambda: 0.0)
    first, second, newcomer = ("uid", "1001"), ("uid", "1002"), ("uid", "1003")
    held = {key: 0 for key in (first, second, newcomer)}
    for key in (first, second):
        while admission.admit(key) is None:
            held[key] += 1
    assert held[first] == 48  # half of what the daemon can hold, though perUid allows 1024
    assert held[second] == 36  # up to the last eighth, kept for tenants holding a few
    refusal = admission.admit(second)
    assert refusal is not None and "last 12 are kept" in refusal
    while admission.admit(newcomer) is None:
        held[newcomer] += 1
    assert held[newcomer] == 8
