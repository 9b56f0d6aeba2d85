"""What the core knows, each fact once: clients, GPUs, pods, nvsharectl's overrides, counters.

Plain data and the reads every part of the core shares (a GPU's mode, time quantum and size
after policy and overrides; a client's pod, ledger subject and limits). Each part of the core
changes only what its job owns: `lock` the queues and phases, `ledger` the reservations,
`admin` the overrides, `annotations.PodTable` the pods; `node.NodeCore` is the only way in.
"""

from __future__ import annotations

import enum
import functools
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from appliance.core.annotations import PodInfo, PodTable
from appliance.core.drops import DropReason
from appliance.core.events import LimitTarget
from appliance.core.gpus import GpuFacts, GpuUse
from appliance.core.identity import ClientIdentity
from appliance.core.limits import (
    EffectiveLimits,
    GpuSettings,
    HookLimits,
    gpu_settings,
    resolve_limits,
)
from appliance.core.quota import GuaranteeAccount, QuotaAccount
from appliance.policy.model import Limits, Mode, Policy


class Phase(enum.Enum):
    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    DRAINING = "draining"  # told to drop, still synchronising
    OVERDUE = "overdue"  # told to drop and past the drop deadline: no longer counted as holding


# What `ahead` reads a steady pace from: a client's last requests after it let the lock go idle
ARRIVALS = 6  # (five intervals)
DRAINS = 8  # and a GPU's last drains

# Pods whose clients have all left keep their lock time this long in number (the least recently
# used are forgotten first), so a pod of short-lived processes keeps its totals without the
# table growing with every pod the node ever ran.
RETAINED_PODS = 1024


@dataclass(slots=True)
class LockUsage:
    """Time with the lock, exactly as the lock saw it: held (grant to release, the drain
    included), waited (request to grant), and drops by reason."""

    held_s: float = 0.0
    waited_s: float = 0.0
    drops: Counter[DropReason] = field(default_factory=Counter)

    def add(self, other: LockUsage) -> None:
        self.held_s += other.held_s
        self.waited_s += other.waited_s
        self.drops.update(other.drops)


@dataclass(slots=True)
class RetainedPod:
    """What the departed clients of a pod used, kept while the pod may come back."""

    namespace: str
    name: str
    usage: LockUsage = field(default_factory=LockUsage)


# What a client has until its registration resolves its limits.
_UNRESOLVED = EffectiveLimits(memory_bytes=None, core_percent=100, exempt=False)
_UNSET = HookLimits(memory_bytes=None, core_percent=100, mode=Mode.ON)


@dataclass(slots=True)
class Client:
    id: int
    ident: ClientIdentity
    gpu: str
    env_memory: int
    env_core: int
    env_priority: int | None = None  # NVSHARE_GPU_PRIORITY, as its hook sent it
    limits: EffectiveLimits = _UNRESOLVED
    enforced: HookLimits = _UNSET  # what its hook was last told
    phase: Phase = Phase.IDLE
    request_seq: int = 0
    requested_at: float = 0.0
    granted_at: float = 0.0
    reserved: int = 0
    used: int = 0
    quota: QuotaAccount | None = None
    guarantee: GuaranteeAccount | None = None  # its guaranteed share, if it asks for one
    requeue: bool = False  # asked for the lock again while draining
    dropped_at: float = 0.0  # when it was last told to drop
    late_drops: int = 0  # drops it did not finish within the drop deadline
    told: tuple[float, float] = (0.0, 0.0)  # the idle window and queue bound last told its hook
    lent_told: bool = False  # its hook was told its idle GPU is lent (`terms.LendingRule`)
    gang: str = ""  # the key of the gang it takes the lock with (`core.gang`)
    gang_hint: str = ""  # the job it names (NVSHARE_GANG, torch.distributed's rendezvous)
    job: str = ""  # its gang's key (`gang.gang_key`), fixed when it first asks
    asked: bool = False  # it has asked for the lock at least once
    pod_source: str = ""  # "cgroup", "claimed" or ""
    peers_told: int = 1  # processes on its ledger, as the hook last heard it
    nvml_used: int | None = None  # what NVML last showed its process holding
    nvml_told: int | None = None
    usage: LockUsage = field(default_factory=LockUsage)
    refusals: int = 0  # allocations refused, by the ledger here or by its hook
    usage_capped: bool = False  # once reported more usage than it may hold (logged once)

    @property
    def footprint(self) -> int:
        return max(self.used, self.reserved)

    @property
    def gated(self) -> bool:
        return self.enforced.mode is not Mode.OFF


