"""`NodeCore.check`: every redundant index of the core's state, checked against the facts it
is kept from. The harness runs it after every event of every core test; here, each index
knocked out of step on purpose is named."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from appliance.core import events as ev
from appliance.core.invariants import StateOutOfStep
from appliance.core.state import NodeState
from appliance.core.views import ExplainQuery

from .conftest import GPU, Harness
from .test_rules import crowd

Corrupt = Callable[[NodeState, int, int], None]


def _two_in_line(h: Harness) -> tuple[int, int]:
    holder, waiter = h.register(), h.register()
    h.feed(ev.LockRequested(holder, 2))
    h.feed(ev.LockRequested(waiter, 2))
    return holder, waiter


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (lambda s, holder, waiter: s.gpus[GPU].holders.discard(holder), "Gpu.holders"),
        (lambda s, holder, waiter: s.gpus[GPU].holders.add(waiter), "Gpu.holders"),
        (lambda s, holder, waiter: s.gpus[GPU].owners.clear(), "Gpu.owners"),
        (lambda s, holder, waiter: s.gpus[GPU].clients.discard(waiter), "Gpu.clients"),
        (lambda s, holder, waiter: s.gangs[f"client:{waiter}"].members.clear(), "gang"),
        (lambda s, holder, waiter: s.lent_told.add(waiter), "lent_told"),
        (lambda s, holder, waiter: s.askers.clear(), "askers"),
        (lambda s, holder, waiter: s.ledger_of.pop(waiter), "ledger"),
        # the terms phase skipped where it should have told: the holder's hook keeps the
        # long idle window while someone waits for its GPU
        (lambda s, holder, waiter: setattr(s.clients[holder], "told", (9.0, 0.0)), "terms"),
    ],
)
def test_an_index_out_of_step_is_named(harness: Harness, corrupt: Corrupt, named: str) -> None:
    holder, waiter = _two_in_line(harness)
    harness.core.check()  # in step after real events
    corrupt(harness.state, holder, waiter)
    with pytest.raises(StateOutOfStep, match=named):
        harness.core.check()


def test_the_check_writes_nothing(harness: Harness) -> None:
    _two_in_line(harness)
    before = repr(harness.state)
    harness.core.check()
    assert repr(harness.state) == before


def test_status_explain_and_the_deadline_are_queries_that_write_nothing() -> None:
    """Asked later than the last event (windows turned, the holder held on), every query
    nvsharectl, the metrics and the engine ask leaves the state exactly as it was."""
    h = crowd()
    before = repr(h.state)
    rows = tuple(h.core.client_rows(h.now))
    h.core.status(h.now, rows)
    h.core.status(h.now)
    h.core.explain(ExplainQuery(pid=101))
    h.core.overrides()
    h.core.load()
    h.core.lock.next_deadline(h.now)
    assert repr(h.state) == before
