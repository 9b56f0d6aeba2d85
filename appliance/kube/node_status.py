"""Publishes what NVML sees on this node as the annotation `nvshare.com/gpu-status` on its Node.

The daemon samples NVML every second and offers each sample here; a thread of its own decides
(`placement.status.publish_reason`: the first sample, a meaningful change, or a refresh when
the last write gets old, never closer together than `minInterval`; a change the rate bound
held back is written as soon as `minInterval` has passed) and writes with one JSON
merge patch of that single annotation, so a slow or failing API server never delays the
scheduler and the Node's other fields are never touched. RBAC: `patch` on nodes, nothing more.

A write that fails is logged once per distinct error (the next attempt waits `minInterval`),
counted in `nvshare_node_status_publish_failures_total`, and said again when writes recover.
The annotation is left in place when the daemon stops: a restart must not make the extender
fall back for every pod, and a daemon that never comes back goes stale by itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.core.gpus import GpuFacts
from appliance.gpu.nvml import GpuSample
from appliance.kube.access import Permission, Permissions, is_forbidden
from appliance.placement.status import (
    ANNOTATION,
    FAILED_RETRY_S,
    GpuStatus,
    NodeGpuStatus,
    PublishState,
    encode,
    held_until,
    publish_reason,
)
from appliance.policy.model import NodeStatusSettings

log = logging.getLogger("nvshare.node_status")

PATCH_NODES = Permission("patch", "nodes")


def node_gpu_status(
    node: str,
    samples: Sequence[GpuSample],
    inventory: Mapping[str, GpuFacts],
    settings: NodeStatusSettings,
) -> NodeGpuStatus:
    """The document for one NVML sample of every GPU."""
    gpus: list[GpuStatus] = []
    for s in samples:
        info = inventory.get(s.uuid)
        gpus.append(
            GpuStatus(
                uuid=s.uuid,
                index=info.index if info and info.index is not None else len(gpus),
                model=(info.model or "") if info else "",
                memory_total=s.memory_total,
                memory_used=s.memory_used,
                memory_free=s.memory_free,
                utilization_percent=s.utilization_percent,
                compute_processes=s.compute_processes,
                healthy=s.healthy,
            )
        )
    return NodeGpuStatus(
        node=node,
        sampled_at=min((s.time for s in samples), default=0.0),
        refresh_s=settings.refresh_interval_s,
        gpus=tuple(gpus),
    )


def _describe(exc: Exception) -> str:
    if isinstance(exc, client.ApiException):
        hint = ""
        if exc.status == 403:
            hint = " (the node daemon's ClusterRole needs `patch` on nodes)"
        elif exc.status == 404:
            hint = " (is --node-name this node's name?)"
        return f"HTTP {exc.status} {exc.reason}{hint}"
    return f"{type(exc).__name__}: {exc}"


class NodeStatusPublisher:
    """Writes the GPU status of `node_name` from its own thread; `offer` never blocks."""

    def __init__(
        self,
        *,
        api_client: client.ApiClient,
        node_name: str,
        inventory: Sequence[GpuFacts],
        settings: NodeStatusSettings,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        permissions: Permissions | None = None,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._permissions = permissions
        self.node_name = node_name
        self._inventory = {g.uuid: g for g in inventory}
        self._settings = settings
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: Sequence[GpuSample] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.state = PublishState()
        self._failing: str | None = None  # the last error said, until a write succeeds
        self._publishes = Counter(
            "nvshare_node_status_publishes",
            "Writes of this node's GPU status to its Node, by reason",
            ["reason"],
            registry=registry,
        )
        self._failures = Counter(
            "nvshare_node_status_publish_failures",
            "Writes of this node's GPU status that the API server refused or did not answer",
            registry=registry,
        )
        self._last = Gauge(
            "nvshare_node_status_last_publish_timestamp_seconds",
            "Wall time of the sample in the last successful write",
            registry=registry,
        )

    def set_settings(self, settings: NodeStatusSettings) -> None:
        with self._cond:
            self._settings = settings

    def offer(self, samples: Sequence[GpuSample]) -> None:
        """The newest NVML sample; an older one not yet looked at is dropped."""
        if not samples:
            return
        with self._cond:
            self._pending = samples
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-status", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        held: Sequence[GpuSample] | None = None  # what the rate bound held back
        due: float | None = None  # and when it may be written
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    wait = None if due is None else due - self._clock()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopping:
                    return
                samples, self._pending = self._pending or held, None
                settings = self._settings
            assert samples is not None
            due = self.consider(samples, settings)
            held = samples if due is not None else None

    def consider(self, samples: Sequence[GpuSample], settings: NodeStatusSettings) -> float | None:
        """Decide on one sample and write it if it is time; on the caller's thread.

        Returns when to look at this sample again: the time at which a write that the rate
        bound held back is due (None: written, or nothing worth writing)."""
        if not settings.publish:
            return None
        status = node_gpu_status(self.node_name, samples, self._inventory, settings)
        now = self._clock()
        reason = publish_reason(self.state, status, now=now, settings=settings)
        if reason is None:
            return held_until(self.state, status, settings=settings)
        self.state = PublishState(self.state.written, self.state.written_at, attempted_at=now)
        body = {"metadata": {"annotations": {ANNOTATION: encode(status)}}}
        try:
            self._api.patch_node(
                self.node_name,
                body,
                _content_type="application/merge-patch+json",
                _request_timeout=(5.0, 10.0),
            )
        except Exception as exc:
            self._failures.inc()
            if is_forbidden(exc) and self._permissions is not None:
                assert isinstance(exc, client.ApiException)
                self._permissions.refused(PATCH_NODES, exc, who="GPU status on the Node")
            said = _describe(exc)
            self.state = dataclasses.replace(self.state, failing=True)
            if said != self._failing:
                log.warning(
                    "cannot publish GPU status on node %s: %s; retrying every %gs at most",
                    self.node_name,
                    said,
                    max(settings.min_interval_s, FAILED_RETRY_S),
                )
                self._failing = said
            return None
        if self._permissions is not None:
            self._permissions.granted(PATCH_NODES)
        if self._failing is not None:
            log.info("GPU status on node %s published again", self.node_name)
            self._failing = None
        self.state = PublishState(written=status, written_at=now, attempted_at=now)
        self._publishes.labels(reason=reason.kind.value).inc()
        self._last.set(status.sampled_at)
        log.debug("published GPU status of %s (%s)", self.node_name, reason.detail)
        return None