@dataclass(slots=True)
class Gpu:
    facts: GpuFacts
    holders: set[int] = field(default_factory=set)  # clients holding its lock
    owners: set[str] = field(default_factory=set)  # gangs it is granted to (`Gang.key`)
    requested_percent: int = 0  # its tenants' guaranteed shares together, before scaling
    clients: set[int] = field(default_factory=set)  # registered on it
    asking: set[int] = field(default_factory=set)  # of those, the ones with a share (`share`)
    last_drop: DropReason | None = None  # why its last holder was told to drop, until a grant
    # its holders' last drains, drop to release (`ahead`)
    drains: deque[float] = field(default_factory=lambda: deque(maxlen=DRAINS))


class GangPhase(enum.Enum):
    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    DRAINING = "draining"  # told to drop: until every member has released


@dataclass(slots=True)
class Cut:
    """The drop of a gang of several clients (`core.gang`): where each member's collectives
    stood when told, and the count all of them run to before they release."""

    id: int
    expected: set[int]  # members asked where they stand
    positions: dict[int, int] = field(default_factory=dict)  # member -> collectives begun
    collectives: int | None = None  # the cut, once every member answered


@dataclass(slots=True)
class Gang:
    """What the lock is granted to: clients that hold their GPUs together (`core.gang`)."""

    key: str
    members: set[int] = field(default_factory=set)
    gpus: set[str] = field(default_factory=set)  # what it takes together
    held: set[str] = field(default_factory=set)  # what it holds now
    asked: set[str] = field(default_factory=set)  # GPUs its members asked for this turn
    phase: GangPhase = GangPhase.IDLE
    ticket: int = 0  # its place in line
    requested_at: float = 0.0
    waiting_since: float = 0.0  # starvation clock (`PriorityRule.starved`): kept if `cut_short`
    served_s: float = 0.0  # held in turns cut short since that clock started
    cut_short: bool = False
    granted_at: float = 0.0
    dropped_at: float = 0.0
    billed_until: float = 0.0
    offender: bool = False  # overran its last drop: queued behind everyone who did not
    late: bool = False  # a member was passed over in the drop under way
    priority: int = 0  # its members' highest (`core.priority`)
    lent_at: float | None = None  # let the lock go idle: lower priorities since borrow it
    idle_s: float = 0.0  # its idle window while it outranks every waiter, learned (`terms`)
    request_s: float = 0.0  # how long it holds before an idle release, learned (`terms`)
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVALS))
    pace: tuple[float, float] | None = None  # of `arrivals` (asks after lending), when steady
    full_quantum: bool = False  # granted as starved: no priority takes this grant early
    quantum_from: float = 0.0  # its quantum runs from here: the grant, or the one a share cut
    borrowed_until: float = 0.0  # granted a GPU lent (`Line.borrowing`): its quantum ends then
    borrowed_at: float = 0.0  # its last such grant (such grants go round: `bucket.Bucket`)
    share_cut: bool = False  # dropped for a waiter's share: its quantum goes on when granted
    share_grant: bool = False  # granted for its share: it gives way once it has had it
    quota: QuotaAccount | None = None  # of a gang of several clients; a lone client's is its own
    cut: Cut | None = None

    @property
    def joint(self) -> bool:
        """Several clients: a drop runs the cut protocol."""
        return len(self.members) > 1


@dataclass(slots=True)
class UnhookedProcess:
    """A compute process NVML lists with no registered hook of its PID (`core.unhooked`)."""

    ident: ClientIdentity
    first_seen: float
    memory: dict[str, int | None]  # GPU uuid -> what NVML shows it holding there
    reported: bool = False  # listed past the grace period, and said so


@dataclass(frozen=True, slots=True)
class DroppedOverride:
    """A time quantum or mode nvsharectl set that a policy reload replaced (`admin`)."""

    what: str  # "mode off on every GPU"
    why: str  # "a policy reload changed the policy's mode (scheduler.mode on -> auto)"
    time: float  # the core's clock


DROPS_KEPT = 4  # the last few, for status


@dataclass(slots=True)
class Overrides:
    """What nvsharectl set over the policy; `admin` changes it, a policy reload that changes
    the very value set replaces it (and `dropped` says so)."""

    time_quantum_s: float | None = None
    modes: dict[str, Mode] = field(default_factory=dict)  # "" = every GPU
    limits: dict[LimitTarget, Limits] = field(default_factory=dict)
    dropped: deque[DroppedOverride] = field(default_factory=lambda: deque(maxlen=DROPS_KEPT))

    def limits_for(self, pid: int, pod: PodInfo | None) -> Limits | None:
        """The override of a process, of its pod, or both merged (the process's wins)."""
        by_pid = self.limits.get(LimitTarget.pid(pid))
        by_pod = self.limits.get(LimitTarget.pod_of(pod)) if pod else None
        if by_pid and by_pod:
            return Limits(
                memory_bytes=by_pid.memory_bytes or by_pod.memory_bytes,
                core_percent=by_pid.core_percent or by_pod.core_percent,
            )
        return by_pid or by_pod


