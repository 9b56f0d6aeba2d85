"""What the core's redundant indexes must agree on, checked by a pass over everything.

The core keeps several facts twice so that no event has to walk every client: a GPU's holders
and owners beside each client's phase and each gang's held GPUs, a gang's members beside each
client's gang, the ledgers by subject beside each client's ledger, the lock's line
(`line.Line`) beside the gangs' phases. Each is kept in step by hand where it changes; `check`
says which one is out of step. It walks every client and gang (O(n)), so only tests run it:
the core's harness (`tests/core/conftest.py`) after every event.
"""

from __future__ import annotations

from collections import Counter

from appliance.core.gang import gang_key
from appliance.core.line import Line
from appliance.core.state import GangPhase, NodeState, Phase

_HOLDS = (Phase.HOLDING, Phase.DRAINING)  # (an overdue client no longer holds its GPU)
_OWNING = (GangPhase.HOLDING, GangPhase.DRAINING)


class StateOutOfStep(AssertionError):
    """An index disagrees with the facts it is kept from: a bug in the core."""


def check(s: NodeState, line: Line) -> None:
    """Raise `StateOutOfStep` naming the first index out of step; nothing is written."""
    _clients_and_gpus(s)
    _gangs(s)
    _told_and_ledgers(s)
    line.check()
    _queues(s, line)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise StateOutOfStep(what)


def _clients_and_gpus(s: NodeState) -> None:
    for c in s.clients.values():
        _expect(c.gpu in s.gpus, f"client {c.id}'s GPU {c.gpu} is not in NodeState.gpus")
    for uuid, gpu in s.gpus.items():
        on_it = {c.id for c in s.clients.values() if c.gpu == uuid}
        _expect(gpu.clients == on_it, f"Gpu.clients of {uuid}: {gpu.clients} != {on_it}")
        holding = {i for i in on_it if s.clients[i].phase in _HOLDS}
        _expect(
            gpu.holders == holding,
            f"Gpu.holders of {uuid}: {gpu.holders} != clients holding or draining {holding}",
        )
        owners = {k for k, g in s.gangs.items() if uuid in g.held}
        _expect(gpu.owners == owners, f"Gpu.owners of {uuid}: {gpu.owners} != {owners}")
        asking = {i for i in on_it if s.clients[i].limits.core_request > 0}
        _expect(gpu.asking == asking, f"Gpu.asking of {uuid}: {gpu.asking} != {asking}")


def _gangs(s: NodeState) -> None:
    for c in s.clients.values():
        g = s.gangs.get(c.gang)
        _expect(g is not None and c.id in g.members, f"client {c.id} not in its gang {c.gang}")
        # (a member catching up to its gang's cut runs beside another gang's holder: `behind`)
        catching_up = c.phase is Phase.DRAINING and g is not None and g.cut is not None
        if c.phase in _HOLDS and not catching_up:
            assert g is not None
            _expect(c.gpu in g.held, f"client {c.id} holds {c.gpu}, its gang {g.key} does not")
    for key, g in s.gangs.items():
        _expect(g.key == key, f"gang filed as {key} is {g.key}")
        _expect(bool(g.members), f"gang {key} has no members")
        for m in g.members:
            _expect(
                m in s.clients and s.clients[m].gang == key, f"member {m} of {key} is elsewhere"
            )
        _expect(g.held <= g.gpus, f"gang {key} holds {g.held - g.gpus}, which it does not take")
        _expect(
            bool(g.held) <= (g.phase in _OWNING),
            f"gang {key} holds {g.held} while {g.phase.value}",
        )
        waits = any(s.clients[m].phase is Phase.WAITING for m in g.members)
        _expect(
            g.phase is not GangPhase.WAITING or waits,
            f"gang {key} is waiting with no member waiting",
        )


def _told_and_ledgers(s: NodeState) -> None:
    told = {c.id for c in s.clients.values() if c.lent_told}
    _expect(s.lent_told == told, f"NodeState.lent_told {s.lent_told} != clients told {told}")
    askers = Counter(gang_key(s, c) for c in s.clients.values() if c.asked)
    _expect(s.askers == askers, f"NodeState.askers {dict(s.askers)} != {dict(askers)}")
    for cid, key in s.ledger_of.items():
        _expect(cid in s.ledgers.get(key, set()), f"client {cid} missing from ledger {key}")
    filed = {cid for members in s.ledgers.values() for cid in members}
    _expect(filed == s.ledger_of.keys(), f"ledgers list {filed ^ s.ledger_of.keys()} wrongly")
    _expect(all(s.ledgers.values()), "an empty ledger is kept")


def _queues(s: NodeState, line: Line) -> None:
    """Status's queue of each GPU (`Line.queue`) lists its lone waiters in the order the lock
    grants them (`Line.turns`)."""
    turns = [g for g in line.turns(line.now) if not g.joint]
    for uuid in s.gpus:
        granted = [m for g in turns if uuid in g.gpus for m in g.members]
        lone = set(granted)
        shown = [cid for cid in line.queue(uuid, line.now) if cid in lone]
        _expect(shown == granted, f"status's queue of {uuid} {shown} != the line's {granted}")
