"""A scripted driver for the sans-I/O core: events in, actions out, fake time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import PodInfo
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.limits import HookLimits
from appliance.core.node import NodeCore
from appliance.core.state import NodeState
from appliance.policy.model import AnnotationPolicy, Policy

GiB = 1 << 30
MiB = 1 << 20
GPU = "GPU-00000000-0000-0000-0000-000000000001"
# A state change asked by root on the host, as the socket server would name it.
ADMIN = ev.Requester(ident=ClientIdentity(pid=1, uid=0, gid=0))
A = TypeVar("A")
POLICY_OFF = AnnotationPolicy()  # (a pod listed without annotations has nothing to judge)


@dataclass
class Harness:
    core: NodeCore
    now: float = 1000.0
    next_id: int = 1
    sent: list[act.Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.feed(ev.Tick())  # as the daemon starts: publishes the fallback limits

    @property
    def state(self) -> NodeState:
        return self.core.state

    def feed(self, event: ev.Event) -> list[act.Action]:
        out = self.core.handle(event, self.now)
        self.core.check()  # every redundant index agrees with a pass over all clients and gangs
        self.sent += out
        return out

    def advance(self, seconds: float) -> list[act.Action]:
        """Move the clock, firing every deadline the core asked for on the way."""
        target = self.now + seconds
        out: list[act.Action] = []
        while (d := self.core.next_deadline()) is not None and d <= target:
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
        env_core: int = 0,
        groups: frozenset[str] = frozenset(),
        nvml: bool = True,
        listed: bool = True,
        **ident: Any,
    ) -> int:
        """Register a client; with `nvml`, NVML lists its GPU with `total` bytes (else the GPU
        is known only by what the hook says). A `pod_uid` is a pod the pod watch lists (as
        "ns/<uid>", no annotations) unless it listed it already, or `listed` is False."""
        if pod_uid and listed and pod_uid not in self.state.pods.pods:
            self.state.pods.seen(PodInfo(pod_uid, "ns", pod_uid, "node"), POLICY_OFF)
        if nvml:
            self.state.inventory.setdefault(gpu, GpuFacts(uuid=gpu, memory_total=total))
        cid = self.next_id
        self.next_id += 1
        identity = ClientIdentity(
            pid=pid or 100 + cid, uid=uid, gid=uid, pod_uid=pod_uid, groups=groups, **ident
        )
        out = self.feed(ev.ClientRegistered(cid, 1, identity, gpu, total, env_mem, env_core))
        assert isinstance(out[0], act.Registered)
        return cid

    def queued(self, uuid: str) -> list[int]:
        """The clients status shows waiting for a GPU, in the order they are granted."""
        return next(list(g.queue) for g in self.core.status(self.now).gpus if g.uuid == uuid)

    def enforced(self, cid: int) -> HookLimits:
        """What the client's hook was last told to enforce."""
        return self.state.clients[cid].enforced


def of(actions: list[act.Action], kind: type[A], cid: int | None = None) -> list[A]:
    """The actions of one kind, for one client if given."""
    return [
        a
        for a in actions
        if isinstance(a, kind) and (cid is None or getattr(a, "client_id", None) == cid)
    ]


@pytest.fixture
def harness() -> Harness:
    return Harness(NodeCore(Policy()))
