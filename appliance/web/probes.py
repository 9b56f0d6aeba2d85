"""Kubelet's two questions, answered so that they mean something.

`/healthz` (liveness: should kubelet restart this?) and `/readyz` (readiness: is it doing its
job yet?) both answer 200 "ok", or 503 with one line per reason, so `kubectl describe pod`
and a curl show why. Each program gives its reasons; the node daemon's are asked of its event
loop itself (`LoopProbes`): a loop wedged by a blocking call does not answer within
`LOOP_ANSWER_S`, /healthz fails, and kubelet restarts the daemon. A probe answered from a thread
of its own would say "ok" while no hook is served.

The probes are served with the metrics, and on a listener of their own (`serve_probes`,
`--probe-address`) that does not depend on them: seed 003's deployments run with
`NVSHARE_METRICS_ENABLE=0`, and a pod whose probes go with the metrics would never be ready.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance.web.listen import DualStack, serve_in_thread

log = logging.getLogger("nvshare.probes")

Reasons = Callable[[], list[str]]  # why not, one line each; empty when all is well

LOOP_ANSWER_S = 3.0  # well inside the probes' timeoutSeconds (5) in deploy/


def http_answer(reasons: list[str]) -> tuple[int, bytes]:
    if not reasons:
        return 200, b"ok\n"
    return 503, "".join(f"{reason}\n" for reason in reasons).encode()


class LoopProbes:
    """Probes whose reasons are gathered on the event loop (`read`: `Engine.read`)."""

    def __init__(
        self,
        read: Callable[..., Any],
        *,
        not_ready: Reasons,
        unhealthy: Reasons = lambda: [],
    ) -> None:
        self._read = read
        self._not_ready = not_ready
        self._unhealthy = unhealthy

    def health(self) -> list[str]:
        return self._on_loop(self._unhealthy)

    def readiness(self) -> list[str]:
        return self._on_loop(self._not_ready)

    def _on_loop(self, reasons: Reasons) -> list[str]:
        try:
            return list(self._read(reasons, timeout_s=LOOP_ANSWER_S))
        except Exception:  # a timeout, or a loop that is gone
            return [f"the event loop did not answer within {LOOP_ANSWER_S:g}s"]


class _ProbeHandler(BaseHTTPRequestHandler):
    server: ProbeServer
    timeout = 10  # an idle connection does not hold its thread for longer

    def do_GET(self) -> None:
        probe = self.server.probes.get(self.path.split("?", 1)[0])
        code, body = (404, b"not found\n") if probe is None else http_answer(probe())
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # kubelet asks every few seconds; the answers are what matters


class ProbeServer(DualStack, ThreadingHTTPServer):
    """/healthz and /readyz alone; a few connections at a time (kubelet opens one per probe),
    so a flood of connections cannot take a thread each."""

    daemon_threads = True
    MAX_CONNECTIONS = 16

    def __init__(self, address: tuple[str, int], *, health: Reasons, readiness: Reasons) -> None:
        self.probes = {"/healthz": health, "/readyz": readiness}
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        super().__init__(address, _ProbeHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_probes(*, address: str, health: Reasons, readiness: Reasons) -> ProbeServer:
    """Serve /healthz and /readyz on `address` ("HOST:PORT"; "[::]:PORT" or ":PORT" for every
    address of both families) in a daemon thread."""
    return serve_in_thread(
        lambda at: ProbeServer(at, health=health, readiness=readiness), address, what="probes"
    )


def start_probes(address: str, health: Reasons, readiness: Reasons) -> None:
    """`serve_probes`, where an address that cannot be served is said loudly, not fatal."""
    try:
        serve_probes(address=address, health=health, readiness=readiness)
        log.info("probes on http://%s/healthz and /readyz", address)
    except OSError as exc:
        log.error(
            "probes not served: cannot listen on %s (%s); kubelet will find this pod "
            "unhealthy. Give --probe-address a free address",
            address,
            exc.strerror or exc,
        )
