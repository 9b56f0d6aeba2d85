"""The terms a holder's hook is given with the lock, and told again (`LockTerms`) when they
change while it holds: the quantum, and the idle window, how long the holder may submit nothing
(and wait for nothing) before it hands the lock back. While another gang waits for its GPU the
window is the short `scheduler.idleHandoff` (a request loop that submits a little every few
milliseconds leaves the GPU idle in between), else `scheduler.idleRelease`.
"""

from __future__ import annotations

from collections.abc import Iterable

from appliance.core import actions as act
from appliance.core.gang import Waiting, gang_of
from appliance.core.state import Client, Gang, NodeState, Phase
from appliance.policy.model import SchedulerSettings

MIN_IDLE_HANDOFF_S = 0.001  # the hook counts idle time in milliseconds; below, no hand-off


def grant(s: NodeState, c: Client, seq: int, waiting: Waiting) -> act.Grant:
    """The grant for c (answering its request `seq`), with its terms."""
    c.idle_told_s = _idle_window(s, c, waiting)
    return act.Grant(
        c.id,
        seq,
        time_quantum_s=s.time_quantum(c.gpu),
        idle_release_s=c.idle_told_s,
    )


def changed(s: NodeState, waiting: Waiting) -> list[act.Action]:
    """New terms for every holder whose idle window changed (someone started or stopped
    waiting for its GPU)."""
    out: list[act.Action] = []
    for gpu in s.gpus.values():
        for h in [s.clients[h] for h in sorted(gpu.holders)]:
            window = _idle_window(s, h, waiting)
            if h.phase is Phase.HOLDING and window != h.idle_told_s:
                h.idle_told_s = window
                out.append(act.LockTerms(h.id, s.time_quantum(h.gpu), window))
    return out


def idle_window(mine: Gang, waiters: Iterable[Gang], settings: SchedulerSettings) -> float:
    """How long a holder of `mine` may sit idle with the lock, given who waits for its GPU."""
    handoff = settings.idle_handoff_s
    if handoff >= MIN_IDLE_HANDOFF_S and any(w is not mine for w in waiters):
        return min(handoff, settings.idle_release_s)
    return settings.idle_release_s


def _idle_window(s: NodeState, c: Client, waiting: Waiting) -> float:
    return idle_window(gang_of(s, c), waiting.get(c.gpu, ()), s.policy.scheduler)

