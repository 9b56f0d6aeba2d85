"""The metrics endpoint: /metrics, /healthz and /readyz over HTTP, in threads of its own.

Kept apart from `appliance.web.metrics` (what the series are): this is how they are served to
scrapers and kubelet without either costing the scheduler much, whoever connects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from appliance.web.listen import BoundedConnections, DualStack, serve_in_thread
from appliance.web.probes import Reasons, http_answer

log = logging.getLogger("nvshare.metrics")


class Exposition:
    """The text a scrape gets, made at most every `max_age_s` however many scrape.

    Each exposition reads the status on the event loop and formats every series: 32 scrapers
    at once made it 32 times over, and moved the lock hand-off p50 from 3.5 to 64 ms. Now one
    scraper makes it while the others wait for that one, and all of them get it.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._made: tuple[float, bytes] | None = None
        self.made = 0  # how many times it was made (for tests and the bench)

    def text(self) -> bytes:
        with self._lock:
            now = self._clock()
            if self._made is None or now - self._made[0] >= self._max_age_s:
                self._made = (now, generate_latest(self._registry))
                self.made += 1
            return self._made[1]


class _QuietHandler(WSGIRequestHandler):
    timeout = 5  # each read of a request; the whole of it within the server's deadline

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _MetricsServer(DualStack, BoundedConnections, WSGIServer):
    """Threaded (a probe must be answered while a scrape waits on the event loop), but only
    so many threads (`BoundedConnections`): an idle connection used to keep one forever."""

    daemon_threads = True
    max_connections = 16
    max_per_peer = 8
    request_deadline_s = 10.0


def serve_metrics(
    *,
    address: str,
    registry: CollectorRegistry,
    health: Reasons,
    readiness: Reasons,
    max_age_s: float = 1.0,
) -> WSGIServer:
    """Serve /metrics, /healthz and /readyz on `address` ("HOST:PORT"; "[::]:PORT" or
    ":PORT" for every address of both families) in a daemon thread; /metrics at most
    `max_age_s` old (`Exposition`)."""
    exposition = Exposition(registry, max_age_s=max_age_s)
    probes = {"/healthz": health, "/readyz": readiness}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            body = exposition.text()
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [body]
        code, body = http_answer(probe())
        status = "200 OK" if code == 200 else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain")])
        return [body]

    return serve_in_thread(
        lambda at: make_server(at[0], at[1], app, _MetricsServer, _QuietHandler),
        address,
        what="metrics",
    )


def start_metrics(
    address: str, registry: CollectorRegistry, health: Reasons, readiness: Reasons
) -> None:
    """`serve_metrics`, where an address that cannot be served is said loudly, not fatal:
    scheduling matters more than metrics."""
    try:
        serve_metrics(address=address, registry=registry, health=health, readiness=readiness)
        log.info("metrics on http://%s/metrics", address)
    except OSError as exc:
        log.error(
            "metrics disabled: cannot serve on %s (%s); set metrics.address to a free "
            "address or metrics.enabled to false",
            address,
            exc.strerror or exc,
        )
