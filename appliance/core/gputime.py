"""GPU time: what each client and each pod got of the lock, and where its quota window stands.

The lock accounts every client's time exactly (`state.LockUsage`: held from grant to release,
the drain included; waited from request to grant; drops by reason); these views add what is
under way up to now, and sum a pod's clients with what its departed clients used, so an
operator can see who got how much GPU time under sharing (`nvsharectl top`, the metrics).
Building a view changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from appliance.core.drops import DropReason
from appliance.core.gang import account
from appliance.core.state import Client, GangPhase, LockUsage, NodeState, Phase


@dataclass(frozen=True, slots=True)
class LockTime:
    """Time with the lock up to now, exactly as the lock accounts it."""

    held_s: float  # grant to release, the drain after a drop included
    waited_s: float  # request to grant
    drops: Mapping[str, int]  # why it was told to drop (`state.DropReason`'s names)


NO_LOCK_TIME = LockTime(0.0, 0.0, {})


@dataclass(frozen=True, slots=True)
class QuotaUse:
    """A compute quota's current window."""

    window_s: float
    budget_s: float
    used_s: float  # billed so far in this window, debt carried in included
    drain_s: float  # the client's expected drop-to-release time


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod's clients together: connected ones and what departed ones used."""

    uid: str
    namespace: str
    name: str
    clients: tuple[int, ...]  # connected client ids
    lock: LockTime
    memory_used: int
    memory_observed: int | None


def lock_time(c: Client, now: float) -> LockTime:
    held, waited = c.usage.held_s, c.usage.waited_s
    if c.phase in (Phase.HOLDING, Phase.DRAINING):
        held += now - c.granted_at
    elif c.phase is Phase.WAITING:
        waited += now - c.requested_at
    return LockTime(round(held, 6), round(waited, 6), _named(c.usage.drops))


def quota_use(s: NodeState, c: Client, now: float) -> QuotaUse | None:
    """Where the quota window of c's gang (its own, for a lone client) stands now, without
    touching the account."""
    g = s.gangs[c.gang]
    quota = account(s, g)
    if quota is None:
        return None
    settings = s.policy.scheduler
    preview = dataclasses.replace(quota)
    if g.phase is GangPhase.HOLDING:
        preview.bill(g.billed_until, now, settings)
    preview.roll(now, settings)
    return QuotaUse(
        window_s=settings.compute_window_s,
        budget_s=preview.budget_s(settings),
        used_s=round(preview.used_s, 6),
        drain_s=round(preview.drain_s, 6),
    )


class PodClient(Protocol):
    """What a pod's view reads of each of its clients' views (`views.ClientView`, which is
    built from these views and so is not imported here)."""

    @property
    def id(self) -> int: ...
    @property
    def namespace(self) -> str: ...
    @property
    def pod_name(self) -> str: ...
    @property
    def pod_uid(self) -> str: ...
    @property
    def lock(self) -> LockTime: ...
    @property
    def memory_used(self) -> int: ...
    @property
    def memory_observed(self) -> int | None: ...


def pod_views(s: NodeState, clients: tuple[PodClient, ...]) -> tuple[PodView, ...]:
    """Every pod with a connected client or a departed one's lock time, by UID."""
    by_pod: dict[str, list[PodClient]] = {}  # one pass over the clients, not one per pod
    for c in clients:
        if c.pod_uid:
            by_pod.setdefault(c.pod_uid, []).append(c)
    out = []
    for uid in dict.fromkeys([*s.retained, *by_pod]):
        mine = by_pod.get(uid, [])
        kept = s.retained.get(uid)
        usage = LockUsage()
        if kept is not None:
            usage.add(kept.usage)
        for c in mine:
            drops = Counter({DropReason(why): n for why, n in c.lock.drops.items()})
            usage.add(LockUsage(c.lock.held_s, c.lock.waited_s, drops))
        observed = [c.memory_observed for c in mine if c.memory_observed is not None]
        named = next((c for c in mine if c.pod_name), None)
        out.append(
            PodView(
                uid=uid,
                namespace=named.namespace if named else (kept.namespace if kept else ""),
                name=named.pod_name if named else (kept.name if kept else ""),
                clients=tuple(c.id for c in mine),
                lock=LockTime(
                    round(usage.held_s, 6), round(usage.waited_s, 6), _named(usage.drops)
                ),
                memory_used=sum(c.memory_used for c in mine),
                memory_observed=sum(observed) if observed else None,
            )
        )
    return tuple(out)


def _named(drops: Counter[DropReason]) -> dict[str, int]:
    """Drops by reason as a view shows them: by the reason's name."""
    return {why.value: n for why, n in drops.items()}
