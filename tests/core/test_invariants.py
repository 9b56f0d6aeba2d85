"""`NodeCore.check`: every redundant index of the core's state, checked against the facts it
is kept from. The harness runs it after every event of every core test; here, each index
knocked out of step on purpose is named."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from appliance.core import events as ev
from appliance.core.invariants import StateOutOfStep
from appliance.core.state import NodeState

from .conftest import GPU, Harness

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
