"""Events the scheduler core accepts and actions it returns (sans-I/O, like h11)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.core.identity import ClientIdentity
from appliance.core.pods import PodInfo, PodOverrides, PodRef
from appliance.policy.model import Limits, Mode, Policy
from appliance.protocol import ReleaseReason

# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asked a control request, as the socket server numbers it; the core only echoes it
    back on its `Reply`."""

    connection: int = 0
    seq: int = 0


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
class PolicyChanged:
    policy: Policy


@dataclass(frozen=True, slots=True)
class PodUpdated:
    pod: PodInfo
    overrides: PodOverrides


@dataclass(frozen=True, slots=True)
class PodRemoved:
    pod: PodRef


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
    """`nvsharectl limit set/clear`: target is ("pid", pid) or ("pod", "ns/name")."""

    target: tuple[str, str]
    limits: Limits
    clear_memory: bool = False
    clear_core: bool = False
    by: str = "nvsharectl"
    reply_to: Requester = Requester()


@dataclass(frozen=True, slots=True)
class GpuFreeMemory:
    """A real-time sample of a GPU's free memory (NVML), including non-hooked processes, and
    what each process holds on it (pids as the daemon sees them: it runs with the host's). It is
    as old as the time it is handled at."""

    samples: Mapping[str, int]  # uuid -> free bytes
    processes: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # uuid -> pid -> bytes


@dataclass(frozen=True, slots=True)
class Tick:
    """The deadline the core asked for (`Scheduler.next_deadline`) has passed."""


Event = (
    ClientRegistered
    | ClientGone
    | LockRequested
    | LockReleased
    | MemoryReserveRequested
    | MemoryReturned
    | PolicyChanged
    | PodUpdated
    | PodRemoved
    | TimeQuantumSet
    | ModeSet
    | AdminLimitSet
    | GpuFreeMemory
    | Tick
)

# ----------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Send:
    client_id: int
    message: Any  # a body from appliance.protocol
    seq: int = 0


class Outcome(enum.Enum):
    DONE = "done"
    INVALID = "invalid"  # the request itself is wrong: out of bounds, zero, malformed
    NOT_FOUND = "not found"  # it names no connected client, known GPU or stored override


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a control request (TimeQuantumSet, ModeSet, AdminLimitSet), for whoever
    asked: what changed, or why nothing did."""

    to: Requester
    outcome: Outcome
    message: str


Action = Send | Reply
