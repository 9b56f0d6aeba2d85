"""The GPU status a node publishes on its Node, as one small versioned JSON annotation.

Why an annotation on the Node (`nvshare.com/gpu-status`), not a ConfigMap or a custom
resource: it is where an operator already looks (`kubectl describe node`, `kubectl get node
-o jsonpath`), it lives and dies with the node (nothing to garbage-collect), the extender's
node cache gets it with no second watch, and no CRD has to be installed before the daemon can
start. The costs are named where they are paid: every write wakes every Node watcher in the
cluster, so the publisher writes only on a meaningful change or when its last write gets old
(`publish_reason`); and RBAC cannot narrow `patch nodes` to one's own node, so the DaemonSet's
role has exactly that verb and the daemon only ever sends a merge patch of this one key.

The document says when its sample was taken (`sampledAt`) and how often its publisher
promises to rewrite unchanged data (`refreshSeconds`). A reader therefore knows a node's status
is current when it is no older than that promise plus the sample age it tolerates; a node
whose daemon died goes stale on its own.

    {"version": 1, "node": "gpu-1", "sampledAt": "2026-11-22T18:17:08.123Z",
     "refreshSeconds": 60,
     "gpus": [{"uuid": "GPU-...", "index": 0, "model": "NVIDIA H100 80GB HBM3",
               "memoryTotalMiB": 81559, "memoryUsedMiB": 75000, "memoryFreeMiB": 6559,
               "utilizationPercent": 97, "computeProcesses": 1, "healthy": true}]}

Memory is in whole MiB (used rounded up, free rounded down: a reader never sees more room than
there is); `utilizationPercent` and `computeProcesses` are null where NVML cannot tell.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.policy.model import NodeStatusSettings
from appliance.policy.quantity import format_bytes

ANNOTATION = "nvshare.com/gpu-status"
VERSION = 1
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU as NVML saw it; memory in bytes (whole MiB once it has been through JSON)."""

    uuid: str
    index: int
    model: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization_percent: int | None
    compute_processes: int | None
    healthy: bool


@dataclass(frozen=True, slots=True)
class NodeGpuStatus:
    node: str
    sampled_at: float  # seconds since the epoch
    refresh_s: float  # the publisher rewrites unchanged status at least this often
    gpus: tuple[GpuStatus, ...]

    def gpu(self, uuid: str) -> GpuStatus | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


class StatusError(ValueError):
    """An annotation that is not a status document this code understands; says why."""


# ---------------------------------------------------------------- encoding


