"""When a holder gives way: the earliest drop a GPU's waiters are owed.

Apart from `lock` because the lock asks it twice: when it drops whoever's turn has come, and
for its next deadline. Both are queries (what a holder is owed of its share is
`share.ShareRule.owed`, as if billed up to now; nothing is written), and both read the waiters
through `line.Waiting`, which hands over enough of them to tell (each bucket's longest waiting
and earliest lender, and the accounted ones) instead of all of them.
"""

from __future__ import annotations

from appliance.core.drops import DropReason
from appliance.core.gang import quantum
from appliance.core.line import Waiting
from appliance.core.priority import PriorityRule
from appliance.core.share import ShareRule
from appliance.core.state import Gang, GangPhase, NodeState
from appliance.policy.model import Mode

Yield = tuple[float, Gang, DropReason]  # when, who drops, why


def next_yield(
    s: NodeState,
    uuid: str,
    waiting: Waiting,
    now: float,
    *,
    priorities: PriorityRule,
    shares: ShareRule,
) -> Yield | None:
    """The earliest (time, holder, why) a holder of GPU `uuid` must drop for a gang that
    waits for it; None while nobody waits, in mode off, or while a holder still drains.
    O(holders of the GPU x (P + accounted waiters of the GPU)), and each holder's members
    (`ShareRule.owed`)."""
    if s.gpu_mode(uuid) is Mode.OFF:
        return None
    owners = [s.gangs[k] for k in s.gpus[uuid].owners]
    holding = [o for o in owners if o.phase is GangPhase.HOLDING]
    if not holding or any(o.phase is GangPhase.DRAINING for o in owners):
        return None
    if not waiting.any(uuid):
        return None
    turns = []
    for o in holding:
        rivals = waiting.rivals(uuid, o)
        owed = waiting.owed(rivals)
        at, why = turn(s, priorities, shares, o, rivals, owed, now, shares.owed(o, now))
        turns.append((at, why, o))
    at, why, holder = min(turns, key=lambda t: (t[0], t[2].granted_at, t[2].ticket))
    return at, holder, why


def turn(
    s: NodeState,
    priorities: PriorityRule,
    shares: ShareRule,
    h: Gang,
    rivals: list[Gang],
    owed: set[str],
    now: float,
    owed_h: float,
) -> tuple[float, DropReason]:
    """When holder h must drop for one of the waiters (`rivals`), and why: by priority and
    quantum (`PriorityRule.turn`), sooner for a share (`ShareRule.yield_at`), never while h is
    inside its own (`owed_h` of it is left)."""
    at = priorities.turn(h, rivals, quantum(s, h))
    if (for_share := shares.yield_at(h, rivals, owed)) is not None:
        at = min(at, for_share)
    return max(at[0], now + owed_h), at[1]


def frees(g: Gang, waiting: Waiting) -> bool:
    """Whether g's drop can let a waiter in before g has released, so that the lock reads its
    line again (otherwise a second grant pass finds what the first did): g waited for more
    GPUs (those behind it no longer wait for them), or g borrowed the idle time of a waiter of
    higher priority (`GangRule.grantable`: granted beside g's drain). O(G x P)."""
    return bool(g.gpus - g.held) or any(
        PriorityRule.borrowed(g, w) for uuid in g.held for w in waiting.rivals(uuid, g)
    )
