"""A lock request that can grant nobody: the lock's schedule skips its grant phase.

Why it exists: in a busy line most requests are a client asking while its GPU is held (each
hand-off's old holder asking again). The lock's schedule (`lock.Lock.schedule`) ran every
phase for it: the grant phase read the line only to find that nobody can be granted, and the
preempt phase worked out every GPU's turn again: some 30,000 instructions of the 250,000 a
request or release costs the core.

A request for a GPU is quiet (`quiet`), once its gang is filed, when every eligible gang in
line waits for that GPU alone (`line.Line.all_taken`) and a gang holds it (not draining) in
mode `on`. Then `GangRule.grantable` answers no to every waiter, whatever their order, so the
grant phase grants no waiter; a request changes nothing a holding gang that waits for more
GPUs is granted by (their owners and modes); and no other GPU has a waiter, so no other
holder gives way (`yielding.next_yield` answers None). The schedule skips the grant phase and
works out that one GPU's turn alone (`yielding.Yields.only`, the other GPUs' kept); every
other phase runs as ever (late holders, spent quotas, reclaims, a gang in the way, terms,
lending), and once one of the first three has acted, every phase does.

`NodeCore.check` (after every event of the core tests) runs the whole schedule on a copy of
the lock after each quiet request: it must decide nothing more.
Cost: O(G), no client touched; the grant phase it saves reads the line, O(P) and more.
"""

from __future__ import annotations

from appliance.core.line import Line
from appliance.core.state import GangPhase, NodeState
from appliance.policy.model import Mode


def quiet(s: NodeState, line: Line, uuid: str) -> str | None:
    """GPU `uuid`, if nobody in line can be granted while it is held (the module's docstring)
    and no other GPU has a waiter; else None. A query: it writes nothing."""
    if not line.all_taken({uuid}):
        return None  # someone waits for another GPU
    for key in s.gpus[uuid].owners:
        if s.gangs[key].phase is GangPhase.HOLDING:
            return uuid if s.gpu_mode(uuid) is Mode.ON else None
    return None  # (free, or only draining: a lender may be granted beside the drain)
