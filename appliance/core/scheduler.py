"""The scheduler: per-GPU lock queues, modes, time quanta, quotas and the memory ledger.

Sans-I/O: `Scheduler.handle(event, now)` returns the messages to send; the caller owns the
sockets and the clock and calls back with `Tick` once `next_deadline()` has passed. Every rule
here is tested with a fake clock in `tests/core`.

Lock rules, per GPU (keyed by UUID):
- `on`: one holder at a time, first come first served.
- `off`: everyone runs; clients are told not to gate at all (unless they carry a core quota).
- `auto`: holders run concurrently while their memory fits the GPU; a client that does not fit
  waits, and the time quantum then serialises until it fits again.
- A holder is asked to drop only when someone eligible waits and its quantum has run out, or
  when its compute quota for the window is spent. A client that disconnects frees everything.

Memory: one ledger per (subject, GPU), the subject being the pod (by UID from the kernel's
cgroup) or else the process. Hooks reserve in chunks, so most allocations need no round trip,
and two processes of a pod can never exceed its limit together.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance import protocol as p
from appliance.core import events as ev
from appliance.core.identity import ClientIdentity
from appliance.core.limits import EffectiveLimits, GpuFacts, describe, gpu_settings, resolve_limits
from appliance.core.pods import PodInfo, PodOverrides
from appliance.core.quota import QuotaAccount
from appliance.policy.model import (
    MAX_DURATION_S,
    MIN_TIME_QUANTUM_S,
    Backing,
    Limits,
    Mode,
    Policy,
    RealtimeCheckMode,
)
from appliance.policy.quantity import MAX_SIZE_BYTES, format_bytes

log = logging.getLogger("nvshare.scheduler")

MAX_TIME_QUANTUM_S = MAX_DURATION_S
UNBOUNDED = 1 << 62
# What NVML shows a process holding for its CUDA context (module images, stacks, the runtime's
# own buffers) and the hook does not charge; measured on H100/H200 (bench/results/gpu.md).
CONTEXT_ALLOWANCE_BYTES = 768 << 20
OBSERVED_STEP_BYTES = 2 << 20  # smaller NVML changes are not sent to the hook
EPSILON_S = 1e-6  # float slack on quota arithmetic


class Phase(enum.Enum):
    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    DRAINING = "draining"  # told to drop, still synchronising


@dataclass(slots=True)
class Client:
    id: int
    ident: ClientIdentity
    gpu: str
    env_memory: int
    env_core: int
    limits: EffectiveLimits
    wire: p.WireLimits
    phase: Phase = Phase.IDLE
    request_seq: int = 0
    requested_at: float = 0.0
    granted_at: float = 0.0
    billed_until: float = 0.0
    reserved: int = 0
    used: int = 0
    quota: QuotaAccount | None = None
    requeue: bool = False  # asked for the lock again while draining
    pod_source: str = ""  # "cgroup", "claimed" or ""
    peers_told: int = 1  # processes on its ledger, as the hook last heard it
    nvml_used: int | None = None  # what NVML last showed its process holding
    nvml_told: int | None = None

    @property
    def footprint(self) -> int:
        return max(self.used, self.reserved)


@dataclass(slots=True)
class Gpu:
    facts: GpuFacts
    queue: deque[int] = field(default_factory=deque)
    holders: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _FreeSample:
    free: int
    time: float


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        *,
        inventory: dict[str, GpuFacts] | None = None,
        watching_pods: bool = False,
    ) -> None:
        self.policy = policy
        self.watching_pods = watching_pods  # without a pod watch, claimed pod names mean nothing
        self._claim_noted = False
        self.inventory = dict(inventory or {})
        self.clients: dict[int, Client] = {}
        self.gpus: dict[str, Gpu] = {}
        self.pods: dict[str, PodInfo] = {}
        self.pod_overrides: dict[str, PodOverrides] = {}
        self.admin: dict[tuple[str, str], Limits] = {}
        self.tq_override: float | None = None
        self.mode_override: dict[str, Mode] = {}  # "" = every GPU
        self.counters: Counter[str] = Counter()
        self._free: dict[str, _FreeSample] = {}
        self._deadline: float | None = None
        self._stale_logged: set[str] = set()
        self._handlers: dict[type, Callable[[Any, float], Sequence[ev.Action]]] = {
            ev.ClientRegistered: self._on_registered,
            ev.ClientGone: self._on_gone,
            ev.LockRequested: self._on_lock_requested,
            ev.LockReleased: self._on_lock_released,
            ev.MemoryReserveRequested: self._on_reserve,
            ev.MemoryReturned: self._on_return,
            ev.PolicyChanged: self._on_policy,
            ev.PodUpdated: self._on_pod_updated,
            ev.PodRemoved: self._on_pod_removed,
            ev.TimeQuantumSet: self._on_set_tq,
            ev.ModeSet: self._on_set_mode,
            ev.AdminLimitSet: self._on_admin_limit,
            ev.GpuFreeMemory: self._on_free_memory,
            ev.Tick: self._on_tick,
        }

    # ------------------------------------------------------------ public surface

    def handle(self, event: ev.Event, now: float) -> list[ev.Action]:
        actions = list(self._handlers[type(event)](event, now))
        self._deadline = self._compute_deadline(now)
        return actions

    def next_deadline(self) -> float | None:
        return self._deadline

    def gpu_mode(self, uuid: str) -> Mode:
        override = self.mode_override.get(uuid) or self.mode_override.get("")
        return override or gpu_settings(self.policy, self._facts(uuid))[0]

    def time_quantum(self, uuid: str) -> float:
        return self.tq_override or gpu_settings(self.policy, self._facts(uuid))[1]

    def gpu_memory(self, uuid: str) -> int:
        return gpu_settings(self.policy, self._facts(uuid))[2]

    def load(self) -> dict[str, int]:
        """Connected clients per GPU, for the device plugin's placement."""
        return dict(Counter(c.gpu for c in self.clients.values()))

    # ------------------------------------------------------------ registration

    def _facts(self, uuid: str) -> GpuFacts:
        gpu = self.gpus.get(uuid)
        if gpu is not None:
            return gpu.facts
        return self.inventory.get(uuid, GpuFacts(uuid=uuid))

    def _pod_of(self, ident: ClientIdentity) -> tuple[PodInfo | None, str]:
        if ident.pod_uid and ident.pod_uid in self.pods:
            return self.pods[ident.pod_uid], "cgroup"
        if ident.claimed_pod:
            for pod in self.pods.values():
                if pod.name == ident.claimed_pod and pod.namespace == ident.claimed_namespace:
                    return pod, "claimed"
        return None, ""

    def _resolve(self, c: Client, *, with_env: bool) -> EffectiveLimits:
        pod, _ = self._pod_of(c.ident)
        admin_pid = self.admin.get(("pid", str(c.ident.pid)))
        admin_pod = self.admin.get(("pod", f"{pod.namespace}/{pod.name}")) if pod else None
        admin = admin_pid or admin_pod
        if admin_pid and admin_pod:
            admin = Limits(
                memory_bytes=admin_pid.memory_bytes or admin_pod.memory_bytes,
                core_percent=admin_pid.core_percent or admin_pod.core_percent,
            )
        return resolve_limits(
            policy=self.policy,
            ident=c.ident,
            gpu=self._facts(c.gpu),
            pod=pod,
            annotations=self.pod_overrides.get(pod.uid) if pod else None,
            admin=admin,
            env_memory_bytes=c.env_memory if with_env else 0,
            env_core_percent=c.env_core if with_env else 0,
        )

    def _wire(self, c: Client) -> p.WireLimits:
        mode = self.gpu_mode(c.gpu)
        quota = c.limits.core_percent < 100
        if c.limits.exempt or (mode is Mode.OFF and not quota):
            wire_mode = p.WireMode.OFF
        else:
            wire_mode = p.WireMode.ON if mode is Mode.OFF else p.wire_mode(mode)
        mem = self.policy.memory
        return p.WireLimits(
            mem_limit=c.limits.memory_bytes or 0,
            core_limit=c.limits.core_percent,
            mode=wire_mode,
            backing=p.WireBacking.MANAGED
            if mem.backing is Backing.MANAGED
            else p.WireBacking.DEVICE,
            flags=p.LIMIT_SINGLE_OVERSUB if mem.single_process_oversubscription else 0,
        )

    def _on_registered(self, e: ev.ClientRegistered, now: float) -> list[ev.Send]:
        if e.gpu_uuid not in self.gpus:
            base = self.inventory.get(e.gpu_uuid, GpuFacts(uuid=e.gpu_uuid))
            facts = GpuFacts(
                uuid=e.gpu_uuid,
                index=base.index,
                model=base.model,
                total_memory=base.total_memory or e.gpu_total_memory,
            )
            self.gpus[e.gpu_uuid] = Gpu(facts=facts)
        placeholder = p.WireLimits(0, 100, p.WireMode.ON)
        c = Client(
            id=e.client_id,
            ident=e.ident,
            gpu=e.gpu_uuid,
            env_memory=e.env_memory_bytes,
            env_core=e.env_core_percent,
            limits=EffectiveLimits(None, 100, False),
            wire=placeholder,
        )
        self.clients[c.id] = c
        c.pod_source = self._pod_of(c.ident)[1]
        self._refresh_limits(c, now)
        self._note_claim(c)
        self.counters["registrations"] += 1
        peers = self._peer_updates()
        log.info(
            "client %d registered: pid %d uid %d gpu %s pod %s limits %s",
            c.id,
            c.ident.pid,
            c.ident.uid,
            c.gpu,
            self._pod_label(c),
            describe(c.limits),
        )
        return [ev.Send(c.id, p.Registered(c.id, c.wire), e.seq), *peers]

    def _refresh_limits(self, c: Client, now: float) -> bool:
        """Recompute a client's limits; True when what the hook must know changed."""
        c.limits = self._resolve(c, with_env=True)
        if c.limits.core_percent < 100:
            if c.quota is None:
                c.quota = QuotaAccount(percent=c.limits.core_percent, window_start=now)
            c.quota.percent = c.limits.core_percent
        else:
            c.quota = None
        wire = self._wire(c)
        changed = wire != c.wire
        c.wire = wire
        return changed

    def _note_claim(self, c: Client) -> None:
        """Say once why a pod name a process claims has no effect here."""
        ident = c.ident
        if self.watching_pods or self._claim_noted or ident.pod_uid or not ident.claimed_pod:
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

    def _on_gone(self, e: ev.ClientGone, now: float) -> list[ev.Send]:
        c = self.clients.pop(e.client_id, None)
        if c is None:
            return []
        self._drop_pid_override(c.ident.pid)
        gpu = self.gpus[c.gpu]
        was_holder = c.id in gpu.holders
        gpu.holders.discard(c.id)
        if c.id in gpu.queue:
            gpu.queue.remove(c.id)
        self.counters["disconnects"] += 1
        log.info(
            "client %d (pid %d) gone%s; %s of reservation freed",
            c.id,
            c.ident.pid,
            " while holding the lock" if was_holder else "",
            format_bytes(c.reserved),
        )
        return self._schedule(gpu, now) + self._peer_updates()

    # ------------------------------------------------------------------ the lock

    def _on_lock_requested(self, e: ev.LockRequested, now: float) -> list[ev.Send]:
        c = self.clients.get(e.client_id)
        if c is None:
            return []
        gpu = self.gpus[c.gpu]
        if c.wire.mode is p.WireMode.OFF or c.phase is Phase.HOLDING:
            # Not gated, or already holding: answer at once so the hook never blocks on us.
            return [ev.Send(c.id, self._grant_message(c.gpu), e.seq)]
        c.request_seq = e.seq
        if c.phase is Phase.DRAINING:  # asked again before its release arrived: queue it then
            c.requeue = True
            return []
        if c.phase is not Phase.WAITING:
            c.phase = Phase.WAITING
            c.requested_at = now
            gpu.queue.append(c.id)
        return self._schedule(gpu, now)

    def _on_lock_released(self, e: ev.LockReleased, now: float) -> list[ev.Send]:
        c = self.clients.get(e.client_id)
        if c is None:
            return []
        gpu = self.gpus[c.gpu]
        if c.id in gpu.holders:
            self._bill(c, now)
            gpu.holders.discard(c.id)
            self.counters[f"releases_{e.reason.name.lower()}"] += 1
        elif c.id in gpu.queue:  # gave up waiting (e.g. exiting)
            gpu.queue.remove(c.id)
        c.phase = Phase.IDLE
        if c.requeue:
            c.requeue = False
            c.phase, c.requested_at = Phase.WAITING, now
            gpu.queue.append(c.id)
        return self._schedule(gpu, now)

    def _eligible(self, c: Client, now: float) -> bool:
        if c.quota is None:
            return True
        c.quota.roll(now, self.policy.scheduler)
        return c.quota.remaining_s(self.policy.scheduler) > EPSILON_S

    def _fits(self, gpu: Gpu, c: Client) -> bool:
        limit = self.gpu_memory(gpu.facts.uuid) - self.policy.memory.reserve_bytes
        running = sum(self.clients[h].footprint for h in gpu.holders)
        return running + c.footprint <= limit

    def _grant(self, gpu: Gpu, c: Client, now: float) -> ev.Send:
        gpu.queue.remove(c.id)
        gpu.holders.add(c.id)
        c.phase = Phase.HOLDING
        c.granted_at = c.billed_until = now
        self.counters["grants"] += 1
        self.counters["wait_seconds_total_us"] += int((now - c.requested_at) * 1e6)
        log.debug("grant gpu %s -> client %d (pid %d)", gpu.facts.uuid, c.id, c.ident.pid)
        return ev.Send(c.id, self._grant_message(gpu.facts.uuid), c.request_seq)

    def _grant_message(self, uuid: str) -> p.LockGrant:
        return p.LockGrant(
            tq_ms=int(self.time_quantum(uuid) * 1000),
            idle_release_ms=int(self.policy.scheduler.idle_release_s * 1000),
        )

    def _drop(self, c: Client, now: float, why: str) -> ev.Send:
        self._bill(c, now)
        c.phase = Phase.DRAINING
        self.counters[f"drops_{why}"] += 1
        log.debug("drop client %d (pid %d): %s", c.id, c.ident.pid, why)
        return ev.Send(c.id, p.LockDrop())

    def _bill(self, c: Client, now: float) -> None:
        if c.quota is not None and c.phase in (Phase.HOLDING, Phase.DRAINING):
            c.quota.roll(c.billed_until, self.policy.scheduler)
            c.quota.bill(
                now - c.billed_until,
                tail=c.phase is Phase.DRAINING,
                settings=self.policy.scheduler,
            )
        c.billed_until = now

    def _schedule(self, gpu: Gpu, now: float) -> list[ev.Send]:
        out: list[ev.Send] = []
        settings = self.policy.scheduler
        uuid = gpu.facts.uuid
        mode = self.gpu_mode(uuid)
        holders = [self.clients[h] for h in gpu.holders]
        for h in holders:  # quota spent: drop even if nobody waits
            if h.phase is Phase.HOLDING and h.quota is not None:
                self._bill(h, now)
                h.quota.roll(now, settings)
                min_hold = h.granted_at + settings.quota_sample_interval_s
                if h.quota.remaining_s(settings) <= EPSILON_S and now >= min_hold - EPSILON_S:
                    out.append(self._drop(h, now, "quota"))
        for cid in list(gpu.queue):
            c = self.clients[cid]
            if not self._eligible(c, now):
                continue
            if mode is Mode.OFF:
                out.append(self._grant(gpu, c, now))
            elif mode is Mode.ON:
                if gpu.holders:
                    break
                out.append(self._grant(gpu, c, now))
            else:  # AUTO: FCFS while it fits; never skip ahead of a client that does not fit
                if gpu.holders and not self._fits(gpu, c):
                    break
                out.append(self._grant(gpu, c, now))
        if mode is not Mode.OFF and any(self._eligible(self.clients[q], now) for q in gpu.queue):
            holding = sorted(
                (self.clients[h] for h in gpu.holders if self.clients[h].phase is Phase.HOLDING),
                key=lambda h: h.granted_at,
            )
            draining = any(self.clients[h].phase is Phase.DRAINING for h in gpu.holders)
            tq = self.time_quantum(uuid)
            if holding and not draining and now >= holding[0].granted_at + tq:
                out.append(self._drop(holding[0], now, "quantum"))
        return out

    def _compute_deadline(self, now: float) -> float | None:
        settings = self.policy.scheduler
        times: list[float] = []
        for gpu in self.gpus.values():
            waiters = [self.clients[q] for q in gpu.queue]
            holding = [self.clients[h] for h in gpu.holders]
            for w in waiters:
                if w.quota is not None and not self._eligible(w, now):
                    times.append(w.quota.next_window(settings))
            eligible_waiting = any(w.quota is None or self._eligible(w, now) for w in waiters)
            mode = self.gpu_mode(gpu.facts.uuid)
            if eligible_waiting and mode is not Mode.OFF:
                active = [h for h in holding if h.phase is Phase.HOLDING]
                if active and all(h.phase is not Phase.DRAINING for h in holding):
                    oldest = min(h.granted_at for h in active)
                    times.append(oldest + self.time_quantum(gpu.facts.uuid))
            for h in holding:
                if h.quota is not None and h.phase is Phase.HOLDING:
                    # A grant lasts at least one sample interval, so a tiny budget cannot
                    # turn into grant/drop ping-pong; otherwise the deadline is exact.
                    left = max(0.0, h.quota.remaining_s(settings))
                    times.append(
                        max(h.billed_until + left, h.granted_at + settings.quota_sample_interval_s)
                    )
        return min(times) if times else None

    def _on_tick(self, e: ev.Tick, now: float) -> list[ev.Send]:
        out: list[ev.Send] = []
        for gpu in self.gpus.values():
            out += self._schedule(gpu, now)
        return out

    # ---------------------------------------------------------------- memory

    def _ledger_limit(self, c: Client) -> int:
        limit = self._resolve(c, with_env=False).memory_bytes
        if limit is not None:
            return limit
        if self.policy.memory.backing is Backing.MANAGED:
            return UNBOUNDED
        return self.gpu_memory(c.gpu) - self.policy.memory.reserve_bytes

    def subject(self, c: Client) -> str:
        """Whose ledger a client draws on: its pod (by kernel identity, else as claimed)."""
        pod, _ = self._pod_of(c.ident)
        if pod is not None:
            return f"pod:{pod.uid}"
        if c.ident.pod_uid:
            return f"pod:{c.ident.pod_uid}"
        return f"pid:{c.ident.pid}"

    def _others_footprint(self, c: Client) -> int:
        """What the other clients on c's ledger (same subject, same GPU) use or have reserved."""
        subject = self.subject(c)
        return sum(
            x.footprint
            for x in self.clients.values()
            if x is not c and x.gpu == c.gpu and self.subject(x) == subject
        )

    def _realtime_refuses(self, c: Client, need: int, now: float) -> bool:
        rt = self.policy.realtime_check
        pod, _ = self._pod_of(c.ident)
        override = self.pod_overrides.get(pod.uid) if pod else None
        enabled = rt.enabled_by_default
        if override is not None and override.realtime_check is not None:
            enabled = override.realtime_check
        if rt.mode is RealtimeCheckMode.DISABLED or not enabled:
            return False
        sample = self._free.get(c.gpu)
        if sample is None or now - sample.time > rt.max_sample_age_s:
            if c.gpu not in self._stale_logged:
                self._stale_logged.add(c.gpu)
                log.warning(
                    "real-time check on gpu %s skipped: no NVML sample newer than %.1fs",
                    c.gpu,
                    rt.max_sample_age_s,
                )
            self.counters["realtime_skipped"] += 1
            return False
        available = sample.free - rt.safety_margin_bytes
        if need <= available:
            return False
        if rt.mode is RealtimeCheckMode.WARNING:
            self.counters["realtime_warnings"] += 1
            log.warning(
                "real-time check (warning): client %d wants %s, gpu %s has %s free beyond the "
                "%s margin; granted anyway",
                c.id,
                format_bytes(need),
                c.gpu,
                format_bytes(max(available, 0)),
                format_bytes(rt.safety_margin_bytes),
            )
            return False
        self.counters["realtime_refusals"] += 1
        log.warning(
            "real-time check (strict): refused %s to client %d (pid %d): gpu %s has %s free "
            "beyond the %s margin",
            format_bytes(need),
            c.id,
            c.ident.pid,
            c.gpu,
            format_bytes(max(available, 0)),
            format_bytes(rt.safety_margin_bytes),
        )
        return True

    def _on_reserve(self, e: ev.MemoryReserveRequested, now: float) -> list[ev.Send]:
        c = self.clients.get(e.client_id)
        if c is None:
            return []
        c.used = e.used
        limit = self._ledger_limit(c)
        others = self._others_footprint(c)
        # What c would hold with exactly this grant. Its usage counts even where its reservation
        # does not cover it yet (a hook that reconnected to a restarted daemon).
        holding = max(c.used, c.reserved + e.bytes)
        room = limit - others - holding
        if room < 0 or self._realtime_refuses(c, e.bytes, now):
            self.counters["memory_refusals"] += 1
            log.info(
                "memory refused: client %d (pid %d, %s) asked %s more; its ledger holds %s of %s",
                c.id,
                c.ident.pid,
                self.subject(c),
                format_bytes(e.bytes),
                format_bytes(others + c.footprint),
                format_bytes(limit),
            )
            return [ev.Send(c.id, p.MemGrant(0, c.reserved), e.seq)]
        # Round the grant up toward a chunk, so the next allocations need no round trip.
        granted = e.bytes + min(max(self.policy.memory.chunk_bytes - e.bytes, 0), room)
        c.reserved += granted
        out = [ev.Send(c.id, p.MemGrant(granted, c.reserved), e.seq)]
        if self.gpu_mode(c.gpu) is Mode.AUTO:
            out += self._schedule(self.gpus[c.gpu], now)
        return out

    def _on_return(self, e: ev.MemoryReturned, now: float) -> list[ev.Send]:
        c = self.clients.get(e.client_id)
        if c is None:
            return []
        c.reserved = max(0, c.reserved - e.bytes)
        c.used = e.used
        if self.gpu_mode(c.gpu) is Mode.AUTO:
            return self._schedule(self.gpus[c.gpu], now)
        return []

    def _on_free_memory(self, e: ev.GpuFreeMemory, now: float) -> list[ev.Send]:
        for uuid, free in e.samples.items():
            self._free[uuid] = _FreeSample(free, now)
            self._stale_logged.discard(uuid)
        return self._observed(e.processes)

    def _observed(self, processes: Mapping[str, Mapping[int, int]]) -> list[ev.Send]:
        """Tell each hook what NVML shows its process holding, so that memory which never
        passed an allocation call (module globals, heaps, stacks) counts against its limit."""
        out: list[ev.Send] = []
        for c in self.clients.values():
            used = processes.get(c.gpu, {}).get(c.ident.pid)
            if used is None:
                continue
            c.nvml_used = used
            limit = c.limits.memory_bytes
            if limit is not None and used > limit + CONTEXT_ALLOWANCE_BYTES:
                self.counters["nvml_over_limit"] += 1
            if c.nvml_told is None or abs(used - c.nvml_told) >= OBSERVED_STEP_BYTES:
                c.nvml_told = used
                out.append(ev.Send(c.id, p.MemObserved(used, CONTEXT_ALLOWANCE_BYTES)))
        return out

    def _peer_updates(self) -> list[ev.Send]:
        """Tell each hook how many processes share its ledger, when that changed: while the
        daemon is unreachable a hook may grow only to an equal share of a shared limit."""
        pids: dict[tuple[str, str], set[int]] = {}
        for c in self.clients.values():
            pids.setdefault((self.subject(c), c.gpu), set()).add(c.ident.pid)
        out: list[ev.Send] = []
        for c in self.clients.values():
            n = len(pids[(self.subject(c), c.gpu)])
            if n != c.peers_told:
                c.peers_told = n
                out.append(ev.Send(c.id, p.LedgerPeers(n)))
        return out

    # ---------------------------------------------------------- limit changes

    def _refresh_all(self, now: float) -> list[ev.Send]:
        """Push changed limits to the clients they concern, and nobody else."""
        out: list[ev.Send] = []
        for c in self.clients.values():
            c.pod_source = self._pod_of(c.ident)[1]
            if not self._refresh_limits(c, now):
                continue
            out.append(ev.Send(c.id, p.LimitUpdate(c.wire)))
            self.counters["limit_updates"] += 1
            if c.wire.mode is p.WireMode.OFF:
                gpu = self.gpus[c.gpu]
                if c.phase is Phase.WAITING:  # no longer gated: unblock it
                    gpu.queue.remove(c.id)
                    out.append(ev.Send(c.id, self._grant_message(c.gpu), c.request_seq))
                gpu.holders.discard(c.id)
                c.phase = Phase.IDLE
        for gpu in self.gpus.values():
            out += self._schedule(gpu, now)
        return out + self._peer_updates()

    def _on_policy(self, e: ev.PolicyChanged, now: float) -> list[ev.Send]:
        old = self.policy
        self.policy = e.policy
        if old.scheduler != e.policy.scheduler or old.gpus != e.policy.gpus:
            # The newest writer wins: a policy that changes scheduling replaces nvsharectl's
            # runtime overrides, and says so.
            replaced = []
            if self.tq_override is not None:
                replaced.append(f"time quantum {self.tq_override:g} s")
            replaced += [
                f"mode {mode.value} on {uuid or 'every GPU'}"
                for uuid, mode in sorted(self.mode_override.items())
            ]
            if replaced:
                log.info(
                    "the policy reload changes scheduling settings, so it replaces what "
                    "nvsharectl set: %s",
                    ", ".join(replaced),
                )
            self.tq_override = None
            self.mode_override.clear()
        return self._refresh_all(now)

    def _on_pod_updated(self, e: ev.PodUpdated, now: float) -> list[ev.Send]:
        self.pods[e.pod.uid] = e.pod
        self.pod_overrides[e.pod.uid] = e.overrides
        return self._refresh_all(now)

    def _on_pod_removed(self, e: ev.PodRemoved, now: float) -> list[ev.Send]:
        self.pods.pop(e.pod.uid, None)
        self.pod_overrides.pop(e.pod.uid, None)
        return self._refresh_all(now)

    def _on_set_tq(self, e: ev.TimeQuantumSet, now: float) -> list[ev.Action]:
        policy_tq = self.policy.scheduler.time_quantum_s
        if e.seconds is None:
            if self.tq_override is None:
                return [
                    ev.Reply(
                        e.reply_to, ev.Outcome.DONE, "the time quantum already follows the policy"
                    )
                ]
            log.info(
                "%s handed the time quantum back to the policy (%g s -> %g s)",
                e.by,
                self.tq_override,
                policy_tq,
            )
            self.tq_override = None
            message = f"the time quantum follows the policy again ({policy_tq:g} s)"
            return [ev.Reply(e.reply_to, ev.Outcome.DONE, message), *self._refresh_all(now)]
        if not MIN_TIME_QUANTUM_S <= e.seconds <= MAX_TIME_QUANTUM_S:
            message = (
                f"a time quantum of {e.seconds:g} s is outside {MIN_TIME_QUANTUM_S:g}-"
                f"{MAX_TIME_QUANTUM_S:g} s; nothing changed"
            )
            return [ev.Reply(e.reply_to, ev.Outcome.INVALID, message)]
        before = self.tq_override
        self.tq_override = e.seconds
        was = f"{before:g} s from nvsharectl" if before else f"{policy_tq:g} s from the policy"
        log.info("%s set the time quantum to %g s (was %s)", e.by, e.seconds, was)
        message = f"time quantum set to {e.seconds:g} s on every GPU (was {was})"
        return [ev.Reply(e.reply_to, ev.Outcome.DONE, message), *self._refresh_all(now)]

    def _on_set_mode(self, e: ev.ModeSet, now: float) -> list[ev.Action]:
        where = e.gpu_uuid or "every GPU"
        if e.gpu_uuid and e.gpu_uuid not in self.gpus and e.gpu_uuid not in self.inventory:
            known = ", ".join(sorted(set(self.gpus) | set(self.inventory))) or "none yet"
            message = f"no GPU {e.gpu_uuid} is known here (known: {known}); nothing changed"
            return [ev.Reply(e.reply_to, ev.Outcome.NOT_FOUND, message[:240])]
        if e.mode is None:
            keys = [e.gpu_uuid] if e.gpu_uuid else list(self.mode_override)
            if not any(k in self.mode_override for k in keys):
                message = f"the mode on {where} already follows the policy"
                return [ev.Reply(e.reply_to, ev.Outcome.DONE, message)]
            for key in keys:
                self.mode_override.pop(key, None)
            log.info("%s handed the mode on %s back to the policy", e.by, where)
            message = f"the mode on {where} follows the policy again"
            return [ev.Reply(e.reply_to, ev.Outcome.DONE, message), *self._refresh_all(now)]
        if e.gpu_uuid:
            self.mode_override[e.gpu_uuid] = e.mode
        else:
            self.mode_override = {"": e.mode}
        log.info("%s set mode %s on %s", e.by, e.mode.value, where)
        message = f"anti-thrashing mode {e.mode.value} on {where}"
        return [ev.Reply(e.reply_to, ev.Outcome.DONE, message), *self._refresh_all(now)]

    def _on_admin_limit(self, e: ev.AdminLimitSet, now: float) -> list[ev.Action]:
        kind, name = e.target
        label = f"{kind} {name}"
        invalid = _limit_problem(e.limits)
        if invalid:
            return [ev.Reply(e.reply_to, ev.Outcome.INVALID, f"{invalid}; nothing changed")]
        matched = [c for c in self.clients.values() if self._targets(c, e.target)]
        if kind == "pid" and not matched:
            message = (
                f"no connected client has pid {name}; nothing changed (a pid override is kept "
                "only while that process is connected)"
            )
            return [ev.Reply(e.reply_to, ev.Outcome.NOT_FOUND, message)]
        current = self.admin.get(e.target, Limits())
        memory = None if e.clear_memory else (e.limits.memory_bytes or current.memory_bytes)
        core = None if e.clear_core else (e.limits.core_percent or current.core_percent)
        after = Limits(memory_bytes=memory, core_percent=core)
        if after == current:
            if e.clear_memory or e.clear_core:
                message = f"{label} has no such override to clear; nothing changed"
                return [ev.Reply(e.reply_to, ev.Outcome.NOT_FOUND, message)]
            memory_shown, core_shown = _shown(after)
            message = f"{label} already has memory {memory_shown}, core {core_shown}; no change"
            return [ev.Reply(e.reply_to, ev.Outcome.DONE, message)]
        if after == Limits():
            self.admin.pop(e.target, None)
        else:
            self.admin[e.target] = after
        change = _describe_change(current, after)
        log.info("%s changed the limits of %s: %s", e.by, label, change)
        out: list[ev.Action] = list(self._refresh_all(now))
        message = f"{label}: {change}; {_reach(matched, kind)}{self._env_note(matched)}"
        return [ev.Reply(e.reply_to, ev.Outcome.DONE, message), *out]

    def _targets(self, c: Client, target: tuple[str, str]) -> bool:
        kind, name = target
        if kind == "pid":
            return str(c.ident.pid) == name
        pod, _ = self._pod_of(c.ident)
        return pod is not None and f"{pod.namespace}/{pod.name}" == name

    def _env_note(self, matched: list[Client]) -> str:
        """Say when a process's own, lower environment limit still wins over the override."""
        notes = []
        for c in matched:
            if c.limits.sources.get("memory", "").startswith("env "):
                own = f"NVSHARE_GPU_MEMORY_LIMIT={format_bytes(c.env_memory)}"
                notes.append(f"pid {c.ident.pid}'s own {own} is lower and still applies")
            if c.limits.sources.get("core", "").startswith("env "):
                own = f"NVSHARE_GPU_CORE_LIMIT={c.env_core}%"
                notes.append(f"pid {c.ident.pid}'s own {own} is lower and still applies")
        return "; " + "; ".join(dict.fromkeys(notes)) if notes else ""

    def _drop_pid_override(self, pid: int) -> None:
        """A pid override dies with its process: a later process reusing the pid starts clean."""
        key = ("pid", str(pid))
        if key not in self.admin or any(c.ident.pid == pid for c in self.clients.values()):
            return
        dropped = self.admin.pop(key)
        log.info(
            "dropped the nvsharectl override of pid %d (%s): the process disconnected",
            pid,
            _describe_change(dropped, Limits()),
        )

    def overrides(self) -> list[dict[str, Any]]:
        """Every limit stored by `nvsharectl limit set`, and who it reaches now."""
        rows = []
        for (kind, name), limits in sorted(self.admin.items()):
            reached = [c for c in self.clients.values() if self._targets(c, (kind, name))]
            rows.append(
                {
                    "target": f"{kind} {name}",
                    "memory_limit": limits.memory_bytes,
                    "core_limit": limits.core_percent,
                    "clients": sorted({c.ident.pid for c in reached}),
                }
            )
        return rows

    # ------------------------------------------------------------------ views

    def _pod_label(self, c: Client) -> str:
        pod, source = self._pod_of(c.ident)
        if pod is None:
            return "-"
        return f"{pod.namespace}/{pod.name}" + (" (claimed)" if source == "claimed" else "")

    def client_view(self, c: Client, now: float) -> dict[str, Any]:
        return {
            "id": c.id,
            "pid": c.ident.pid,
            "uid": c.ident.uid,
            "pod": self._pod_label(c),
            "pod_source": c.pod_source or None,
            "gpu": c.gpu,
            "state": c.phase.value,
            "memory_limit": c.limits.memory_bytes,
            "core_limit": c.limits.core_percent,
            "gated": c.wire.mode is not p.WireMode.OFF,
            "memory_used": c.used,
            "memory_reserved": c.reserved,
            "memory_observed": c.nvml_used,
            "held_for_s": round(now - c.granted_at, 3) if c.phase is Phase.HOLDING else None,
            "waiting_for_s": round(now - c.requested_at, 3) if c.phase is Phase.WAITING else None,
            "limits_from": dict(c.limits.sources),
        }

    def status(self, now: float) -> dict[str, Any]:
        gpus = []
        for uuid, gpu in sorted(self.gpus.items()):
            gpus.append(
                {
                    "uuid": uuid,
                    "index": gpu.facts.index,
                    "model": gpu.facts.model,
                    "mode": self.gpu_mode(uuid).value,
                    "mode_source": "nvsharectl"
                    if (uuid in self.mode_override or "" in self.mode_override)
                    else "policy",
                    "time_quantum_s": self.time_quantum(uuid),
                    "tq_source": "nvsharectl" if self.tq_override else "policy",
                    "memory_total": self.gpu_memory(uuid),
                    "holders": sorted(gpu.holders),
                    "queue": list(gpu.queue),
                }
            )
        return {
            "gpus": gpus,
            "clients": [self.client_view(c, now) for c in self.clients.values()],
            "counters": dict(self.counters),
            "default_mode": self.policy.scheduler.mode.value,
            "default_time_quantum_s": self.tq_override or self.policy.scheduler.time_quantum_s,
        }

    def explain(self, *, pid: int | None = None, pod: str | None = None) -> list[dict[str, Any]]:
        out = []
        for c in self.clients.values():
            label = self._pod_label(c)
            if pid is not None and c.ident.pid != pid:
                continue
            if pod is not None and label.split(" ")[0] != pod:
                continue
            out.append(
                {
                    "client": c.id,
                    "pid": c.ident.pid,
                    "pod": label,
                    "gpu": c.gpu,
                    **describe(c.limits),
                }
            )
        return out


