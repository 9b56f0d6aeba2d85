"""How long a listen backlog the kernel allows (the node daemon's sockets and the HTTP servers)."""

from __future__ import annotations

import socket
from pathlib import Path

_SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def listen_backlog() -> int:
    """The longest listen backlog the kernel allows. Every CUDA program starting at once, or one
    process connecting and closing in a loop, queues here until accepted; with 128, a churner
    kept it full and programs starting meanwhile found no room."""
    try:
        return max(socket.SOMAXCONN, int(_SOMAXCONN.read_text()))
    except (OSError, ValueError):
        return socket.SOMAXCONN