def _rfc3339(seconds: float) -> str:
    moment = _dt.datetime.fromtimestamp(seconds, tz=_dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def encode(status: NodeGpuStatus) -> str:
    """The annotation's value: compact JSON, keys in a fixed order."""
    doc = {
        "version": VERSION,
        "node": status.node,
        "sampledAt": _rfc3339(status.sampled_at),
        "refreshSeconds": round(status.refresh_s, 3),
        "gpus": [
            {
                "uuid": g.uuid,
                "index": g.index,
                "model": g.model,
                "memoryTotalMiB": g.memory_total // MiB,
                "memoryUsedMiB": -(-g.memory_used // MiB),
                "memoryFreeMiB": g.memory_free // MiB,
                "utilizationPercent": g.utilization_percent,
                "computeProcesses": g.compute_processes,
                "healthy": g.healthy,
            }
            for g in status.gpus
        ],
    }
    return json.dumps(doc, separators=(",", ":"))


# ---------------------------------------------------------------- decoding


def _field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise StatusError(f"{where}{key} is missing")
    value = doc[key]
    # bool is an int in Python; a count or a size must not be true/false.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise StatusError(f"{where}{key} is {json.dumps(value)}, not a number")
    if not isinstance(value, kind):
        raise StatusError(f"{where}{key} is {json.dumps(value)[:40]}, of the wrong type")
    return value


def _count(doc: Mapping[str, Any], key: str, where: str, *, nullable: bool = False) -> int | None:
    value = _field(doc, key, (int, type(None)) if nullable else int, where)
    if value is not None and value < 0:
        raise StatusError(f"{where}{key} is negative ({value})")
    return None if value is None else int(value)


def _parse_time(text: str) -> float:
    try:
        moment = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise StatusError(f"sampledAt {text!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise StatusError(f"sampledAt {text!r} has no time zone")
    return moment.timestamp()


def _gpu(doc: Any, position: int) -> GpuStatus:
    where = f"gpus[{position}]."
    if not isinstance(doc, dict):
        raise StatusError(f"gpus[{position}] is not an object")
    total = _count(doc, "memoryTotalMiB", where)
    used = _count(doc, "memoryUsedMiB", where)
    free = _count(doc, "memoryFreeMiB", where)
    assert total is not None and used is not None and free is not None
    if used > total or free > total:
        raise StatusError(f"{where}memory: {used} MiB used and {free} MiB free of {total} MiB")
    return GpuStatus(
        uuid=_field(doc, "uuid", str, where),
        index=_count(doc, "index", where) or 0,
        model=_field(doc, "model", str, where),
        memory_total=total * MiB,
        memory_used=used * MiB,
        memory_free=free * MiB,
        utilization_percent=_count(doc, "utilizationPercent", where, nullable=True),
        compute_processes=_count(doc, "computeProcesses", where, nullable=True),
        healthy=_field(doc, "healthy", bool, where),
    )


def decode(text: str) -> NodeGpuStatus:
    """The status in an annotation's value, or StatusError saying what is wrong with it."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StatusError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise StatusError("not a JSON object")
    version = _field(doc, "version", int, "")
    if version != VERSION:
        raise StatusError(f"version {version} is not {VERSION}, the one this reader understands")
    gpus = _field(doc, "gpus", list, "")
    refresh = _field(doc, "refreshSeconds", (int, float), "")
    if refresh <= 0:
        raise StatusError(f"refreshSeconds is {refresh}, not a positive number")
    return NodeGpuStatus(
        node=_field(doc, "node", str, ""),
        sampled_at=_parse_time(_field(doc, "sampledAt", str, "")),
        refresh_s=float(refresh),
        gpus=tuple(_gpu(g, i) for i, g in enumerate(gpus)),
    )


# ---------------------------------------------------------------- when to write


class PublishKind(enum.Enum):
    FIRST = "first"
    CHANGE = "change"
    REFRESH = "refresh"


@dataclass(frozen=True, slots=True)
class PublishReason:
    kind: PublishKind
    detail: str


@dataclass(frozen=True, slots=True)
class PublishState:
    """What the publisher last wrote, when, and when it last tried (publisher's clock)."""

    written: NodeGpuStatus | None = None
    written_at: float | None = None
    attempted_at: float | None = None
    failing: bool = False  # the last attempt failed: the next waits FAILED_RETRY_S at least


def _change(before: NodeGpuStatus, now: NodeGpuStatus, memory_change: int) -> str | None:
    if {g.uuid for g in before.gpus} != {g.uuid for g in now.gpus}:
        return "the set of GPUs changed"
    for gpu in now.gpus:
        old = before.gpu(gpu.uuid)
        assert old is not None
        if gpu.healthy != old.healthy:
            return f"GPU {gpu.uuid} is now {'healthy' if gpu.healthy else 'unhealthy'}"
        if gpu.compute_processes != old.compute_processes:
            return (
                f"GPU {gpu.uuid} compute processes {old.compute_processes} -> "
                f"{gpu.compute_processes}"
            )
        moved = gpu.memory_used - old.memory_used
        if abs(moved) >= memory_change:
            sign = "+" if moved > 0 else "-"
            return f"GPU {gpu.uuid} used memory {sign}{format_bytes(abs(moved))}"
    return None


FAILED_RETRY_S = 5.0  # a failing API server is not asked again sooner, whatever minInterval


def _pause(state: PublishState, settings: NodeStatusSettings) -> float:
    if state.failing:
        return max(settings.min_interval_s, FAILED_RETRY_S)
    return settings.min_interval_s


def publish_reason(
    state: PublishState, current: NodeGpuStatus, *, now: float, settings: NodeStatusSettings
) -> PublishReason | None:
    """Why `current` should be written now, or None to leave the Node alone.

    Never twice within `min_interval_s` of the last attempt (nor within `FAILED_RETRY_S` of a
    failed one); otherwise on the first write, on a meaningful change against what the Node
    says now, or when the last successful write is `refresh_interval_s` old.
    """
    if state.attempted_at is not None and now - state.attempted_at < _pause(state, settings):
        return None
    if state.written is None or state.written_at is None:
        return PublishReason(PublishKind.FIRST, "nothing published yet")
    change = _change(state.written, current, settings.memory_change_bytes)
    if change is not None:
        return PublishReason(PublishKind.CHANGE, change)
    if now - state.written_at >= settings.refresh_interval_s:
        return PublishReason(PublishKind.REFRESH, f"last write {now - state.written_at:.0f}s ago")
    return None


def held_until(
    state: PublishState, current: NodeGpuStatus, *, settings: NodeStatusSettings
) -> float | None:
    """When `current`, held back by the rate bound, is due to be written; None when it would
    not be written then either (nothing meaningful changed)."""
    if state.attempted_at is None:
        return None
    due = state.attempted_at + _pause(state, settings)
    return due if publish_reason(state, current, now=due, settings=settings) else None
