"""The core of the node daemon: every decision, as a pure function of events and the time.

Sans-I/O: `NodeCore.handle(event, now)` returns the actions to take (`actions`); the caller
(`appliance.daemon.engine`) owns the clock and the sockets and calls back with `Tick` once
`next_deadline()` has passed. Every rule is tested with a fake clock in `tests/core`.

This module routes each event to the part whose job it is (an explicit table) and keeps what
they share: who is registered, and what every hook must enforce, pushed to exactly the hooks
whose limits changed. The parts: `lock` (queues, modes, quanta, quotas), `ledger` (memory and
the real-time check), `admin` (nvsharectl's commands), `annotations.PodTable` (pods and what
their annotations ask for), `unhooked` (GPU processes without the hook), `views` (what status
and metrics show), `shown` (the GPU as a process is shown it).

What each event costs (n clients, G GPUs, P distinct priorities waiting; "accounted" are gangs
with a quota or a guaranteed share, "lenders" idle clients that let their GPU go idle; the
lock's indexes are `line.Line`). No event a hook can send walks every client:
- PriorityHint that changes nothing, GangHint: O(1).
- LockRequested, LockReleased, Tick, PriorityHint, GangPosition: O(G x P + log n +
  owning + accounted + members of the gangs involved + lenders that may be lent to); the lock
  reads its line lazily and stops once every GPU anyone waits for is taken. A gang's first
  forming (two GPUs asked for) looks at the job's clients once: O(n).
- ClientRegistered, ClientGone: the above, plus O(clients on its ledger + clients asking for a
  share on its GPU).
- MemoryReserveRequested, MemoryReturned: O(clients on its ledger) (+ a schedule in mode auto).
- GpuFreeMemory: O(n), once per NVML sample (what NVML shows every process holding).
- PolicyChanged, PodSeen, PodRemoved, PodsListed, AdminLimitSet: O(n): every client's limits
  may change, and every index that depends on them is rebuilt.
- After each event, `next_deadline` (a query that writes nothing): O(G + owning + paced
  lenders); each GPU's turn is kept as the event's schedule worked it out, and worked out
  again (O(P)) only for a GPU that moved since or whose holder has a share.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import invariants, views
from appliance.core.admin import Admin
from appliance.core.annotations import AnnotationProblem, PodTable
from appliance.core.authority import STATE_CHANGES, Authority
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.ledger import Ledger
from appliance.core.limits import describe, gpu_settings
from appliance.core.lock import Lock
from appliance.core.published import PublishedLimits, published_limits
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
        authority: Authority | None = None,
        remembered: Mapping[str, int | None] | None = None,
    ) -> None:
        self.state = NodeState(
            policy=policy,
            inventory=dict(inventory or {}),
            watching_pods=watching_pods,
            pods=PodTable(remembered),
        )
        self.authority = authority or Authority()
        self._published: PublishedLimits | None = None
        self._publish_due = True  # the first event publishes what hooks should fall back to
        self._noted: set[str] = set()  # what was said once
        self.lock = Lock(self.state)
        self.ledger = Ledger(self.state, self.lock)
        self.admin = Admin(self.state, refresh=self._refresh_all)
        self.unhooked = UnhookedWatch(self.state)
        self._deadline: float | None = None
        self._deadline_at: float | None = 0.0  # the time of the last event, until it is asked
        self._handlers: dict[type, Callable[[Any, float], list[act.Action]]] = {
            ev.ClientRegistered: self._on_registered,
            ev.ClientGone: self._on_gone,
            ev.LockRequested: self.lock.requested,
            ev.LockReleased: self.lock.released,
            ev.GangHint: self.lock.gangs.hinted,
            ev.PriorityHint: self._on_priority_hint,
            ev.GangPosition: self.lock.gangs.reported,
            ev.MemoryReserveRequested: self.ledger.reserve,
            ev.MemoryReturned: self.ledger.returned,
            ev.MemoryRefusedByHook: self.ledger.refused_by_hook,
            ev.GpuFreeMemory: self.ledger.sampled,
            ev.GpuProcessesSeen: self.unhooked.seen,
            ev.PolicyChanged: self._on_policy,
            ev.PodSeen: self._on_pod_seen,
            ev.PodRemoved: self._on_pod_removed,
            ev.PodsListed: self._on_pods_listed,
            ev.TimeQuantumSet: self._permitted(self.admin.set_time_quantum),
            ev.ModeSet: self._permitted(self.admin.set_mode),
            ev.AdminLimitSet: self._permitted(self.admin.set_limits),
            ev.Tick: self._on_tick,
        }

    # ------------------------------------------------------------ public surface

    def check(self) -> None:
        """Every redundant index against the facts it is kept from (`invariants`), the
        lock's kept deadline against one worked out afresh, every holder's terms (idle
        window, queue bound) against those its hook was told, and after a quiet request
        (`calm`) the whole schedule, on a copy, deciding nothing more; O(n), for tests."""
        invariants.check(self.state, self.lock.line)
        now = self.lock.line.now
        untold = self.lock.terms.untold(self.lock.line.waiting(now)) if self.lock.told else []
        if untold:  # (an event that schedules nothing tells nothing: the next one does)
            raise invariants.StateOutOfStep(f"holders {untold} were not told their terms")
        kept, afresh = self.lock.next_deadline(now), self.lock.next_deadline(now, afresh=True)
        if kept != afresh:
            raise invariants.StateOutOfStep(
                f"the lock's kept deadline {kept} != {afresh} worked out afresh at {now}"
            )
        skipped = copy.deepcopy(self.lock).schedule(now) if self.lock.yields.only else []
        if skipped:  # (on a copy: what the phases a quiet request skipped would decide)
            raise invariants.StateOutOfStep(f"a quiet request (`calm`) skipped {skipped}")

    def handle(self, event: ev.Event, now: float) -> list[act.Action]:
        self.lock.line.catch_up(now)  # (what the lock files waiters by follows the clock)
        self.lock.told, self.lock.yields.only = False, None
        actions = self._handlers[type(event)](event, now)
        self._deadline_at = now  # worked out when asked: the actions go out first
        if self._publish_due:
            actions += self._publish()
        return actions

    def next_deadline(self) -> float | None:
        """When to call back with `Tick`, as of the last event: a query (it writes nothing),
        O(G + owning + paced lenders) (`Lock.next_deadline`)."""
        if self._deadline_at is not None:
            self._deadline = self.lock.next_deadline(self._deadline_at)
            self._deadline_at = None
        reclaim = self.ledger.next_deadline()
        if reclaim is not None and (self._deadline is None or reclaim < self._deadline):
            return reclaim
        return self._deadline

    def status(
        self, now: float, clients: tuple[views.ClientView, ...] | None = None
    ) -> views.StatusView:
        return views.status(self.state, now, lambda uuid: self.lock.line.queue(uuid, now), clients)

    def client_rows(self, now: float) -> Iterator[views.ClientView]:
        """Each connected client's status row, one at a time: a caller may stop between rows
        and come back after other events (a client gone by then is left out)."""
        for cid in list(self.state.clients):
            c = self.state.clients.get(cid)
            if c is not None:
                yield views.client_view(self.state, c, now)

    def explain(self, query: views.ExplainQuery) -> views.ExplainView:
        return views.explain(self.state, query)

    def overrides(self) -> views.OverridesView:
        return views.overrides(self.state)

    def load(self) -> dict[str, int]:
        return views.load(self.state)

    def memory_view(self, ident: ClientIdentity, gpu_uuid: str, gpu_total: int) -> MemoryView:
        return memory_view(self.state, ident, gpu_uuid, gpu_total)

    def _permitted(
        self, change: Callable[[Any, float], list[act.Action]]
    ) -> Callable[[Any, float], list[act.Action]]:
        """A state change, done only for whom `authority` allows; anyone else gets a refusal."""

        def guarded(e: Any, now: float) -> list[act.Action]:
            asker = e.reply_to.ident
            refusal = self.authority.refusal(asker, STATE_CHANGES[type(e)])
            if refusal is None:
                return change(e, now)
            log.warning("refused to let %s %s: %s", e.by, STATE_CHANGES[type(e)], refusal)
            return [act.Reply(e.reply_to, act.Outcome.REFUSED, refusal)]

        return guarded

    # ------------------------------------------------------------ clients

    def _on_tick(self, e: ev.Tick, now: float) -> list[act.Action]:
        return self.ledger.expire(now) + self.lock.schedule(now)

    def _on_registered(self, e: ev.ClientRegistered, now: float) -> list[act.Action]:
        s = self.state
        if e.gpu_uuid not in s.gpus:
            s.gpus[e.gpu_uuid] = Gpu(facts=self._gpu_facts(e))
        c = Client(
            id=e.client_id,
            ident=e.ident,
            gpu=e.gpu_uuid,
            env_memory=e.env_memory_bytes,
            env_core=e.env_core_percent,
        )
        s.clients[c.id] = c
        s.gpus[c.gpu].clients.add(c.id)
        self.unhooked.forget(c.ident.pid, why=REGISTERED)
        c.pod_source = s.pod_of(c.ident)[1]
        self._refresh_limits(c, now)
        self.lock.gangs.registered(c)
        self._rescale(c.gpu, now)
        self._note_claim(c)
        s.counters["registrations"] += 1
        peers = self.ledger.joined(c)
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
        gpu = s.gpus[c.gpu]
        gpu.clients.discard(c.id)
        gpu.asking.discard(c.id)
        s.lent_told.discard(c.id)
        held, out = self.lock.leave(c, now)
        self._rescale(c.gpu, now)
        s.retain_usage(c)
        s.counters["disconnects"] += 1
        log.info(
            "client %d (pid %d) gone%s; %s of reservation freed",
            c.id,
            c.ident.pid,
            " while holding the lock" if held else "",
            format_bytes(c.reserved),
        )
        out += self.lock.schedule(now)
        if c.gpu not in s.inventory and not gpu.clients:
            del s.gpus[c.gpu]  # a GPU NVML does not list is kept only while someone uses it
        return out + self.ledger.left(c, now)

    def _gpu_facts(self, e: ev.ClientRegistered) -> GpuFacts:
        """A GPU's identity and size come from NVML; a GPU NVML does not list is known by the
        hook's name for it, and its size from the policy (`gpus[].memory`) or, only where the
        policy says to trust hooks with it, from the first registration."""
        s = self.state
        if (facts := s.inventory.get(e.gpu_uuid)) is not None:
            return facts
        trusted = s.policy.trust.hook_gpu_size
        facts = GpuFacts(uuid=e.gpu_uuid, memory_total=e.gpu_total_memory if trusted else 0)
        if not gpu_settings(s.policy, facts).memory_bytes:
            self._note_once(
                "unknown-size",
                "GPU %s is not one NVML lists and the policy declares no size for it "
                "(gpus[].memory), so its size is unknown: it bounds no ledger (each client's "
                "limit still does) and mode auto serialises; trust.hookGpuSize takes the first "
                "hook's word (said once)",
                e.gpu_uuid,
            )
        return facts

    def _note_claim(self, c: Client) -> None:
        """Say once (per reason) why a pod name a process claims has no effect."""
        ident = c.ident
        if not ident.claimed_pod or c.pod_source == "claimed":
            return
        if ident.pod_uid:
            key, why = "in-pod", f"its cgroup names pod {ident.pod_uid}, and the kernel's word wins"
        elif ident.uid not in self.state.policy.trust.pod_claim_uids:
            key, why = (
                "untrusted",
                (
                    f"uid {ident.uid} is not in the policy's trust.podClaimUids, so the name is "
                    "ignored"
                ),
            )
        elif not ident.claimed_namespace:
            key, why = "no-namespace", "it names no namespace, so the name is ignored"
        else:
            return
        self._note_once(
            f"claim-{key}",
            "client %d (pid %d) names pod %s/%s (NVSHARE_POD_NAMESPACE/NVSHARE_POD_NAME), but "
            "%s (said once)",
            c.id,
            ident.pid,
            ident.claimed_namespace,
            ident.claimed_pod,
            why,
        )

    def _note_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------ limits

    def _on_priority_hint(self, e: ev.PriorityHint, now: float) -> list[act.Action]:
        c = self.state.clients.get(e.client_id)
        if c is None or c.env_priority == e.priority:
            return []  # (a hint said again costs nothing: O(1))
        c.env_priority = e.priority
        self._refresh_limits(c, now)  # (a priority is the daemon's alone: nothing to push)
        self.lock.gangs.refresh(self.state.gangs[c.gang])
        return self.lock.schedule(now)

    def _rescale(self, uuid: str, now: float) -> None:
        """Shares of a GPU scaled again; a gang whose member's share changed is filed again."""
        for c in self.lock.shares.rescale(uuid, now):
            self.lock.line.refile(self.state.gangs[c.gang])

    def _refresh_limits(self, c: Client, now: float) -> bool:
        """Recompute a client's limits; True when what its hook must enforce changed."""
        c.limits = self.state.resolve(c, with_env=True)
        if c.limits.core_percent < 100:
            if c.quota is None:
                c.quota = QuotaAccount(percent=c.limits.core_percent, window_start=now)
            c.quota.percent = c.limits.core_percent
        else:
            c.quota = None
        self.lock.shares.wants(c)
        if c.gang in self.state.gangs:  # its quota or share may move its place in line
            self.lock.line.refile(self.state.gangs[c.gang])
        enforced = self.state.enforced(c)
        changed = enforced != c.enforced
        c.enforced = enforced
        return changed

    def _refresh_all(self, now: float) -> list[act.Action]:
        """Push changed limits to the clients they concern, and nobody else."""
        s = self.state
        out: list[act.Action] = []
        for c in s.clients.values():
            c.pod_source = s.pod_of(c.ident)[1]
            if not self._refresh_limits(c, now):
                continue
            out.append(act.LimitsChanged(c.id, c.enforced))
            s.counters["limit_updates"] += 1
            if c.enforced.mode is Mode.OFF:
                out += self.lock.ungate(c, now)
        for uuid in s.gpus:
            self._rescale(uuid, now)
        for gang in s.gangs.values():
            self.lock.gangs.refresh(gang)
        self._publish_due = True
        return out + self.lock.schedule(now) + self.ledger.peer_updates()

    def _publish(self) -> list[act.Action]:
        """What hooks that cannot register fall back to, when it changed."""
        self._publish_due = False
        published = published_limits(self.state)
        if published == self._published:
            return []
        self._published = published
        return [act.LimitsPublished(published)]

    # ------------------------------------------------------------ policy and pods

    def _on_policy(self, e: ev.PolicyChanged, now: float) -> list[act.Action]:
        s = self.state
        old, s.policy = s.policy, e.policy
        self.admin.policy_changed(old, e.policy, now)
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

    def _on_pods_listed(self, e: ev.PodsListed, now: float) -> list[act.Action]:
        self.state.pods.listed(e.uids)
        return self._refresh_all(now)

    def _warnings(self, problems: list[AnnotationProblem]) -> list[act.Action]:
        """Refused annotations: in the log, and on the pod for its user to see."""
        out: list[act.Action] = []
        for problem in problems:
            log.warning("%s", problem)
            out.append(act.PodWarning(problem.pod, ANNOTATION_WARNING, str(problem)))
        return out
