"""Guaranteed plus burst compute: under contention each client gets at least its request.

A client's request (`EffectiveLimits.core_request`: policy `defaults.coreRequest`, rules'
`coreRequest`, the pod annotation `nvshare.com/gpu-core-request` up to
`annotations.maxCoreRequest`; never above its cap `coreLimit`) is a share of each compute window
it is owed. The lock keeps it so (`lock`, asking `ShareRule.owed`):
- a waiter still owed part of its share goes first in line, and takes the GPU from a holder
  that has had its own share (after one `quotaSampleInterval`, the shortest grant);
- a holder still inside its own share keeps the GPU until it has had it, whatever waits.
GPU time beyond the shares is burst: nobody is owed it, so the usual rules (priority, the time
quantum) share it among those who want it, each up to its cap (the compute quota, `quota`);
nobody waits while the GPU is free, so one client alone gets all of it (work-conserving).

The windows of all accounts fall on one grid (multiples of the window), so every client's share
starts again at the same instant.

Requests count per pod, not per connection: the requests of one pod's clients on a GPU (a pod
the pod watch knows) are summed and capped at `annotations.maxCoreRequest` (or at the largest
one request of them, where a policy rule gave more), and its clients share that in proportion.
Outside pods a request comes from the policy's rules alone, and counts per client. Ten
connections of a pod annotated 10 get 10 together, not 100. The requests that, so cut, sum to
more than 100 are then scaled down in proportion, and said so in the log, status and metrics.

`ShareRule` is the one object that answers for shares, as `quota_rule.QuotaRule` does for
quotas; the lock (`lock.Lock`) and the line (`line.Line`) ask it, nobody else reads a share:
- commands: `wants` and `rescale` (a client's limits changed: NodeCore's limits refresh);
  `granted` and `dropped` (the grant phase, a drop: whether a turn was granted for a share or
  cut short for one); `bill` (a phase of the lock bills a gang's time: a drop, a release, a
  spent quota). They write the accounts (`quota.GuaranteeAccount`), those facts of the gang
  and `Gpu.last_drop`, nothing else.
- queries, asked by any phase and by `next_deadline`: `owed` (what a gang is still owed, a
  holder as if billed up to now), `turn_at` (when a member's window turns), `resumes` and
  `yield_at` (the preempt phase: when a holder gives way for a share). They look through a
  copy of each account and write nothing, so asking twice, or at a later time, changes no
  answer and no bill.
Cost, in clients touched: `wants` 1; `rescale` the clients asking for a share on one GPU;
`bill`, `owed`, `turn_at` the members of the gang asked about (one for a lone client);
`granted`, `dropped`, `resumes`, `yield_at` none (the waiters they are given).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from appliance.core.drops import DropReason
from appliance.core.quota import GuaranteeAccount
from appliance.core.state import Client, Gang, GangPhase, NodeState, Phase

log = logging.getLogger("nvshare.scheduler")

REQUEST = DropReason.REQUEST  # (the name this module has used for it)
_OWNING = (Phase.HOLDING, Phase.DRAINING)
_GANG_OWNING = (GangPhase.HOLDING, GangPhase.DRAINING)
Turn = tuple[float, DropReason]  # when a holder gives way, and why


class ShareRule:
    """Guaranteed shares, as the lock and the line ask about them (the module's docstring)."""

    def __init__(self, state: NodeState) -> None:
        self._s = state

    # ------------------------------------------------------------ commands (limits refresh)

    def wants(self, c: Client) -> bool:
        """File c by whether it asks for a share (`Gpu.asking`); True when it stopped having
        one (its share is gone)."""
        return wants(self._s, c)

    def rescale(self, uuid: str, now: float) -> list[Client]:
        """The shares of GPU `uuid` scaled again: the clients whose share is new or changed."""
        return rescale(self._s, uuid, now)

    # ------------------------------------------------------------ commands (the lock's phases)

    def granted(self, g: Gang) -> None:
        """The grant phase: g granted after a drop for a waiter's share (`Gpu.last_drop`) was
        granted for its own share, and gives way once it has had it (`share_grant`)."""
        g.share_cut, g.share_grant = False, False
        for uuid in g.gpus:  # (a loop: every grant)
            gpu = self._s.gpus[uuid]
            if gpu.last_drop is REQUEST:
                g.share_grant = True
            gpu.last_drop = None

    def dropped(self, g: Gang, why: DropReason) -> None:
        """A drop: why g's GPUs were given up (`Gpu.last_drop`, read by the next grant), and
        whether g was cut short for another's share (`share_cut`: its quantum goes on)."""
        g.share_cut = why is REQUEST and not g.share_grant
        for uuid in g.held:
            self._s.gpus[uuid].last_drop = why

    def bill(self, g: Gang, now: float) -> None:
        """Each member's share, the lock time since g was last billed (`g.billed_until`), the
        drain included (its work ran): asked with the quota's bill (`Lock._bill`)."""
        settings = self._s.policy.scheduler
        for m in g.members:
            c = self._s.clients[m]
            if c.guarantee is not None and c.phase in _OWNING:
                c.guarantee.bill(g.billed_until, now, settings)

    # ------------------------------------------------------------ queries

    def owed(self, g: Gang, now: float) -> float:
        """How much of its share g's most owed member is still owed in its current window;
        a member that holds counts as billed up to now (as the lock bills it). Through a copy
        of each account: nothing is billed or rolled."""
        clients, settings = self._s.clients, self._s.policy.scheduler
        most = 0.0
        for m in g.members:
            c = clients[m]
            if c.guarantee is None:
                continue
            ahead = replace(c.guarantee)
            if c.phase in _OWNING and g.phase in _GANG_OWNING:
                ahead.bill(g.billed_until, now, settings)
            ahead.roll(now, settings)
            most = max(most, ahead.owed_s(settings))
        return most

    def resumes(self, g: Gang, now: float, quantum_s: float) -> bool:
        """Whether g, cut short for another's share, is granted again inside the quantum it
        was cut short in: it has the rest of that quantum back."""
        return g.share_cut and now - g.dropped_at < quantum_s

    def yield_at(self, h: Gang, rivals: list[Gang], owed: set[str]) -> Turn | None:
        """When holder h gives way for a share, if it does: after the shortest grant (one
        `quotaSampleInterval`) when one of the waiters (`rivals`) is `owed` its share, or when
        h was granted for its own share and one of its priority or above waits."""
        for w in rivals:
            if w.key in owed or (h.share_grant and w.priority >= h.priority):
                return h.granted_at + self._s.policy.scheduler.quota_sample_interval_s, REQUEST
        return None

    def turn_at(self, g: Gang, now: float) -> float | None:
        """When a member's share window turns (it is owed again); what a waiting gang is
        filed by may change then (`line.Line`). None without a share."""
        settings = self._s.policy.scheduler
        times = []
        for m in g.members:
            if (share := self._s.clients[m].guarantee) is not None:
                ahead = replace(share)
                ahead.roll(now, settings)
                times.append(ahead.next_window(settings))
        return min(times, default=None)


def wants(s: NodeState, c: Client) -> bool:
    """File c by whether it asks for a share (`Gpu.asking`); True when it stopped having one
    (its share is gone)."""
    gpu = s.gpus[c.gpu]
    if c.limits.core_request > 0:
        gpu.asking.add(c.id)
        return False
    gpu.asking.discard(c.id)
    had, c.guarantee = c.guarantee is not None, None
    return had


def tenant(s: NodeState, c: Client) -> str:
    """Whose requests c's counts with: its pod's (as the pod watch knows it); outside pods its
    own (a request there comes from the policy's rules, the operator's word, not a tenant's)."""
    pod = s.pod_uid(c)
    return f"pod:{pod}" if pod is not None else f"client:{c.id}"


def rescale(s: NodeState, uuid: str, now: float) -> list[Client]:
    """Give each client of a GPU that asks for a share its guaranteed percent: its request,
    cut to its tenant's cap (see above), scaled down so that the GPU's requests fit in 100.
    O(clients asking on that GPU). The clients whose share is new or changed."""
    gpu = s.gpus.get(uuid)
    if gpu is None:
        return []
    asking = [s.clients[i] for i in sorted(gpu.asking)]
    tenants: dict[str, list[Client]] = {}
    for c in asking:
        tenants.setdefault(tenant(s, c), []).append(c)
    cap = s.policy.annotations.max_core_request
    cut: dict[int, float] = {}  # client id -> its part of its tenant's capped request
    total = 0
    for clients in tenants.values():
        asked = sum(c.limits.core_request for c in clients)
        allowed = min(asked, max(cap, *(c.limits.core_request for c in clients)))
        total += allowed
        for c in clients:
            cut[c.id] = c.limits.core_request * allowed / asked
    factor = min(1.0, 100.0 / total) if total else 1.0
    window = s.policy.scheduler.request_window_s
    new: list[Client] = []
    for c in asking:
        if c.guarantee is None:
            c.guarantee = GuaranteeAccount(percent=0.0, window_start=now - now % window)
        percent = cut[c.id] * factor
        if c.guarantee.percent != percent:
            c.guarantee.percent = percent
            new.append(c)
    if gpu.requested_percent == total:
        return new
    gpu.requested_percent = total
    if total > 100:
        shares = ", ".join(f"client {c.id}: {round(cut[c.id], 2):g}%" for c in asking)
        log.warning(
            "GPU %s: guaranteed shares (coreRequest) sum to %d%% (%s, each tenant's cut to "
            "its cap); each is scaled by 100/%d to fit",
            uuid,
            total,
            shares,
            total,
        )
    return new


def guaranteed_percent(c: Client) -> float:
    return round(c.guarantee.percent, 2) if c.guarantee is not None else 0.0
