"""What the core shows, as typed objects: status, explain, nvsharectl's overrides, the policy.

nvsharectl reads them from the daemon's JSON (`from_json`), the metrics collector and the
device plugin from the core itself (through the engine, on the event loop); nobody reads a
status document by string keys. Building a view changes nothing. `to_json` writes the documents
`nvsharectl ... --json` prints, with the field names below.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from appliance.core.gang import label
from appliance.core.gpus import GpuUse
from appliance.core.gputime import (
    NO_LOCK_TIME,
    LockTime,
    PodView,
    QuotaUse,
    lock_time,
    pod_views,
    quota_use,
)
from appliance.core.limits import describe
from appliance.core.share import guaranteed_percent
from appliance.core.state import Client, DroppedOverride, NodeState, Phase, UnhookedProcess
from appliance.policy.model import Mode, Policy

T = TypeVar("T")
Queue = Callable[[str], list[int]]  # a GPU's waiting clients, in the order of grants
Rows = tuple["ClientView", ...]


class QueryError(Exception):
    """A question asked with arguments that make no sense; the message says which."""


# ------------------------------------------------------------------ status


@dataclass(frozen=True, slots=True)
class GpuView:
    uuid: str
    index: int | None
    model: str | None
    mode: Mode
    mode_source: str  # "policy" or "nvsharectl"
    time_quantum_s: float
    tq_source: str
    memory_total: int  # what the scheduler plans with (declared or reported)
    holders: tuple[int, ...]
    queue: tuple[int, ...]
    core_requested: int = 0  # its clients' guaranteed shares together; over 100: scaled down


@dataclass(frozen=True, slots=True)
class ClientView:
    id: int
    pid: int  # as the daemon sees it (the host's)
    uid: int
    pod: str  # NAMESPACE/NAME, "(claimed)" when only the client says so, "-" for none
    pod_source: str | None
    gpu: str
    state: Phase
    memory_limit: int | None
    core_limit: int
    gated: bool
    memory_used: int  # what its hook counts (the ledger)
    memory_reserved: int
    memory_observed: int | None  # what NVML shows its process holding (the context included)
    held_for_s: float | None
    waiting_for_s: float | None
    limits_from: Mapping[str, str]
    late_drops: int = 0  # drops it did not release within scheduler.dropDeadline
    namespace: str = ""  # of its pod; "" outside pods
    pod_name: str = ""
    pod_uid: str = ""
    lock: LockTime = NO_LOCK_TIME
    quota: QuotaUse | None = None
    memory_refusals: int = 0  # allocations refused, by the scheduler or by its hook
    priority: int = 0  # higher is granted first (`core.priority`)
    core_request: int = 0  # guaranteed percent it asks for (`core.share`)
    core_guaranteed: float = 0.0  # what it is guaranteed: the request, scaled if over 100
    gang: str = ""  # the gang it holds its GPUs with (`core.gang`); "" for a lone client
    command: str | None = None  # its process's name (/proc/<pid>/comm), read by the daemon


@dataclass(frozen=True, slots=True)
class UnhookedView:
    """A GPU process NVML lists that never registered with the scheduler: it runs unshared."""

    pid: int
    uid: int
    pod: str  # NAMESPACE/NAME, "pod UID" for a pod this node does not know, "-" for none
    executable: str | None
    gpus: tuple[str, ...]
    memory_used: int | None  # on all its GPUs, as NVML shows it; None where NVML does not say
    seen_for_s: float
    command: str | None = None  # its process's name (/proc/<pid>/comm)
    gpu_memory: Mapping[str, int | None] = field(default_factory=dict)  # per GPU of `gpus`


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    """How the policy directory's hot reload is doing."""

    dir: str
    hash: str
    files: tuple[str, ...]
    valid: bool  # the last reload attempt was valid
    watching: bool
    last_error: str | None
    last_reload_time: float | None
    reload_counts: Mapping[str, int]
    env_overrides: Mapping[str, str]  # variable -> the JSON path it sets


@dataclass(frozen=True, slots=True)
class BackstopView:
    """The kernel-enforced backstop on one GPU (the daemon's `gpu.backstop` fills it in)."""

    gpu: str
    active: bool
    code: str  # "active", or why not: off, nvml, driver, cgroup, mig, permission, unsupported
    reason: str  # the same in words: what is missing, and what to do
    limits: Mapping[str, int]  # cgroup directory -> the hard limit set there, in bytes


