"""Where the HTTP servers listen (metrics and probes, the webhook, the extender): both IP
families by default.

Kubelet probes a pod on its pod IP, which is IPv6 in an IPv6 or dual-stack cluster, and a
server bound to 0.0.0.0 never answers there. So the default host, `::` (or an empty host), is
one IPv6 socket with IPV6_V6ONLY off: it takes IPv6 connections and IPv4 ones as mapped
addresses. Where the host has no IPv6 at all (the kernel booted with ipv6.disable=1) that
socket cannot be made; the server then listens on 0.0.0.0 and says so once. An explicit
address (0.0.0.0, 127.0.0.1, [::1], a name) is taken as given.
"""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from appliance.host.backlog import listen_backlog

log = logging.getLogger("nvshare.listen")

EVERY_ADDRESS = "::"
# What a host without IPv6 answers when asked for an IPv6 socket or address.
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})

S = TypeVar("S", bound=socketserver.TCPServer)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "HOST:PORT", "[V6]:PORT" or ":PORT" (every address)."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def family_of(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class DualStack(socketserver.TCPServer):
    """A server whose socket family follows its host, with IPV6_V6ONLY off on `::`.

    Mixed in before the server class: `class Server(DualStack, ThreadingHTTPServer)`.
    """

    def __init__(self, address: tuple[str, int], *args: object, **kwargs: object) -> None:
        self.address_family = family_of(address[0])
        # socketserver's default backlog is 5: an API server opening connections for a burst of
        # reviews would see its SYNs dropped and retried a second later
        self.request_queue_size = listen_backlog()
        super().__init__(address, *args, **kwargs)  # type: ignore[arg-type]

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == EVERY_ADDRESS:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def bind(make: Callable[[tuple[str, int]], S], host: str, port: int, *, what: str) -> S:
    """`make((host, port))`: a bound server; on `::` (or "") where the host has no IPv6, one on
    0.0.0.0 instead, with a log line saying so."""
    host = host or EVERY_ADDRESS
    try:
        return make((host, port))
    except OSError as exc:
        if host != EVERY_ADDRESS or exc.errno not in _NO_IPV6:
            raise
        log.warning(
            "%s: this host has no IPv6 (%s); listening on 0.0.0.0:%d, IPv4 only",
            what,
            exc.strerror or exc,
            port,
        )
        return make(("0.0.0.0", port))


def serve_in_thread(make: Callable[[tuple[str, int]], S], address: str, *, what: str) -> S:
    """The node daemon's HTTP start-up (the probes, the metrics): `bind` on "HOST:PORT" ("[::]:PORT"
    or ":PORT" for every address of both families), then serve on a daemon thread named `what`.
    The webhook and the extender serve on their main thread instead
    (`appliance.cluster.serving.run_until_stopped`)."""
    host, port = split_address(address)
    server = bind(make, host, port, what=what)
    threading.Thread(target=server.serve_forever, name=what, daemon=True).start()
    return server


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 34\r\n"
    b"Connection: close\r\n\r\ntoo many connections; retry later\n"
)


class BoundedConnections(socketserver.ThreadingMixIn, socketserver.BaseServer):
    """A thread per connection, but only so many, and none held for long by a slow peer.

    Mixed in before the server class. Unbounded, one idle connection kept a thread forever (942
    threads after 150 s), and a peer trickling a request in held its thread as long as it
    liked. Now:
    - at most `max_connections` are served at once, `max_per_peer` of them from one address;
      past that a new connection is answered 503 (plain HTTP; a TLS one is closed) and closed,
      without a thread;
    - every request must arrive whole within `request_deadline_s` of when the server began
      waiting for it (the handler says when: `expect_by`), or its connection is shut down; the
      check runs on the serving thread between accepts (`service_actions`), not a thread each.
    """

    daemon_threads = True
    max_connections = 64
    max_per_peer = 16
    request_deadline_s = 40.0

    _bounded: tuple[threading.Lock, dict[Any, float], Counter[str]]

    def _bounds(self) -> tuple[threading.Lock, dict[Any, float], Counter[str]]:
        # made on first use: the server classes this is mixed into have their own __init__s
        if not hasattr(self, "_bounded"):
            self._bounded = (threading.Lock(), {}, Counter())
        return self._bounded

    def process_request(self, request: Any, client_address: Any) -> None:
        lock, deadlines, peers = self._bounds()
        peer = str(client_address[0]) if isinstance(client_address, tuple) else ""
        with lock:
            busy = len(deadlines) >= self.max_connections or peers[peer] >= self.max_per_peer
            if not busy:
                deadlines[request] = time.monotonic() + self.request_deadline_s
                peers[peer] += 1
        if busy:
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request, peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            peer = str(client_address[0]) if isinstance(client_address, tuple) else ""
            self._forget(request, peer)

    def _forget(self, request: Any, peer: str) -> None:
        lock, deadlines, peers = self._bounds()
        with lock:
            if deadlines.pop(request, None) is not None:
                peers[peer] -= 1
                if peers[peer] <= 0:
                    del peers[peer]

    def expect_by(self, request: Any, deadline: float) -> None:
        """The next request on `request` must have arrived by `deadline` (monotonic);
        `math.inf` while one is being answered."""
        lock, deadlines, _ = self._bounds()
        with lock:
            if request in deadlines:
                deadlines[request] = deadline

    @property
    def connections(self) -> int:
        lock, deadlines, _ = self._bounds()
        with lock:
            return len(deadlines)

    def service_actions(self) -> None:
        super().service_actions()
        lock, deadlines, _ = self._bounds()
        now = time.monotonic()
        with lock:
            overdue = [request for request, deadline in deadlines.items() if deadline < now]
        for request in overdue:
            try:
                request.shutdown(socket.SHUT_RDWR)  # its thread reads the end and leaves
            except OSError:
                pass


def _refuse_busy(request: Any) -> None:
    if isinstance(request, ssl.SSLSocket):
        return  # no handshake for a connection that is not served
    try:
        request.setblocking(False)
        request.send(_BUSY)
    except OSError:
        pass
