"""The metrics endpoint under a hostile peer: idle connections cost no thread for long, only so
many are served at once, and scrapers at once make the exposition once.

Before: one thread per idle connection, never closed (942 threads after 150 s); 32 concurrent
scrapers each read the status on the event loop and moved the lock hand-off p50 from 3.5 to
64 ms. Loopback clients only, every loop bounded.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.web.metrics_endpoint import serve_metrics

WAIT = 30.0  # a bound for what takes a second or two; never a measurement


class SlowStatus(Collector):
    """A status that takes a while to read, as the event loop's does under load; counts reads."""

    def __init__(self) -> None:
        self.reads = 0
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.reads += 1
        time.sleep(0.2)
        yield GaugeMetricFamily("nvshare_test_value", "a value", value=1)


@pytest.fixture
def metrics() -> Iterator[tuple[int, SlowStatus, object]]:
    registry = CollectorRegistry()
    status = SlowStatus()
    registry.register(status)
    server = serve_metrics(
        address="127.0.0.1:0",
        registry=registry,
        health=lambda: [],
        readiness=lambda: [],
        max_age_s=60.0,  # one exposition for the whole test: what is counted is reads
    )
    yield server.server_address[1], status, server
    server.shutdown()
    server.server_close()


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as answer:
        return answer.status, answer.read().decode()


def test_scrapers_at_once_read_the_status_once(metrics: tuple[int, SlowStatus, object]) -> None:
    port, status, _ = metrics
    bodies: list[str] = []

    def one() -> None:
        bodies.append(scrape(port)[1])

    scrapers = [threading.Thread(target=one) for _ in range(8)]  # at most 8 of one peer at once
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join(WAIT)
    assert len(bodies) == 8 and all("nvshare_test_value 1.0" in b for b in bodies)
    assert status.reads == 1


def test_connections_are_capped_and_an_idle_one_is_closed(
    metrics: tuple[int, SlowStatus, object],
) -> None:
    port, _, server = metrics
    cap = server.max_connections  # type: ignore[attr-defined]
    server.max_per_peer = cap  # type: ignore[attr-defined]  # all of them from this one
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(cap)]
    try:
        deadline = time.monotonic() + WAIT
        while server.connections < cap:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        extra.close()
        assert threading.active_count() <= threads + cap
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + WAIT
    while server.connections:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.request_deadline_s = 1.0  # type: ignore[attr-defined]
    silent = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    assert silent.recv(1) == b""  # closed by the server, having sent nothing in time
    silent.close()
    assert scrape(port, "/healthz") == (200, "ok\n")
