"""The typed policy every other part of the appliance reads.

The loader (`appliance.policy.load`) is the only producer: it validates files against
`schema/policy.schema.json`, and `appliance.policy.build` parses quantities once (bytes,
seconds) and builds these objects.
Everything downstream (the scheduler core, the pod watcher, the device plugin) reads these
frozen values and never sees a raw YAML string such as "4Gi".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The time quantum's floor: nvshare's thesis measured throughput collapse below about 10 s, and
# under 1 s the lock hand-off itself dominates. Policy, nvsharectl and the daemon share it.
MIN_TIME_QUANTUM_S = 1.0
# Every duration's ceiling: a day is far past any sensible quantum or idle time. (The hook is
# sent the quantum in milliseconds and the idle window in microseconds, in 64 bits.)
MAX_DURATION_S = 86_400.0
# Priorities by name; policy, annotations and status speak both the names and the integers.
PRIORITY_NAMES = {"low": -100, "normal": 0, "high": 100}
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


def priority_value(value: str | int) -> int:
    """A priority as written in policy (a name or an integer) as its integer."""
    return PRIORITY_NAMES[value] if isinstance(value, str) else value


def priority_name(value: int) -> str:
    """How status shows a priority: its name where it has one ("high"), else the integer."""
    names = {v: k for k, v in PRIORITY_NAMES.items()}
    return names.get(value, str(value))


class Mode(enum.Enum):
    """How a GPU's lock is shared. Wire values are in `appliance.wire.protocol`."""

    OFF = "off"  # everyone runs concurrently
    ON = "on"  # strict serialisation (nvshare's anti-thrashing)
    AUTO = "auto"  # concurrent while the running clients' memory fits, serialised otherwise


class Backing(enum.Enum):
    DEVICE = "device"
    MANAGED = "managed"


class RealtimeCheckMode(enum.Enum):
    STRICT = "strict"
    WARNING = "warning"
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    mode: Mode = Mode.ON
    time_quantum_s: float = 30.0
    compute_window_s: float = 0.5  # compute quotas (coreLimit) are accounted in these
    request_window_s: float = 2.0  # guaranteed shares (coreRequest) are owed in these
    quota_sample_interval_s: float = 0.05
    carry_over_percent: int = 100
    drop_tail_billing_percent: int = 70
    idle_release_s: float = 1.0
    drop_deadline_s: float = 5.0
    preempt_after_s: float = 1.0  # a higher priority waits at most this slice of a holder's
    starvation_limit_s: float = 30.0  # a lower priority waits at most this, then a quantum
    idle_handoff_s: float = 0.005  # idle this long while someone waits: hand the lock over
    reclaim_ahead_s: float = 0.005  # a steady lender's GPU is kept at most this before its request
    borrower_queue_s: float = 0.0005  # work a borrower of a higher priority keeps queued at most


@dataclass(frozen=True, slots=True)
class MemorySettings:
    backing: Backing = Backing.DEVICE
    single_process_oversubscription: bool = False
    reserve_bytes: int = 0  # kept free on every GPU, never granted to clients
    chunk_bytes: int = 64 << 20  # reservation granted to a hook per round trip
    kernel_backstop: bool = False  # set driver-enforced hard limits per cgroup (gpu/backstop.py)
    backstop_allowance_bytes: int = 768 << 20  # per process, beyond the memory limit


@dataclass(frozen=True, slots=True)
class NodeStatusSettings:
    """How the node daemon publishes its GPUs' real status for the scheduler extender."""

    publish: bool = True
    min_interval_s: float = 0.5
    refresh_interval_s: float = 60.0
    memory_change_bytes: int = 100 << 20


@dataclass(frozen=True, slots=True)
class RealtimeCheck:
    """The real-time memory check, with HAMi's meaning for its settings (`mode_for`).

    `mode_set` / `enabled_set`: whether a policy file or the environment said so, rather than
    the schema's default. Left unset, the check is off, and whatever turns it on (a pod's
    annotation, the switch, `enabledByDefault: true`) turns it on in `strict`, HAMi's default.
    """

    mode: RealtimeCheckMode = RealtimeCheckMode.DISABLED
    safety_margin_bytes: int = 100 << 20
    enabled_by_default: bool = True
    max_sample_age_s: float = 5.0
    node_status: NodeStatusSettings = NodeStatusSettings()
    mode_set: bool = False
    enabled_set: bool = False

    def published(self) -> NodeStatusSettings:
        """How the node publishes: a used-memory change as large as the safety margin is
        meaningful whatever `memoryChange` says, since a view off by more than the margin
        lets the extender pass a node that is short."""
        change = min(self.node_status.memory_change_bytes, self.safety_margin_bytes)
        return dataclasses.replace(self.node_status, memory_change_bytes=max(change, 1))

    def mode_for(self, *, pod_opt_in: bool | None, switch: bool | None = None) -> RealtimeCheckMode:
        """The mode for one pod or client, as HAMi decides it.

        A mode set to `disabled` (HAMI_REALTIME_CHECK_MODE=disabled) skips the check for
        everyone. Otherwise the check applies where the pod's annotation
        (`hami.io/enable-realtime-check`) says "true", or, without one, where the switch
        (`--enable-realtime-check`, HAMI_ENABLE_REALTIME_CHECK) says on, or, without that,
        where `enabledByDefault` set in a file says so, or else where a mode other than
        disabled is set. It then runs in the set mode, or `strict` where none is set.
        """
        if self.mode is RealtimeCheckMode.DISABLED and self.mode_set:
            return RealtimeCheckMode.DISABLED
        if pod_opt_in is not None:
            on = pod_opt_in
        elif switch is not None:
            on = switch
        elif self.enabled_set:
            on = self.enabled_by_default
        else:
            on = self.enabled_by_default and self.mode is not RealtimeCheckMode.DISABLED
        if not on:
            return RealtimeCheckMode.DISABLED
        if self.mode is RealtimeCheckMode.DISABLED:
            return RealtimeCheckMode.STRICT
        return self.mode


