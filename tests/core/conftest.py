"""A scripted driver for the sans-I/O scheduler: events in, sends out, fake time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from appliance import protocol as p
from appliance.core import events as ev
from appliance.core.identity import ClientIdentity
from appliance.core.scheduler import Scheduler
from appliance.policy.model import Policy

GiB = 1 << 30
GPU = "GPU-00000000-0000-0000-0000-000000000001"


@dataclass
class Harness:
    sched: Scheduler
    now: float = 1000.0
    next_id: int = 1
    sent: list[ev.Send] = field(default_factory=list)

    def feed(self, event: ev.Event) -> list[ev.Send]:
        out = self.sched.handle(event, self.now)
        self.sent += out
        return out

    def advance(self, seconds: float) -> list[ev.Send]:
        """Move the clock, firing every deadline the core asked for on the way."""
        target = self.now + seconds
        out: list[ev.Send] = []
        while (d := self.sched.next_deadline()) is not None and d <= target:
            self.now = max(self.now, d)
            out += self.feed(ev.Tick())
        self.now = target
        return out

    def register(
        self,
        *,
        pid: int | None = None,
        pod_uid: str | None = None,
        uid: int = 1000,
        gpu: str = GPU,
        total: int = 80 * GiB,
        env_mem: int = 0,
        groups: frozenset[str] = frozenset(),
        **ident: Any,
    ) -> int:
        cid = self.next_id
        self.next_id += 1
        identity = ClientIdentity(
            pid=pid or 100 + cid, uid=uid, gid=uid, pod_uid=pod_uid, groups=groups, **ident
        )
        out = self.feed(ev.ClientRegistered(cid, 1, identity, gpu, total, env_mem))
        assert isinstance(out[0].message, p.Registered)
        return cid

    def wire(self, cid: int) -> p.WireLimits:
        return self.sched.clients[cid].wire


def of(sends: list[ev.Send], kind: type, cid: int | None = None) -> list[ev.Send]:
    return [s for s in sends if isinstance(s.message, kind) and (cid is None or s.client_id == cid)]


@pytest.fixture
def harness() -> Harness:
    return Harness(Scheduler(Policy()))
