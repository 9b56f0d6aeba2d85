"""A restarted daemon has its programs back at once (issue 24 item 9: 100 programs took 3.1-3.4 s
after it listened). A hook that lost its daemon retried on a doubling backoff (0.1 s up to 5 s),
so a daemon back after a few seconds waited out the hook's next retry; the hook now also watches
the socket file and retries as soon as a new one is there."""

from __future__ import annotations

import time
from typing import Any

from appliance.wire import socket_dirs

from .conftest import Stage, eventually

BACKOFF_SUM_S = 3.1  # the hook's retries after losing its daemon: 0.1, 0.3, 0.7, 1.5, 3.1, 6.3 s


def test_a_program_is_back_as_soon_as_its_restarted_daemon_listens(
    stage: Stage, hooked: Any
) -> None:
    stage.start()
    program = hooked()
    program.ok("init")
    program.ok("info")  # registered
    assert stage.daemon is not None
    stage.daemon.kill()
    stage.daemon.wait()
    time.sleep(BACKOFF_SUM_S + 0.1)  # past its fifth retry: the next is 3.2 s away
    # (the killed daemon's control socket is left: `start` waits for the new one)
    (stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME).unlink()
    stage.start()
    listening = time.monotonic()
    eventually(
        lambda: program.proc.pid in {c["pid"] for c in stage.status()["clients"]},
        "the program registered again",
    )
    # Before: at its sixth retry, 6.3 s after the kill (here at least 2.6 s after listening);
    # now within a service tick or two of the new socket (25 ms each).
    assert time.monotonic() - listening < 2.0
