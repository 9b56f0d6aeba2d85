"""What the cluster-side HTTP services (the webhook, the scheduler extender) serve alike.

Both answer an API component (kube-apiserver, kube-scheduler) that keeps its connection alive,
listen on both IP families by default (`appliance.listen`), expose `/healthz` (fails when a
cache stopped following the API server: a restart mends it) and `/readyz` (fails, with the
reasons, until the policy is loaded and the caches have listed, and while RBAC refuses them a
verb), and own caches that must stop with them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance.listen import DualStack
from appliance.probes import Reasons, http_answer


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
        probe = {"/healthz": self.server.unhealthy, "/readyz": self.server.not_ready}.get(self.path)
        if probe is None:
            return False
        self.send(*http_answer(probe()))
        return True

    def send(self, code: int, payload: bytes, content_type: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class CacheBackedServer(DualStack, ThreadingHTTPServer):
    """A threaded server whose caches (`sources`, started elsewhere) stop when it closes."""

    daemon_threads = True
    SCHEME = "http"

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[ProbedHandler],
        *,
        not_ready: Reasons = lambda: [],
        unhealthy: Reasons = lambda: [],
        sources: Sequence[Any] = (),
    ) -> None:
        super().__init__(address, handler)
        self.not_ready = not_ready
        self.unhealthy = unhealthy
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
        assert isinstance(host, str)  # an IP server's, not a Unix socket's
        shown = f"[{host}]" if ":" in host else host
        log.info("%s listening on %s://%s:%d", what, self.SCHEME, shown, port)
        try:
            self.serve_forever()
        finally:
            self.server_close()