def _limit_problem(limits: Limits) -> str | None:
    """What makes a requested override unusable, if anything."""
    if limits.memory_bytes is not None and not 0 < limits.memory_bytes <= MAX_SIZE_BYTES:
        return "a memory limit must be greater than 0 and at most 1Ei (`limit clear` removes one)"
    if limits.core_percent is not None and not 1 <= limits.core_percent <= 100:
        return f"core limit {limits.core_percent} is outside 1-100"
    return None


def _shown(limits: Limits) -> tuple[str, str]:
    memory = "none" if limits.memory_bytes is None else format_bytes(limits.memory_bytes)
    core = "none" if limits.core_percent is None else f"{limits.core_percent}%"
    return memory, core


def _describe_change(before: Limits, after: Limits) -> str:
    """ "memory 4Gi (was none)", only for what changed."""
    parts = []
    for what, old, new in zip(("memory", "core"), _shown(before), _shown(after), strict=True):
        if old != new:
            parts.append(f"{what} override {new} (was {old})")
    return ", ".join(parts)


def _reach(matched: list[Client], kind: str) -> str:
    if matched:
        pids = sorted({c.ident.pid for c in matched})
        return f"applies to {len(matched)} connected client(s), pid {', '.join(map(str, pids))}"
    return "no client of that pod is connected yet; the override waits for it"
