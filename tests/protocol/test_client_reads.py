"""The client's reads as a waiter on select sees them, over a real Unix socket."""

from __future__ import annotations

import selectors
import socket
from pathlib import Path

from appliance.cli.client import ControlClient
from appliance.wire import framing
from appliance.wire import protocol as p


def test_every_frame_one_read_brought_is_handed_over(tmp_path: Path) -> None:
    """A daemon that writes a `Lent` and then a grant, read in one go: a caller woken by select
    gets both (with `receive` alone the grant sat in the client's buffer, where select never
    woke for it: the hand-off benchmark waited 60 s for it after some 30,000 hand-offs)."""
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    client = ControlClient(tmp_path, path=path, timeout=5)
    conn, _ = server.accept()
    conn.sendall(framing.encode(p.LockLent(), seq=0) + framing.encode(p.LockGrant(30000), seq=4))
    sel = selectors.DefaultSelector()
    sel.register(client._sock, selectors.EVENT_READ)
    assert sel.select(5), "the frames never arrived"
    read = client.receive_read()
    assert read == [p.LockLent(), p.LockGrant(30000)]
    assert not sel.select(0.05), "nothing more was sent"
    conn.sendall(framing.encode(p.HeartbeatAck(), seq=5))
    assert sel.select(5)
    assert client.receive_read() == [p.HeartbeatAck()]
    client.close()
    conn.close()
    server.close()
