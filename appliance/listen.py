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
from collections.abc import Callable
from typing import TypeVar

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
