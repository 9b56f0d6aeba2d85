"""When a holder gives way: the earliest drop a GPU's waiters are owed.

Apart from `lock` because the lock asks it twice: when it drops whoever's turn has come, and
for its next deadline. Both read the waiters through `line.Waiting`, which hands over enough of
them to tell (each bucket's longest waiting and earliest lender, and the accounted ones)
instead of all of them; what a holder is owed of its share is `share.ShareRule.owed`, as if
billed up to now (nothing is billed).

`Yields` keeps what the preempt phase worked out, so that the deadline asked after the event
reads it instead of asking every GPU's holders and waiters again (about a seventh of a
hand-off's work in the core): the preempt phase works out every GPU's turn (`begin`, `due`), a
drop makes its GPUs' none (`dropped`: a draining holder gives way to nobody), and a GPU whose
owners or waiters changed after that is in `line.Line.moved` (the line's filing marks it, and
the lock where it changes owners without filing). `at` is the query: the kept turn, or for a
moved GPU or a holder inside its share (whose turn moves with the clock) one worked out again.
"""

from __future__ import annotations

from appliance.core.drops import DropReason
from appliance.core.gang import quantum
from appliance.core.line import Line, Waiting
from appliance.core.priority import PriorityRule
from appliance.core.share import ShareRule
from appliance.core.state import Gang, GangPhase, NodeState
from appliance.policy.model import Mode

Yield = tuple[float, Gang, DropReason]  # when, who drops, why


class Yields:
    """When each GPU's holder gives way, kept where it changes (the module's docstring).

    - commands: `begin` and `due` (the preempt phase works out every GPU's turn and keeps it),
      `dropped` (a drop).
    - query: `at` (what `Lock.next_deadline` reads); it writes nothing.
    Cost: `due` O(holders x P) for one GPU; `dropped` O(the gang's GPUs); `at` O(1) for a GPU
    whose turn is kept, else what `due` costs.
    """

    def __init__(
        self, state: NodeState, *, line: Line, priorities: PriorityRule, shares: ShareRule
    ) -> None:
        self._s = state
        self._line = line  # who waits; which GPUs moved since their turn was worked out
        self._priorities = priorities
        self._shares = shares
        self._kept: dict[str, tuple[float, bool] | None] = {}  # GPU -> (at, moves with time)
        self.only: str | None = None  # the one GPU whose turn moved (a quiet request, `calm`)

    # ------------------------------------------------------------ commands

    def begin(self) -> list[str]:
        """The preempt phase starts: every GPU's turn is worked out again; after a quiet
        request (`calm`: no other GPU has a waiter) its GPU's alone, the others kept."""
        if self.only is not None:
            return [self.only]
        self._kept = {}
        return list(self._s.gpus)

    def due(self, uuid: str, waiting: Waiting, now: float) -> Yield | None:
        """GPU `uuid`'s turn (`next_yield`), kept for the deadline."""
        due = self._worked_out(uuid, waiting, now)
        self._line.moved.discard(uuid)
        if due is None:
            self._kept[uuid] = None
            return None
        self._kept[uuid] = (due[0], self._timed(uuid))
        return due

    def _timed(self, uuid: str) -> bool:
        """Whether a holder of GPU `uuid` has a guaranteed share (its turn moves with time)."""
        s = self._s
        for key in s.gpus[uuid].owners:
            for m in s.gangs[key].members:
                if s.clients[m].guarantee is not None:
                    return True
        return False

    def dropped(self, g: Gang) -> None:
        """g drops: nobody gives way on its GPUs until it has released (`next_yield`)."""
        for uuid in g.held:
            self._kept[uuid] = None

    # ------------------------------------------------------------ query

    def at(self, uuid: str, waiting: Waiting, now: float, *, afresh: bool = False) -> float | None:
        """When GPU `uuid`'s holder gives way, as of now: as kept, or worked out `afresh`."""
        if not afresh and uuid not in self._line.moved and uuid in self._kept:
            turn = self._kept[uuid]
            if turn is None:
                return None
            if not turn[1]:
                return max(turn[0], now)  # (`next_yield`: not before now)
        due = self._worked_out(uuid, waiting, now)
        return None if due is None else due[0]

    def _worked_out(self, uuid: str, waiting: Waiting, now: float) -> Yield | None:
        return next_yield(
            self._s, uuid, waiting, now, priorities=self._priorities, shares=self._shares
        )


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
    owners = s.gpus[uuid].owners
    if not owners or not waiting.any(uuid):
        return None
    holding = []
    for key in owners:
        o = s.gangs[key]
        if o.phase is GangPhase.DRAINING:
            return None
        holding.append(o)  # (an owner holds or drains)
    if s.gpu_mode(uuid) is Mode.OFF:  # (asked last: the most costly of the three)
        return None
    best: tuple[float, float, int, DropReason, Gang] | None = None
    for o in holding:  # (the earliest; of two at once, the one granted first)
        rivals = waiting.rivals(uuid, o)
        owed = waiting.owed(rivals)
        at, why = turn(s, priorities, shares, o, rivals, owed, now, shares.owed(o, now))
        if best is None or (at, o.granted_at, o.ticket) < best[:3]:
            best = (at, o.granted_at, o.ticket, why, o)
    assert best is not None  # (an owner holds)
    return best[0], best[4], best[3]


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
    if g.gpus - g.held:
        return True
    for uuid in g.held:  # (loops: asked of every gang dropped)
        for w in waiting.rivals(uuid, g):
            if PriorityRule.borrowed(g, w):
                return True
    return False
