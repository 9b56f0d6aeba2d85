"""What the cluster-side HTTP services (the webhook, the scheduler extender) serve alike.

Both answer an API component (kube-apiserver, kube-scheduler) that keeps its connection alive,
expose `/healthz` and `/readyz` for kubelet's probes (ready once their caches have listed), and
own caches that must stop with them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ProbedHandler(BaseHTTPRequestHandler):
    server: CacheBackedServer
    # Keep-alive: the caller reuses its connection for the next request instead of paying a
    # connection (or TLS handshake) each time. An idle connection is closed after `timeout`.
    protocol_version = "HTTP/1.1"
    timeout = 120
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the
    # client's delayed ACK (about 40 ms on Linux) on every request of a kept-alive connection.
    disable_nagle_algorithm = True
    log_as = "http"  # what the debug log calls this service
    log = logging.getLogger("nvshare")

    def log_message(self, format: str, *args: Any) -> None:
        self.log.debug(f"{self.log_as} %s: " + format, self.client_address[0], *args)

    def answer_probe(self) -> bool:
        """Answer GET /healthz and /readyz; False for any other path."""
        if self.path == "/healthz":
            self.send(200, b"ok\n")
        elif self.path == "/readyz":
            ready = self.server.ready()
            self.send(200 if ready else 503, b"ok\n" if ready else b"caches not synced\n")
        else:
            return False
        return True

    def send(self, code: int, payload: bytes, content_type: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class CacheBackedServer(ThreadingHTTPServer):
    """A threaded server whose caches (`sources`, started elsewhere) stop when it closes."""

    daemon_threads = True
    SCHEME = "http"

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[ProbedHandler],
        *,
        ready: Callable[[], bool],
        sources: Sequence[Any],
    ) -> None:
        super().__init__(address, handler)
        self.ready = ready
        self._sources = list(sources)

    def server_close(self) -> None:
        super().server_close()
        for source in self._sources:
            source.stop()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def serve_until_stopped(self, what: str, log: logging.Logger) -> None:
        """Serve until shut down or interrupted, then close, stopping the caches too."""
        host, port = self.server_address[:2]
        log.info("%s listening on %s://%s:%d", what, self.SCHEME, host, port)
        try:
            self.serve_forever()
        finally:
            self.server_close()
