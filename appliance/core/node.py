"""The core of the node daemon: every decision, as a pure function of events and the time.

Sans-I/O: `NodeCore.handle(event, now)` returns the actions to take (`actions`); the caller
(`appliance.engine`) owns the clock and the sockets and calls back with `Tick` once
`next_deadline()` has passed. Every rule is tested with a fake clock in `tests/core`.

This module routes each event to the part whose job it is (an explicit table) and keeps what
they share: who is registered, and what every hook must enforce, pushed to exactly the hooks
whose limits changed. The parts: `lock` (queues, modes, quanta, quotas), `ledger` (memory and
the real-time check), `admin` (nvsharectl's commands), `annotations.PodTable` (pods and what
their annotations ask for), `unhooked` (GPU processes without the hook), `views` (what status
and metrics show), `shown` (the GPU as a process is shown it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import share, views
from appliance.core.admin import Admin
from appliance.core.annotations import AnnotationProblem
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.ledger import Ledger
from appliance.core.limits import describe
from appliance.core.lock import Lock
from appliance.core.quota import QuotaAccount
from appliance.core.shown import MemoryView, memory_view
from appliance.core.state import Client, Gpu, NodeState
from appliance.core.unhooked import REGISTERED, UnhookedWatch
from appliance.policy.model import Mode, Policy
from appliance.policy.quantity import format_bytes

log = logging.getLogger("nvshare.scheduler")

ANNOTATION_WARNING = "InvalidNvshareAnnotation"  # the reason of the Event on the pod


class NodeCore:
    def __init__(
        self,
        policy: Policy,
        *,
        inventory: dict[str, GpuFacts] | None = None,
        watching_pods: bool = False,
    ) -> None:
        self.state = NodeState(
            policy=policy, inventory=dict(inventory or {}), watching_pods=watching_pods
        )
        self.lock = Lock(self.state)
        self.ledger = Ledger(self.state, self.lock)
        self.admin = Admin(self.state, refresh=self._refresh_all)
        self.unhooked = UnhookedWatch(self.state)
        self._deadline: float | None = None
        self._claim_noted = False
        self._handlers: dict[type, Callable[[Any, float], list[act.Action]]] = {
            ev.ClientRegistered: self._on_registered,
            ev.ClientGone: self._on_gone,
            ev.LockRequested: self.lock.requested,
            ev.LockReleased: self.lock.released,
            ev.MemoryReserveRequested: self.ledger.reserve,
            ev.MemoryReturned: self.ledger.returned,
            ev.MemoryRefusedByHook: self.ledger.refused_by_hook,
            ev.GpuFreeMemory: self.ledger.sampled,
            ev.GpuProcessesSeen: self.unhooked.seen,
            ev.PolicyChanged: self._on_policy,
            ev.PodSeen: self._on_pod_seen,
            ev.PodRemoved: self._on_pod_removed,
            ev.TimeQuantumSet: self.admin.set_time_quantum,
            ev.ModeSet: self.admin.set_mode,
            ev.AdminLimitSet: self.admin.set_limits,
            ev.Tick: self._on_tick,
        }

    # ------------------------------------------------------------ public surface

    def handle(self, event: ev.Event, now: float) -> list[act.Action]:
        actions = self._handlers[type(event)](event, now)
        self._deadline = self.lock.next_deadline(now)
        return actions

    def next_deadline(self) -> float | None:
        return self._deadline

    def status(self, now: float) -> views.StatusView:
        return views.status(self.state, now)

    def explain(self, query: views.ExplainQuery) -> views.ExplainView:
        return views.explain(self.state, query)

    def overrides(self) -> views.OverridesView:
        return views.overrides(self.state)

    def load(self) -> dict[str, int]:
        return views.load(self.state)

    def memory_view(self, ident: ClientIdentity, gpu_uuid: str, gpu_total: int) -> MemoryView:
        return memory_view(self.state, ident, gpu_uuid, gpu_total)

    # ------------------------------------------------------------ clients

    def _on_tick(self, e: ev.Tick, now: float) -> list[act.Action]:
        return self.lock.schedule_all(now)

    def _on_registered(self, e: ev.ClientRegistered, now: float) -> list[act.Action]:
        s = self.state
        if e.gpu_uuid not in s.gpus:
            base = s.inventory.get(e.gpu_uuid, GpuFacts(uuid=e.gpu_uuid))
            facts = GpuFacts(
                uuid=e.gpu_uuid,
                index=base.index,
                model=base.model,
                memory_total=base.memory_total or e.gpu_total_memory,
            )
            s.gpus[e.gpu_uuid] = Gpu(facts=facts)
        c = Client(
            id=e.client_id,
            ident=e.ident,
            gpu=e.gpu_uuid,
            env_memory=e.env_memory_bytes,
            env_core=e.env_core_percent,
        )
        s.clients[c.id] = c
        self.unhooked.forget(c.ident.pid, why=REGISTERED)
        c.pod_source = s.pods.pod_of(c.ident)[1]
        self._refresh_limits(c, now)
        share.rescale(s, c.gpu, now)
        self._note_claim(c)
        s.counters["registrations"] += 1
        peers = self.ledger.peer_updates()
        log.info(
            "client %d registered: pid %d uid %d gpu %s pod %s limits %s",
            c.id,
            c.ident.pid,
            c.ident.uid,
            c.gpu,
            s.pod_label(c),
            describe(c.limits),
        )
        return [act.Registered(c.id, e.seq, c.enforced), *peers]

    def _on_gone(self, e: ev.ClientGone, now: float) -> list[act.Action]:
        s = self.state
        c = s.clients.pop(e.client_id, None)
        if c is None:
            return []
        self.admin.client_gone(c.ident.pid)
        held = self.lock.leave(c, now)
        share.rescale(s, c.gpu, now)
        s.retain_usage(c)
        s.counters["disconnects"] += 1
        log.info(
            "client %d (pid %d) gone%s; %s of reservation freed",
            c.id,
            c.ident.pid,
            " while holding the lock" if held else "",
            format_bytes(c.reserved),
        )
        return self.lock.schedule(s.gpus[c.gpu], now) + self.ledger.peer_updates()

    def _note_claim(self, c: Client) -> None:
        """Say once why a pod name a process claims has no effect here."""
        ident = c.ident
        if self.state.watching_pods or self._claim_noted or ident.pod_uid or not ident.claimed_pod:
            return
        self._claim_noted = True
        log.warning(
            "client %d (pid %d) names pod %s/%s (NVSHARE_POD_NAMESPACE/NVSHARE_POD_NAME), but "
            "this daemon watches no pods, so the name is ignored; start it with --node-name "
            "to follow pod annotations (said once)",
            c.id,
            ident.pid,
            ident.claimed_namespace,
            ident.claimed_pod,
        )

    # ------------------------------------------------------------ limits

    def _refresh_limits(self, c: Client, now: float) -> bool:
        """Recompute a client's limits; True when what its hook must enforce changed."""
        c.limits = self.state.resolve(c, with_env=True)
        if c.limits.core_percent < 100:
            if c.quota is None:
                c.quota = QuotaAccount(percent=c.limits.core_percent, window_start=now)
            c.quota.percent = c.limits.core_percent
        else:
            c.quota = None
        enforced = self.state.enforced(c)
        changed = enforced != c.enforced
        c.enforced = enforced
        return changed

    def _refresh_all(self, now: float) -> list[act.Action]:
        """Push changed limits to the clients they concern, and nobody else."""
        s = self.state
        out: list[act.Action] = []
        for c in s.clients.values():
            c.pod_source = s.pods.pod_of(c.ident)[1]
            if not self._refresh_limits(c, now):
                continue
            out.append(act.LimitsChanged(c.id, c.enforced))
            s.counters["limit_updates"] += 1
            if c.enforced.mode is Mode.OFF:
                out += self.lock.ungate(c, now)
        for uuid in s.gpus:
            share.rescale(s, uuid, now)
        return out + self.lock.schedule_all(now) + self.ledger.peer_updates()

    # ------------------------------------------------------------ policy and pods

    def _on_policy(self, e: ev.PolicyChanged, now: float) -> list[act.Action]:
        s = self.state
        old, s.policy = s.policy, e.policy
        self.admin.policy_changed(old, e.policy)
        out: list[act.Action] = []
        replicas = e.policy.device_plugin.replicas_per_gpu
        if replicas != old.device_plugin.replicas_per_gpu:
            out.append(act.ReplicasChanged(replicas))
        # Annotation caps may have changed: every pod's annotations are judged again.
        out += self._warnings(s.pods.judge_again(e.policy.annotations))
        return out + self._refresh_all(now)

    def _on_pod_seen(self, e: ev.PodSeen, now: float) -> list[act.Action]:
        problems = self.state.pods.seen(e.pod, self.state.policy.annotations)
        return self._warnings(problems) + self._refresh_all(now)

    def _on_pod_removed(self, e: ev.PodRemoved, now: float) -> list[act.Action]:
        self.state.pods.removed(e.pod)
        self.state.retained.pop(e.pod.uid, None)
        return self._refresh_all(now)

    def _warnings(self, problems: list[AnnotationProblem]) -> list[act.Action]:
        """Refused annotations: in the log, and on the pod for its user to see."""
        out: list[act.Action] = []
        for problem in problems:
            log.warning("%s", problem)
            out.append(act.PodWarning(problem.pod, ANNOTATION_WARNING, str(problem)))
        return out
