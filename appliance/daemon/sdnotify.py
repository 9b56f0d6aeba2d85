"""systemd's notify protocol, so the daemon can be a Type=notify service with a watchdog.

systemd starts dependents only after READY=1, shows STATUS= in `systemctl status`, holds
`systemctl reload` until READY=1 follows RELOADING=1, and restarts the daemon if WATCHDOG=1
stops arriving. The protocol is one datagram of newline-separated assignments to the AF_UNIX
socket named by $NOTIFY_SOCKET ('@' means the abstract namespace); outside systemd the variable
is absent and every call is a cheap no-op. Written here rather than depending on a package for
twenty lines.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


def _address(environ: Mapping[str, str]) -> str | bytes | None:
    raw = environ.get("NOTIFY_SOCKET", "")
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock and other transports are not used for a node daemon


def notify(*states: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send states such as "READY=1", "STATUS=serving 3 clients", "WATCHDOG=1".

    RELOADING=1 gets the MONOTONIC_USEC=... that systemd 253+ requires with it. Returns True
    if the datagram was sent, False when not running under systemd or the socket is gone.
    """
    address = _address(os.environ if environ is None else environ)
    if address is None or not states:
        return False
    lines = list(states)
    if "RELOADING=1" in lines and not any(s.startswith("MONOTONIC_USEC=") for s in lines):
        lines.append(f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    message = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError:
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds within which systemd expects WATCHDOG=1, or None when no watchdog is set up.

    Send WATCHDOG=1 at about half this interval. A WATCHDOG_PID naming another process means
    the watchdog is not ours (a child inherited the environment).
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000