@dataclass(frozen=True, slots=True)
class StatusView:
    gpus: tuple[GpuView, ...]
    clients: tuple[ClientView, ...]
    counters: Mapping[str, int]
    default_mode: Mode  # the policy's scheduler.mode
    default_time_quantum_s: float  # in force: nvsharectl's, else the policy's
    policy: PolicyStatus | None = None  # the daemon adds what the core does not know
    nvml: bool | None = None
    unhooked: tuple[UnhookedView, ...] = ()
    use: tuple[GpuUse, ...] = ()  # what NVML last showed of each GPU
    pods: tuple[PodView, ...] = ()
    time: float = 0.0  # the daemon's monotonic clock when the view was built
    mode_set: Mode | None = None  # nvsharectl's mode for every GPU (-S); None: the policy's
    time_quantum_set_s: float | None = None  # nvsharectl's (-T); None: the policy's
    policy_time_quantum_s: float = 0.0  # the policy's scheduler.timeQuantum
    dropped: tuple[DroppedOverride, ...] = ()  # what policy reloads replaced, oldest first
    backstop: tuple[BackstopView, ...] = ()  # the daemon adds it, per GPU


def client_view(s: NodeState, c: Client, now: float) -> ClientView:
    pod, _ = s.pod_of(c.ident)
    return ClientView(
        id=c.id,
        pid=c.ident.pid,
        uid=c.ident.uid,
        pod=s.pod_label(c),
        pod_source=c.pod_source or None,
        gpu=c.gpu,
        state=c.phase,
        memory_limit=c.limits.memory_bytes,
        core_limit=c.limits.core_percent,
        gated=c.gated,
        memory_used=c.used,
        memory_reserved=c.reserved,
        memory_observed=c.nvml_used,
        held_for_s=round(now - c.granted_at, 3) if c.phase is Phase.HOLDING else None,
        waiting_for_s=round(now - c.requested_at, 3) if c.phase is Phase.WAITING else None,
        limits_from=c.limits.sources.as_dict(),
        late_drops=c.late_drops,
        namespace=pod.namespace if pod else "",
        pod_name=pod.name if pod else "",
        pod_uid=s.pod_uid(c) or "",
        lock=lock_time(c, now),
        quota=quota_use(s, c, now),
        memory_refusals=c.refusals,
        priority=c.limits.priority,
        core_request=c.limits.core_request,
        core_guaranteed=guaranteed_percent(c),
        gang=label(s.gangs[c.gang]),
        command=c.ident.command,
    )


def gpu_view(s: NodeState, uuid: str, queue: Queue) -> GpuView:
    gpu, modes = s.gpus[uuid], s.overrides.modes
    return GpuView(
        uuid=uuid,
        index=gpu.facts.index,
        model=gpu.facts.model,
        mode=s.gpu_mode(uuid),
        mode_source="nvsharectl" if (uuid in modes or "" in modes) else "policy",
        time_quantum_s=s.time_quantum(uuid),
        tq_source="nvsharectl" if s.overrides.time_quantum_s else "policy",
        memory_total=s.gpu_memory(uuid),
        holders=tuple(sorted(gpu.holders)),
        queue=tuple(queue(uuid)),
        core_requested=gpu.requested_percent,
    )


def unhooked_view(s: NodeState, p: UnhookedProcess, now: float) -> UnhookedView:
    ident = p.ident
    pod = s.pods.pods.get(ident.pod_uid) if ident.pod_uid else None
    label = (
        f"{pod.namespace}/{pod.name}" if pod else f"pod {ident.pod_uid}" if ident.pod_uid else "-"
    )
    known = [n for n in p.memory.values() if n is not None]
    return UnhookedView(
        pid=ident.pid,
        uid=ident.uid,
        pod=label,
        executable=ident.executable,
        gpus=tuple(sorted(p.memory)),
        memory_used=sum(known) if known else None,
        seen_for_s=round(now - p.first_seen, 3),
        command=ident.command,
        gpu_memory=dict(p.memory),
    )


def status(s: NodeState, now: float, queue: Queue, clients: Rows | None = None) -> StatusView:
    """`clients`: rows built before (`queries.Answers`); `queue`: from the lock's line."""
    if clients is None:
        clients = tuple(client_view(s, c, now) for c in s.clients.values())
    return StatusView(
        gpus=tuple(gpu_view(s, uuid, queue) for uuid in sorted(s.gpus)),
        clients=clients,
        counters=dict(s.counters),
        default_mode=s.policy.scheduler.mode,
        default_time_quantum_s=s.overrides.time_quantum_s or s.policy.scheduler.time_quantum_s,
        unhooked=tuple(
            unhooked_view(s, p, now) for _, p in sorted(s.unhooked.items()) if p.reported
        ),
        pods=pod_views(s, clients),
        use=tuple(s.use[uuid] for uuid in sorted(s.use)),
        time=now,
        mode_set=s.overrides.modes.get(""),
        time_quantum_set_s=s.overrides.time_quantum_s,
        policy_time_quantum_s=s.policy.scheduler.time_quantum_s,
        dropped=tuple(s.overrides.dropped),
    )


def load(s: NodeState) -> dict[str, int]:
    """Connected clients per GPU, for the device plugin's placement."""
    return dict(Counter(c.gpu for c in s.clients.values()))


# ------------------------------------------------------------------ explain


