"""What the core wants done, in the domain's words: the engine routes each to its sink.

Hooks hear about grants, drops, limits and memory; a control client gets its `Reply`; a pod
gets a Warning Event; the device plugin gets a new replica count. The socket server turns the
hook and control actions into frames (`appliance.wire.protocol`); the core never sees the wire.
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass

from appliance.core.annotations import PodRef
from appliance.core.events import Requester
from appliance.core.limits import HookLimits
from appliance.core.published import PublishedLimits

# ------------------------------------------------------------------ to hooks


@dataclass(frozen=True, slots=True)
class Registered:
    """A hook is known now, with the limits it must enforce from the start."""

    client_id: int
    seq: int
    limits: HookLimits


@dataclass(frozen=True, slots=True)
class Grant:
    """The lock is the client's (or it is not gated at all)."""

    client_id: int
    seq: int
    time_quantum_s: float  # how long a stream capture may hold the lock before it hands over
    idle_release_s: float  # give the lock back after this long without submissions
    queue_s: float = 0.0  # keep at most this much work queued (`TermsRule.queue`); 0 = no bound


@dataclass(frozen=True, slots=True)
class LockTerms:
    """New terms for a holder's grant: how long it may sit idle with the lock (shorter while
    someone waits, `scheduler.idleHandoff`), how much work it may keep queued."""

    client_id: int
    time_quantum_s: float
    idle_release_s: float
    queue_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Lent:
    """The client's idle GPU is lent to a lower priority (`lent`), or no longer (not `lent`):
    while lent, its hook submits at once when it has work again and asks for the lock as it goes
    (the request takes the GPU back at once); otherwise it asks and waits, as usual."""

    client_id: int
    lent: bool


@dataclass(frozen=True, slots=True)
class Drop:
    """Release the lock as soon as the work submitted so far is synchronised."""

    client_id: int


@dataclass(frozen=True, slots=True)
class GangDrop:
    """The client's gang drops: say how many collectives it has begun, and begin no more until
    the cut is known."""

    client_id: int
    cut_id: int


@dataclass(frozen=True, slots=True)
class GangCut:
    """Run until `collectives` collectives were submitted, then release like a drop."""

    client_id: int
    cut_id: int
    collectives: int


@dataclass(frozen=True, slots=True)
class GangCutOver:
    """Every member of the client's gang has released: collectives run freely again."""

    client_id: int
    cut_id: int


@dataclass(frozen=True, slots=True)
class LimitsChanged:
    client_id: int
    limits: HookLimits


@dataclass(frozen=True, slots=True)
class MemoryGranted:
    """The answer to a reservation request: `granted` more bytes (0 = refused), `reserved` in
    all now."""

    client_id: int
    seq: int
    granted: int
    reserved: int


@dataclass(frozen=True, slots=True)
class MemoryObserved:
    """What NVML shows the client's process holding, and how much of it goes uncounted (the
    CUDA context)."""

    client_id: int
    used: int
    allowance: int


@dataclass(frozen=True, slots=True)
class PeersChanged:
    """How many processes share the client's memory ledger (pod, GPU), itself included."""

    client_id: int
    processes: int


@dataclass(frozen=True, slots=True)
class MemoryReclaim:
    """Give back every byte reserved and not in use: a peer on the client's ledger was refused
    for want of room that this reservation holds."""

    client_id: int


HookAction = (
    Registered
    | Grant
    | LockTerms
    | Lent
    | Drop
    | GangDrop
    | GangCut
    | GangCutOver
    | LimitsChanged
    | MemoryGranted
    | MemoryObserved
    | PeersChanged
    | MemoryReclaim
)
HOOK_ACTIONS: tuple[type, ...] = typing.get_args(HookAction)

# ---------------------------------------------------------- to everyone else


class Outcome(enum.Enum):
    DONE = "done"
    INVALID = "invalid"  # the request itself is wrong: out of bounds, zero, malformed
    NOT_FOUND = "not found"  # it names no connected client, known GPU or stored override
    REFUSED = "refused"  # the asker may not change state (a tenant, or not root/admin group)


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a control request (TimeQuantumSet, ModeSet, AdminLimitSet), for whoever
    asked: what changed, or why nothing did."""

    to: Requester
    outcome: Outcome
    message: str


@dataclass(frozen=True, slots=True)
class PodWarning:
    """Something the user of a pod should see on it (`kubectl describe pod`)."""

    pod: PodRef
    reason: str  # CamelCase, as Kubernetes Events name reasons
    message: str


@dataclass(frozen=True, slots=True)
class LimitsPublished:
    """What hooks that cannot register should apply changed: write it where they read it."""

    limits: PublishedLimits


@dataclass(frozen=True, slots=True)
class ReplicasChanged:
    """The policy's `devicePlugin.replicasPerGpu` changed: advertise this many per GPU."""

    replicas_per_gpu: int


Action = HookAction | Reply | PodWarning | LimitsPublished | ReplicasChanged