@dataclass(slots=True)
class NodeState:
    policy: Policy
    inventory: dict[str, GpuFacts] = field(default_factory=dict)
    watching_pods: bool = False  # without one, a trusted claim makes a pod of its own name
    clients: dict[int, Client] = field(default_factory=dict)
    gpus: dict[str, Gpu] = field(default_factory=dict)
    pods: PodTable = field(default_factory=PodTable)
    overrides: Overrides = field(default_factory=Overrides)
    counters: Counter[str] = field(default_factory=Counter)
    unhooked: dict[int, UnhookedProcess] = field(default_factory=dict)  # by pid
    gangs: dict[str, Gang] = field(default_factory=dict)  # by key; every client is in one
    gang_gpus: dict[str, set[str]] = field(default_factory=dict)  # key -> GPUs asked, pre-gang
    askers: Counter[str] = field(default_factory=Counter)  # gang key -> its clients that asked
    lent_told: set[int] = field(default_factory=set)  # clients whose hook was told it lends
    # (subject, GPU) -> its clients (`ledger.Ledger.peer_updates`), and each client's
    ledgers: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    ledger_of: dict[int, tuple[str, str]] = field(default_factory=dict)
    tickets: int = 0  # the last place in line given out
    cuts: int = 0  # the last cut id given out
    retained: OrderedDict[str, RetainedPod] = field(default_factory=OrderedDict)  # by pod uid
    use: dict[str, GpuUse] = field(default_factory=dict)  # by uuid: NVML's last sample
    # by uuid: (policy, facts, what `gpu_settings` made of them), asked on every event
    settings_seen: dict[str, tuple[Policy, GpuFacts, GpuSettings]] = field(default_factory=dict)

    # ------------------------------------------------------------------ GPUs

    def facts(self, uuid: str) -> GpuFacts:
        gpu = self.gpus.get(uuid)
        if gpu is not None:
            return gpu.facts
        return self.inventory.get(uuid, GpuFacts(uuid=uuid))

    def gpu_mode(self, uuid: str) -> Mode:
        modes = self.overrides.modes  # (usually none: nvsharectl set no mode)
        override = (modes.get(uuid) or modes.get("")) if modes else None
        return override or self._settings(uuid).mode

    def time_quantum(self, uuid: str) -> float:
        tq = self.overrides.time_quantum_s
        return tq or self._settings(uuid).time_quantum_s

    def gpu_memory(self, uuid: str) -> int:
        return self._settings(uuid).memory_bytes

    def _settings(self, uuid: str) -> GpuSettings:
        """`gpu_settings`, worked out again only when the policy or the GPU's facts change."""
        gpu = self.gpus.get(uuid)  # (asked several times an event: `facts` inlined)
        facts = gpu.facts if gpu is not None else self.facts(uuid)
        seen = self.settings_seen.get(uuid)
        if seen is not None and seen[0] is self.policy and seen[1] is facts:
            return seen[2]
        settings = gpu_settings(self.policy, facts)
        self.settings_seen[uuid] = (self.policy, facts, settings)
        return settings

    # --------------------------------------------------------------- clients

    def pod_of(self, ident: ClientIdentity) -> tuple[PodInfo | None, str]:
        """A client's pod: the one its cgroup names; or, where the cgroup shows no pod at all,
        the one it names, if the policy trusts that uid's claims (`trust.podClaimUids`).

        Without a pod watch (a workstation) there is no list of pods to find the name in: a
        trusted claim then names a pod of its own, and the processes that claim it share its
        ledger, its rules (namespace, podName) and its nvsharectl overrides."""
        claims = (
            ident.pod_uid is None
            and ident.cgroup_known
            and ident.uid in self.policy.trust.pod_claim_uids
        )
        if claims and not self.watching_pods and ident.claimed_pod and ident.claimed_namespace:
            return claimed_pod(ident.claimed_namespace, ident.claimed_pod), "claimed"
        return self.pods.pod_of(ident, claims=claims)

    def pods_nameable(self) -> bool:
        """Whether a pod that no cgroup names can have processes at all: a watch lists pods,
        or, without one, trusted uids claim them."""
        return self.watching_pods or bool(self.policy.trust.pod_claim_uids)

    def pod_label(self, c: Client) -> str:
        pod, source = self.pod_of(c.ident)
        if pod is None:
            return "-"
        return f"{pod.namespace}/{pod.name}" + (" (claimed)" if source == "claimed" else "")

    def pod_uid(self, c: Client) -> str | None:
        """The UID of c's pod (by kernel identity and known to the pod watch, else as
        claimed), None outside pods or in one the watch has not shown yet."""
        pod, _ = self.pod_of(c.ident)
        return pod.uid if pod is not None else None

    def retain_usage(self, c: Client) -> None:
        """A client of a pod leaves: its lock time stays with the pod."""
        uid = self.pod_uid(c)
        if uid is None:
            return
        pod, _ = self.pod_of(c.ident)
        kept = self.retained.pop(uid, None) or RetainedPod(
            namespace=pod.namespace if pod else "", name=pod.name if pod else ""
        )
        kept.usage.add(c.usage)
        self.retained[uid] = kept
        if len(self.retained) <= RETAINED_PODS:
            return  # (who is connected is asked only when some pod must be forgotten)
        connected = {self.pod_uid(x) for x in self.clients.values()}
        for old in [u for u in self.retained if u not in connected]:
            if len(self.retained) <= RETAINED_PODS:
                break
            del self.retained[old]

    def subject(self, c: Client) -> str:
        return self.subject_of(c.ident)

    def subject_of(self, ident: ClientIdentity) -> str:
        """Whose ledger a process draws on: its pod (by kernel identity, else as claimed), else
        its own. A cgroup naming a pod the pod watch has not shown is no pod: any process
        able to make a cgroup of that name would otherwise draw on the pod's budget."""
        pod, _ = self.pod_of(ident)
        if pod is not None:
            return f"pod:{pod.uid}"
        return f"pid:{ident.pid}"

    def reached(self, target: LimitTarget) -> list[Client]:
        """The connected clients a limit override of `target` applies to."""
        if target.kind == "pid":
            return [c for c in self.clients.values() if str(c.ident.pid) == target.name]
        reached = []
        for c in self.clients.values():
            pod, _ = self.pod_of(c.ident)
            if pod is not None and LimitTarget.pod_of(pod) == target:
                reached.append(c)
        return reached

    def resolve(self, c: Client, *, with_env: bool) -> EffectiveLimits:
        return self.resolve_for(
            c.ident,
            self.facts(c.gpu),
            env_memory=c.env_memory if with_env else 0,
            env_core=c.env_core if with_env else 0,
            env_priority=c.env_priority if with_env else None,
        )

    def resolve_for(
        self,
        ident: ClientIdentity,
        gpu: GpuFacts,
        *,
        env_memory: int = 0,
        env_core: int = 0,
        env_priority: int | None = None,
    ) -> EffectiveLimits:
        """The limits of a process on a GPU, registered there or not."""
        pod, _ = self.pod_of(ident)
        return resolve_limits(
            policy=self.policy,
            ident=ident,
            gpu=gpu,
            pod=pod,
            annotations=self.pods.overrides_of(pod),
            remembered=self.remembered_limit(ident) if pod is None else None,
            admin=self.overrides.limits_for(ident.pid, pod),
            env_memory_bytes=env_memory,
            env_core_percent=env_core,
            env_priority=env_priority,
        )

    def remembered_limit(self, ident: ClientIdentity) -> Limits | None:
        """For a client whose cgroup names a pod the pod watch has not listed yet (just after a
        restart): the memory limit the previous daemon published for that pod, if any. It can
        only lower what the client's uid and unit give it (`limits.resolve_limits`)."""
        if not ident.pod_uid or ident.pod_uid not in self.pods.remembered:
            return None
        memory = self.pods.remembered[ident.pod_uid]
        return Limits(memory_bytes=memory) if memory is not None else None

    def enforced(self, c: Client) -> HookLimits:
        """What c's hook must enforce: its limits, whether it is gated, how memory is backed.

        A GPU in mode off gates nobody, except clients with a compute quota: their quota is
        kept by the lock, so they are gated as in mode on.
        """
        mode = self.gpu_mode(c.gpu)
        quota = c.limits.core_percent < 100
        if c.limits.exempt or (mode is Mode.OFF and not quota):
            mode = Mode.OFF
        elif mode is Mode.OFF:
            mode = Mode.ON
        memory = self.policy.memory
        return HookLimits(
            memory_bytes=c.limits.memory_bytes,
            core_percent=c.limits.core_percent,
            mode=mode,
            backing=memory.backing,
            single_process_oversubscription=memory.single_process_oversubscription,
        )


# Pods named only by claims (no pod watch) get a UID derived from the name, so their ledger,
# their retained lock time and the published view keep one key for as long as the name is
# claimed.
_CLAIMED_PODS = uuid.UUID("6f1c1b8e-3a57-4d0e-9c56-6e7673686172")


@functools.lru_cache(maxsize=4096)
def claimed_pod(namespace: str, name: str) -> PodInfo:
    return PodInfo(
        uid=str(uuid.uuid5(_CLAIMED_PODS, f"{namespace}/{name}")),
        namespace=namespace,
        name=name,
        node="",
    )
