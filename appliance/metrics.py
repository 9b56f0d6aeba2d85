"""Prometheus metrics, read from the scheduler's state at scrape time.

Names follow nvshare's fork (`nvshare_gpu_*`, `nvshare_client_*`, `nvshare_scheduler_*`) so
existing dashboards keep working; policy reload health is `nvshare_policy_*`. The collector
reads the same typed `StatusView` as `nvsharectl status` (through a snapshot function that the
daemon runs on the event loop), so tests scrape a real registry without a daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.events import ReleaseReason
from appliance.core.state import Phase
from appliance.core.views import PolicyStatus, StatusView
from appliance.listen import DualStack, bind, split_address
from appliance.probes import Reasons, http_answer
from appliance.protocol import wire_mode

Snapshot = Callable[[], StatusView]

_COUNTERS = (
    ("grants", "Lock grants"),
    ("registrations", "Client registrations"),
    ("disconnects", "Client disconnections"),
    ("memory_refusals", "Memory reservations refused"),
    ("limit_updates", "Limit updates pushed to hooks"),
    ("realtime_warnings", "Real-time checks that would have refused (warning mode)"),
    ("realtime_refusals", "Reservations refused by the real-time check"),
    ("drops_overdue", "Holders passed over: not released within scheduler.dropDeadline"),
    ("releases_late", "Releases that arrived after the drop deadline had passed"),
)


class ApplianceCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        status = self._snapshot()
        yield from _gpus(status)
        yield from _unhooked(status)
        yield from _clients(status)
        yield from _scheduler(status)
        if status.policy is not None:
            yield from _policy(status.policy)


def _gpus(status: StatusView) -> Iterator[Metric]:
    labels = ["gpu_uuid"]
    mode = GaugeMetricFamily(
        "nvshare_gpu_mode", "Scheduling mode: 0 off, 1 on, 2 auto", labels=labels
    )
    tq = GaugeMetricFamily("nvshare_gpu_time_quantum_seconds", "Time quantum", labels=labels)
    mem = GaugeMetricFamily(
        "nvshare_gpu_memory_total_bytes",
        "GPU memory the scheduler plans with (declared or reported)",
        labels=labels,
    )
    holders = GaugeMetricFamily(
        "nvshare_gpu_lock_holders", "Clients holding the lock", labels=labels
    )
    queue = GaugeMetricFamily(
        "nvshare_gpu_queue_length", "Clients waiting for the lock", labels=labels
    )
    for g in status.gpus:
        label = [g.uuid]
        mode.add_metric(label, wire_mode(g.mode))
        tq.add_metric(label, g.time_quantum_s)
        mem.add_metric(label, g.memory_total)
        holders.add_metric(label, len(g.holders))
        queue.add_metric(label, len(g.queue))
    yield from (mode, tq, mem, holders, queue)


def _unhooked(status: StatusView) -> Iterator[Metric]:
    """Per GPU, so the label set stays as small as the node's GPUs whatever runs on them."""
    count = GaugeMetricFamily(
        "nvshare_gpu_unhooked_processes",
        "Compute processes NVML lists that never registered with the scheduler (unshared)",
        labels=["gpu_uuid"],
    )
    per_gpu = dict.fromkeys((g.uuid for g in status.gpus), 0)
    for process in status.unhooked:
        for gpu in process.gpus:
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    for uuid, n in sorted(per_gpu.items()):
        count.add_metric([uuid], n)
    yield count


def _clients(status: StatusView) -> Iterator[Metric]:
    labels = ["client_id", "pid", "pod", "gpu_uuid"]
    used = GaugeMetricFamily(
        "nvshare_client_memory_used_bytes", "Memory the client allocated", labels=labels
    )
    limit = GaugeMetricFamily(
        "nvshare_client_memory_limit_bytes", "Effective memory limit (0 = none)", labels=labels
    )
    core = GaugeMetricFamily(
        "nvshare_client_core_limit_percent", "Effective compute share", labels=labels
    )
    holding = GaugeMetricFamily(
        "nvshare_client_holding_lock", "1 while holding the lock", labels=labels
    )
    late = GaugeMetricFamily(
        "nvshare_client_late_drops",
        "Drops the client did not release within scheduler.dropDeadline",
        labels=labels,
    )
    for c in status.clients:
        label = [str(c.id), str(c.pid), c.pod, c.gpu]
        used.add_metric(label, c.memory_used)
        limit.add_metric(label, c.memory_limit or 0)
        core.add_metric(label, c.core_limit)
        holding.add_metric(label, 1 if c.state in (Phase.HOLDING, Phase.DRAINING) else 0)
        late.add_metric(label, c.late_drops)
    yield from (used, limit, core, holding, late)


def _scheduler(status: StatusView) -> Iterator[Metric]:
    counters = status.counters
    clients = GaugeMetricFamily("nvshare_scheduler_clients", "Connected clients")
    clients.add_metric([], len(status.clients))
    yield clients
    for name, help_text in _COUNTERS:
        fam = CounterMetricFamily(f"nvshare_scheduler_{name}", help_text)
        fam.add_metric([], counters.get(name, 0))
        yield fam
    drops = CounterMetricFamily(
        "nvshare_scheduler_drops", "Lock drops by reason", labels=["reason"]
    )
    for reason in ("quantum", "quota"):
        drops.add_metric([reason], counters.get(f"drops_{reason}", 0))
    yield drops
    releases = CounterMetricFamily(
        "nvshare_scheduler_releases", "Lock releases by reason", labels=["reason"]
    )
    for release in ReleaseReason:
        releases.add_metric([release.value], counters.get(f"releases_{release.value}", 0))
    yield releases


def _policy(policy: PolicyStatus) -> Iterator[Metric]:
    valid = GaugeMetricFamily("nvshare_policy_valid", "1 if the last reload attempt was valid")
    valid.add_metric([], 1 if policy.valid else 0)
    yield valid
    last = GaugeMetricFamily(
        "nvshare_policy_last_reload_timestamp_seconds",
        "Wall time of the last reload attempt",
    )
    last.add_metric([], policy.last_reload_time or 0)
    yield last
    reloads = CounterMetricFamily(
        "nvshare_policy_reloads", "Policy reloads by result", labels=["result"]
    )
    for result, n in sorted(policy.reload_counts.items()):
        reloads.add_metric([result], n)
    yield reloads


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _MetricsServer(DualStack, ThreadingMixIn, WSGIServer):
    """Threaded: a probe must be answered while a scrape waits on the event loop."""

    daemon_threads = True


def serve_metrics(
    *, address: str, registry: CollectorRegistry, health: Reasons, readiness: Reasons
) -> WSGIServer:
    """Serve /metrics, /healthz and /readyz on `address` ("HOST:PORT"; "[::]:PORT" or
    ":PORT" for every address of both families) in a daemon thread."""
    metrics_app = make_wsgi_app(registry)
    probes = {"/healthz": health, "/readyz": readiness}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics_app(environ, start_response)
        code, body = http_answer(probe())
        status = "200 OK" if code == 200 else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain")])
        return [body]

    host, port = split_address(address)
    server = bind(
        lambda at: make_server(at[0], at[1], app, _MetricsServer, _QuietHandler),
        host,
        port,
        what="metrics",
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
