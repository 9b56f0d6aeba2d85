"""No client can hold the lock hostage: a raw client that takes the lock and ignores the drop,
and a program wedged in a synchronisation, are both passed over at the drop deadline."""

from __future__ import annotations

import time
from typing import Any

from appliance.wire import protocol as p

from .conftest import Stage, eventually

TQ, DEADLINE = 1, 1
POLICY = f"scheduler: {{mode: 'on', timeQuantum: {TQ}s, dropDeadline: {DEADLINE}s}}\n"
# Generous: the victim must not wait for the attacker, whose hold would last the whole test.
BOUND_S = TQ + DEADLINE + 8


def test_a_holder_that_ignores_its_drop_is_passed_over(stage: Stage, hooked: Any) -> None:
    stage.policy = POLICY
    stage.start()
    attacker = stage.registered()
    assert isinstance(attacker.request(p.LockRequest()), p.LockGrant)
    victim = hooked(NVSHARE_IDLE_RELEASE_MS="60000")
    victim.ok("init")
    start = time.monotonic()
    victim.ok("launch 1")  # waits at the gate for the lock the attacker will not give back
    waited = time.monotonic() - start
    assert waited < BOUND_S, f"the victim waited {waited:.1f}s"
    told: list[Any] = []  # new terms once the victim waits (idle hand-off), then the drop
    while not told or (not isinstance(told[-1], p.LockDrop) and len(told) < 5):
        told.append(attacker.receive()[1])
    assert isinstance(told[-1], p.LockDrop), told  # it was asked, and it ignored the request
    clients = {c["pid"]: c for c in stage.status()["clients"]}
    me = [c for c in clients.values() if c["state"] == "overdue"]
    assert len(me) == 1 and me[0]["late_drops"] == 1
    assert "did not release GPU" in stage.output()
    victim.ok("launch 1")  # and keeps it: the attacker is queued behind it


def test_a_program_wedged_in_a_synchronisation_is_passed_over(stage: Stage, hooked: Any) -> None:
    stage.policy = POLICY
    stage.start()
    wedged = hooked(NVSHARE_FAKE_LAUNCH_US=str(60_000_000), NVSHARE_IDLE_RELEASE_MS="60000")
    wedged.ok("init")
    wedged.send("launch 1")  # a one-minute kernel: its drain (cuCtxSynchronize) takes a minute
    eventually(lambda: any(c["state"] == "holding" for c in stage.status()["clients"]), "held")
    victim = hooked(NVSHARE_IDLE_RELEASE_MS="60000")
    victim.ok("init")
    start = time.monotonic()
    victim.ok("launch 1")
    assert time.monotonic() - start < BOUND_S
    wedged.kill()