@dataclass(frozen=True, slots=True)
class UnhookedProcesses:
    """How GPU processes without the hook are reported (`appliance.core.unhooked`)."""

    grace_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Limits:
    """A partial set of limits; None means "not set here"."""

    memory_bytes: int | None = None
    core_percent: int | None = None
    priority: int | None = None
    core_request: int | None = None  # guaranteed percent (`core.share`)


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """Every given field must match; an empty match matches every client."""

    namespace: str | None = None
    pod_name: str | None = None  # fnmatch glob
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    uid: int | None = None
    user: str | None = None
    group: str | None = None
    systemd_unit: str | None = None  # fnmatch glob
    executable: str | None = None  # fnmatch glob on the resolved /proc/<pid>/exe path


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    match: RuleMatch
    limits: Limits
    mode: Mode | None = None  # OFF exempts matched clients from gating
    source: str = ""  # "file.yaml#/rules/0"


@dataclass(frozen=True, slots=True)
class GpuMatch:
    uuid: str | None = None
    index: int | None = None
    model: str | None = None  # fnmatch glob on the NVML name


@dataclass(frozen=True, slots=True)
class GpuRule:
    match: GpuMatch
    mode: Mode | None = None
    time_quantum_s: float | None = None
    memory_bytes: int | None = None  # declared size; lets tests declare a smaller GPU
    source: str = ""


@dataclass(frozen=True, slots=True)
class AnnotationPolicy:
    allowed: bool = True
    max_memory_bytes: int | None = None
    min_core_percent: int = 1
    max_core_percent: int = 100
    max_core_request: int = 50  # 100 let one pod's request starve every other
    min_priority: int = PRIORITY_NAMES["low"]
    max_priority: int = PRIORITY_NAMES["normal"]  # high is the operator's to give


@dataclass(frozen=True, slots=True)
class DevicePluginSettings:
    replicas_per_gpu: int = 10
    resource_name: str = "nvshare.com/gpu"


@dataclass(frozen=True, slots=True)
class MigFallback:
    chains: tuple[tuple[str, ...], ...] = ()
    annotation: str = "nvshare.com/mig-fallback"  # what the webhook writes on a rewritten pod


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    enabled: bool = True
    address: str = "[::]:9402"  # every address, both families


@dataclass(frozen=True, slots=True)
class TrustSettings:
    """What the daemon takes on a client's word; everything else comes from the kernel or NVML."""

    pod_claim_uids: frozenset[int] = frozenset()  # may name their pod where the cgroup shows none
    hook_gpu_size: bool = False  # without NVML or a declared size, the first hook's word


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """Caps on the daemon's socket connections, so no user or pod can use up its files."""

    per_uid: int = 1024  # processes of one user outside pods
    per_pod: int = 256  # processes of one pod, whatever their uids
    new_per_second: int = 64  # new connections of one user or pod, sustained (bursts: the cap)


@dataclass(frozen=True, slots=True)
class Policy:
    version: int = 1
    scheduler: SchedulerSettings = SchedulerSettings()
    memory: MemorySettings = MemorySettings()
    realtime_check: RealtimeCheck = RealtimeCheck()
    unhooked_processes: UnhookedProcesses = UnhookedProcesses()
    defaults: Limits = Limits(core_percent=100, priority=0, core_request=0)
    rules: tuple[Rule, ...] = ()
    gpus: tuple[GpuRule, ...] = ()
    annotations: AnnotationPolicy = AnnotationPolicy()
    device_plugin: DevicePluginSettings = DevicePluginSettings()
    mig_fallback: MigFallback = MigFallback()
    metrics: MetricsSettings = MetricsSettings()
    trust: TrustSettings = TrustSettings()
    connections: ConnectionSettings = ConnectionSettings()
    # Provenance: JSON path of each value ("/scheduler/timeQuantum") -> where it came from
    # ("10-team.yaml", "env NVSHARE_COMPUTE_WINDOW_MS" or "default").
    sources: Mapping[str, str] = field(default_factory=dict)
    # What each of those replaced: JSON path -> the earlier files that set it too, oldest first.
    overridden: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The merged document as the schema names it (camelCase, quantities as written), for
    # `nvsharectl policy show`; everything else reads the typed fields above.
    document: Mapping[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    content_hash: str = ""
