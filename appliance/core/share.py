"""Guaranteed plus burst compute: under contention each client gets at least its request.

A client's request (`EffectiveLimits.core_request`: policy `defaults.coreRequest`, rules'
`coreRequest`, the pod annotation `nvshare.com/gpu-core-request` up to
`annotations.maxCoreRequest`; never above its cap `coreLimit`) is a share of each compute window
it is owed. The lock keeps it so (`lock`, through `owed_s`):
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
"""

from __future__ import annotations

import logging

from appliance.core.drops import DropReason
from appliance.core.quota import GuaranteeAccount
from appliance.core.state import Client, NodeState
from appliance.policy.model import SchedulerSettings

log = logging.getLogger("nvshare.scheduler")

REQUEST = DropReason.REQUEST  # (the name this module has used for it)


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


def owed_s(c: Client, now: float, settings: SchedulerSettings) -> float:
    """How much of its share c is still owed in the current window (0 without a request);
    a holder must have been billed up to now."""
    if c.guarantee is None:
        return 0.0
    c.guarantee.roll(now, settings)
    return c.guarantee.owed_s(settings)


def guaranteed_percent(c: Client) -> float:
    return round(c.guarantee.percent, 2) if c.guarantee is not None else 0.0
