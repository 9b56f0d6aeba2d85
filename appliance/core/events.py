"""What the core is told: typed, frozen inputs (sans-I/O, like h11's events).

Sources make them: the socket server from hooks' and nvsharectl's frames, the pod watch, the
policy watcher, the NVML sampler; the engine's timer makes `Tick`. The core's answers are in
`actions`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from appliance.core.annotations import PodInfo, PodRef
from appliance.core.identity import ClientIdentity
from appliance.policy.model import Limits, Mode, Policy

# ------------------------------------------------------------------ hooks


@dataclass(frozen=True, slots=True)
class ClientRegistered:
    client_id: int
    seq: int
    ident: ClientIdentity
    gpu_uuid: str
    gpu_total_memory: int
    env_memory_bytes: int = 0
    env_core_percent: int = 0


@dataclass(frozen=True, slots=True)
class ClientGone:
    client_id: int


@dataclass(frozen=True, slots=True)
class LockRequested:
    client_id: int
    seq: int
    catch_up: bool = False  # a gang member behind its gang's cut asks to get there (`gang`)


@dataclass(frozen=True, slots=True)
class GangHint:
    """The job a client names (NVSHARE_GANG, or torch.distributed's rendezvous), sent right
    after it registers; it groups only processes of one user outside pods (`gang`)."""

    client_id: int
    name: str


@dataclass(frozen=True, slots=True)
class PriorityHint:
    """The priority a client asks for itself (NVSHARE_GPU_PRIORITY), sent right after it
    registers; taken only where it is lower than the one policy and annotations give it."""

    client_id: int
    priority: int


@dataclass(frozen=True, slots=True)
class GangPosition:
    """How many collectives a gang member had begun when told its gang drops."""

    client_id: int
    cut_id: int
    collectives: int


class ReleaseReason(enum.Enum):
    DROPPED = "dropped"  # it was told to drop
    IDLE = "idle"  # nothing submitted for the idle-release time
    EXIT = "exit"
    UNDRAINED = "undrained"  # a stream capture outlived the quantum: handed over unsynchronised


@dataclass(frozen=True, slots=True)
class LockReleased:
    client_id: int
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class MemoryReserveRequested:
    client_id: int
    seq: int
    bytes: int
    used: int


@dataclass(frozen=True, slots=True)
class MemoryReturned:
    client_id: int
    bytes: int
    used: int


@dataclass(frozen=True, slots=True)
class MemoryRefusedByHook:
    """Allocations a hook refused on its own (over the limit it knows) since its last report."""

    client_id: int
    count: int
    largest: int  # bytes


# ---------------------------------------------------------- policy, pods, GPUs


@dataclass(frozen=True, slots=True)
class PolicyChanged:
    policy: Policy


@dataclass(frozen=True, slots=True)
class PodSeen:
    """A pod of this node appeared or changed (labels, annotations)."""

    pod: PodInfo


@dataclass(frozen=True, slots=True)
class PodRemoved:
    pod: PodRef


@dataclass(frozen=True, slots=True)
class PodsListed:
    """The pod watch listed every pod of this node (at start, and after each relist)."""

    uids: frozenset[str]


@dataclass(frozen=True, slots=True)
class GpuFreeMemory:
    """A real-time sample of a GPU's free memory (NVML), including non-hooked processes, and
    what each process holds on it (pids as the daemon sees them: it runs with the host's). It is
    as old as the time it is handled at."""

    samples: Mapping[str, int]  # uuid -> free bytes
    processes: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # uuid -> pid -> bytes
    used: Mapping[str, int] = field(default_factory=dict)  # uuid -> bytes in use, anyone's
    utilization: Mapping[str, int | None] = field(default_factory=dict)  # uuid -> percent


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process NVML lists on a GPU, and who the kernel says it is (`/proc`)."""

    gpu_uuid: str
    ident: ClientIdentity
    memory_bytes: int | None  # what NVML shows it holding there; None where NVML does not say


@dataclass(frozen=True, slots=True)
class GpuProcessesSeen:
    """Every compute process on the GPUs whose processes NVML could list (`gpus`), hooked or
    not. A GPU NVML could not list is missing from `gpus`: nothing is known about it."""

    gpus: frozenset[str]
    processes: tuple[GpuProcess, ...]


@dataclass(frozen=True, slots=True)
class Tick:
    """The deadline the core asked for (`NodeCore.next_deadline`) has passed."""


# ------------------------------------------------------------------ nvsharectl


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asked a control request: the connection and sequence number the socket server echoes
    on the `Reply`, and who the kernel says the asking process is (the core decides whether it
    may)."""

    connection: int = 0
    seq: int = 0
    ident: ClientIdentity | None = None


@dataclass(frozen=True, slots=True, order=True)
class LimitTarget:
    """Whom an nvsharectl limit override is for: a process (while it is connected) or a pod."""

    kind: Literal["pid", "pod"]
    name: str  # the pid, or NAMESPACE/NAME

    @classmethod
    def pid(cls, pid: int) -> LimitTarget:
        return cls("pid", str(pid))

    @classmethod
    def pod(cls, namespace: str, name: str) -> LimitTarget:
        return cls("pod", f"{namespace}/{name}")

    @classmethod
    def pod_of(cls, pod: PodInfo) -> LimitTarget:
        return cls.pod(pod.namespace, pod.name)

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class TimeQuantumSet:
    """`nvsharectl -T`: seconds, or None to follow the policy again. `by` names who asked."""

    seconds: float | None
    by: str = "nvsharectl"
    reply_to: Requester = Requester()


@dataclass(frozen=True, slots=True)
class ModeSet:
    """`nvsharectl mode`/`-S`: a mode, or None to follow the policy again."""

    mode: Mode | None
    gpu_uuid: str = ""  # empty: every GPU
    by: str = "nvsharectl"
    reply_to: Requester = Requester()


@dataclass(frozen=True, slots=True)
class AdminLimitSet:
    """`nvsharectl limit set/clear`; a request that names no target (None) is refused."""

    target: LimitTarget | None
    limits: Limits
    clear_memory: bool = False
    clear_core: bool = False
    by: str = "nvsharectl"
    reply_to: Requester = Requester()


Event = (
    ClientRegistered
    | ClientGone
    | LockRequested
    | LockReleased
    | GangHint
    | PriorityHint
    | GangPosition
    | MemoryReserveRequested
    | MemoryReturned
    | MemoryRefusedByHook
    | PolicyChanged
    | PodSeen
    | PodRemoved
    | PodsListed
    | GpuFreeMemory
    | GpuProcessesSeen
    | Tick
    | TimeQuantumSet
    | ModeSet
    | AdminLimitSet
)