@dataclass(frozen=True, slots=True)
class ExplainRow:
    """One client's effective limits and what set each of them."""

    client: int
    pid: int
    pod: str
    gpu: str
    memory: str  # "4Gi (from annotation)"
    core: str
    gated: str
    priority: str = ""  # "high (from annotation)"
    request: str = ""  # "30% (from rule 'serving')"
    backstop: str = ""  # the kernel-enforced limit on its cgroup, or why there is none


@dataclass(frozen=True, slots=True)
class ExplainView:
    clients: tuple[ExplainRow, ...]


@dataclass(frozen=True, slots=True)
class ExplainQuery:
    """`policy explain`: exactly one of a pid and a pod (NAMESPACE/NAME)."""

    pid: int | None = None
    pod: str | None = None

    @classmethod
    def from_request(cls, doc: Mapping[str, Any]) -> ExplainQuery:
        pid, pod = doc.get("pid"), doc.get("pod")
        if pid is not None and (type(pid) is not int or pid <= 0):
            raise QueryError(f"explain: pid must be a positive whole number, not {pid!r:.40}")
        if pod is not None and (not isinstance(pod, str) or pod.count("/") != 1):
            raise QueryError(f"explain: pod must be NAMESPACE/NAME, not {pod!r:.80}")
        if (pid is None) == (pod is None):
            raise QueryError("explain: give exactly one of pid and pod")
        return cls(pid=pid, pod=pod)


def explain(s: NodeState, query: ExplainQuery) -> ExplainView:
    rows = []
    for c in s.clients.values():
        label = s.pod_label(c)
        if query.pid is not None and c.ident.pid != query.pid:
            continue
        if query.pod is not None and label.split(" ")[0] != query.pod:
            continue
        said = describe(c.limits)
        rows.append(
            ExplainRow(
                c.id,
                c.ident.pid,
                label,
                c.gpu,
                said["memory"],
                said["core"],
                said["gated"],
                priority=said["priority"],
                request=said["request"],
            )
        )
    return ExplainView(tuple(rows))


# ------------------------------------------------------------------ overrides


@dataclass(frozen=True, slots=True)
class OverrideRow:
    target: str  # "pid 123", "pod ns/name"
    memory_limit: int | None
    core_limit: int | None
    clients: tuple[int, ...]  # pids it reaches now


@dataclass(frozen=True, slots=True)
class OverridesView:
    """What nvsharectl set: limit overrides, the time quantum and modes ("*": every GPU)."""

    limits: tuple[OverrideRow, ...]
    time_quantum_s: float | None
    modes: Mapping[str, Mode]


def overrides(s: NodeState) -> OverridesView:
    stored = s.overrides.limits
    rows = tuple(
        OverrideRow(
            target=str(target),
            memory_limit=stored[target].memory_bytes,
            core_limit=stored[target].core_percent,
            clients=tuple(sorted({c.ident.pid for c in s.reached(target)})),
        )
        for target in sorted(stored)
    )
    modes = {uuid or "*": mode for uuid, mode in s.overrides.modes.items()}
    return OverridesView(rows, s.overrides.time_quantum_s, modes)


# ------------------------------------------------------------------ policy


@dataclass(frozen=True, slots=True)
class PolicyView:
    """`policy show`: the merged document, and each value with what set it."""

    dir: str
    hash: str
    files: tuple[str, ...]
    document: Mapping[str, Any]
    values: Mapping[str, tuple[Any, str]]  # JSON path -> (value, what set it)
    overridden: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def policy_view(policy: Policy, directory: str) -> PolicyView:
    return PolicyView(
        dir=directory,
        hash=policy.content_hash,
        files=policy.files,
        document=_plain(policy.document),
        values={
            path: (_lookup(policy.document, path), source)
            for path, source in sorted(policy.sources.items())
        },
        overridden=dict(policy.overridden),
    )


def _lookup(doc: Any, json_path: str) -> Any:
    """The value at a JSON path like /rules/0/memoryLimit in the merged policy document."""
    for part in json_path.strip("/").split("/"):
        if isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            return None
    return _plain(doc)


# ------------------------------------------------------------------ JSON


def to_json(value: Any) -> Any:
    """A view as JSON values: dataclasses as objects, enums as their values."""
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, (list, tuple)):  # (a GPU's queue: thousands of ints, passed as is)
        return [v if type(v) is int else _plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def from_json(cls: type[T], doc: Any) -> T:
    """A view from what `to_json` wrote, guided by the dataclass's field types."""
    return typing.cast(T, _decode(cls, doc))


def _decode(kind: Any, value: Any) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        (real,) = [a for a in args if a is not type(None)]
        return _decode(real, value)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        fields = [f for f in dataclasses.fields(kind) if f.name in value]
        return kind(**{f.name: _decode(hints[f.name], value[f.name]) for f in fields})  # type: ignore[operator]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin in (Mapping, dict):
        return {k: _decode(args[1], v) for k, v in value.items()}
    return value
