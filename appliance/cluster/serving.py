"""What the cluster-side HTTP services (the webhook, the scheduler extender) serve alike.

Both answer an API component (kube-apiserver, kube-scheduler) that keeps its connection alive,
listen on both IP families by default (`appliance.web.listen`), expose `/healthz` (fails when a
cache stopped following the API server: a restart mends it) and `/readyz` (fails, with the
reasons, until the policy is loaded and the caches have listed, and while RBAC refuses them a
verb), and own caches that must stop with them.

Neither trusts its peer to be kind (`appliance.web.listen.BoundedConnections`): connections are
capped (503 past the cap), a request must arrive whole in time, bodies are capped (413) and
JSON nested past `MAX_JSON_DEPTH` is refused (400), before any of it reaches the handler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance.web.listen import BoundedConnections, DualStack
from appliance.web.probes import Reasons, http_answer

# Time a peer has to send a request whole once it began (headers and body); and how deep a
# JSON body may nest (a Kubernetes object is a few dozen levels at most).
REQUEST_S = 10.0
MAX_JSON_DEPTH = 100
# Requests read and answered at once (each holds its body and what it parses into); more wait
# for a turn up to REQUEST_S, then are answered 503.
IN_FLIGHT = 8
STOP_S = 1.5  # what stopping may take, so that SIGTERM ends the process within 2 s


class BadBody(Exception):
    """A request body refused before it is handled: the HTTP code and why."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class ProbedHandler(BaseHTTPRequestHandler):
    server: CacheBackedServer
    # Keep-alive: the caller reuses its connection for the next request instead of paying a
    # connection (or TLS handshake) each time. An idle connection is closed after `timeout`.
    protocol_version = "HTTP/1.1"
    timeout = 30
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the
    # client's delayed ACK (about 40 ms on Linux) on every request of a kept-alive connection.
    disable_nagle_algorithm = True
    log_as = "http"  # what the debug log calls this service
    body_read = False  # this request's body is read whole (the connection may serve another)
    request_s = REQUEST_S
    log = logging.getLogger("nvshare")

    def log_message(self, format: str, *args: Any) -> None:
        self.log.debug(f"{self.log_as} %s: " + format, self.client_address[0], *args)

    def handle_one_request(self) -> None:
        # idle up to `timeout` between requests, then the whole request within REQUEST_S
        self.body_read = False
        self.server.expect_by(self.connection, time.monotonic() + self.timeout + self.request_s)
        super().handle_one_request()

    def read_json(self, max_bytes: int) -> Any:
        """The request's JSON body, read whole; BadBody (413 past `max_bytes`, 400 otherwise)
        before anything is read that it refuses."""
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else -1
        except ValueError:
            length = -1
        if length < 0:
            raise BadBody(400, f"Content-Length {str(raw)[:32]!r} is not a byte count")
        if length > max_bytes:
            raise BadBody(413, f"a body of {length} bytes (at most {max_bytes})")
        body = self.rfile.read(length)
        if len(body) < length:
            raise BadBody(400, f"the body ended after {len(body)} of {length} bytes")
        self.body_read = True
        self.server.expect_by(self.connection, math.inf)  # read whole: now it is ours to answer
        try:
            doc = json.loads(body)
        except RecursionError:
            raise BadBody(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadBody(400, f"not JSON: {exc}") from None
        if _depth_beyond(doc, MAX_JSON_DEPTH):
            raise BadBody(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return doc

    def refuse_body(self, refusal: BadBody, what: str) -> None:
        self.log.warning(
            "%s: bad request from %s: %s", self.log_as, self.client_address[0], refusal
        )
        if not self.body_read:  # an unread body must not be taken for the next request
            self.close_connection = True
        self.send(refusal.code, f"expected {what}: {refusal}\n".encode())

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


def _depth_beyond(doc: Any, limit: int) -> bool:
    """Whether `doc` nests containers deeper than `limit` (walked without recursion)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class CacheBackedServer(DualStack, BoundedConnections, ThreadingHTTPServer):
    """A threaded server whose caches (`sources`, started elsewhere) stop when it closes."""

    daemon_threads = True
    SCHEME = "http"
    request_deadline_s = ProbedHandler.timeout + REQUEST_S
    turn_wait_s = REQUEST_S  # what a request waits for a turn (`in_flight`) before a 503

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
        self._turns = threading.BoundedSemaphore(IN_FLIGHT)
        self._sources = list(sources)

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """A turn to read and answer one request body; BadBody(503) when none comes in time."""
        if not self._turns.acquire(timeout=self.turn_wait_s):
            raise BadBody(503, f"{IN_FLIGHT} requests are being answered; retry later")
        try:
            yield
        finally:
            self._turns.release()

    def server_close(self) -> None:
        """Close, and stop the caches: together, within STOP_S (SIGTERM means now; a cache
        still waiting on the API server is left to the process's exit)."""
        super().server_close()
        stopping = [
            threading.Thread(target=source.stop, name="stop-cache", daemon=True)
            for source in self._sources
        ]
        for thread in stopping:
            thread.start()
        deadline = time.monotonic() + STOP_S
        for thread in stopping:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def serve_until_stopped(self, what: str, log: logging.Logger) -> None:
        """Serve until shut down, SIGTERM or interrupted, then close, stopping the caches too
        (all of it within 2 s of the signal)."""
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an IP server's, not a Unix socket's
        shown = f"[{host}]" if ":" in host else host
        if threading.current_thread() is threading.main_thread():
            # SIGTERM: stop serving (within serve_forever's half-second poll), then close
            signal.signal(
                signal.SIGTERM,
                lambda *_: threading.Thread(target=self.shutdown, daemon=True).start(),
            )
        log.info("%s listening on %s://%s:%d", what, self.SCHEME, shown, port)
        try:
            self.serve_forever()
        finally:
            self.server_close()


class Refused(Exception):
    """Why a cluster program cannot start: what to say (a line, then its details) and the exit
    status."""

    def __init__(self, reason: str, *details: str, status: int = 1) -> None:
        super().__init__(reason)
        self.details = details
        self.status = status


def run_until_stopped(
    build: Callable[[], CacheBackedServer], what: str, log: logging.Logger
) -> int:
    """The one start-up of the webhook and the extender: `build` binds the server and starts its
    caches, or raises Refused; then it serves until SIGTERM or an interrupt. 0 once stopped;
    a refusal is logged as `refusing to start: ...` and its status returned."""
    try:
        server = build()
    except Refused as exc:
        log.error("refusing to start: %s", exc)
        for line in exc.details:
            log.error("  %s", line)
        return exc.status
    try:
        server.serve_until_stopped(what, log)
    except KeyboardInterrupt:
        pass
    return 0
