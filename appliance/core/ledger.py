"""GPU memory: one ledger per (subject, GPU), the real-time check, and what NVML shows.

The subject is the pod (by UID from the kernel's cgroup) or else the process. Hooks reserve in
chunks, so most allocations need no round trip, and two processes of a pod can never exceed its
limit together. A reservation refused for want of room that peers on its ledger hold reserved
and unused waits for them to give it back (MEM_RECLAIM), briefly, and is then decided again: a
process's chunk is no reason to refuse its pod's others. The real-time check refuses (or warns
about) a reservation that the GPU's free memory, as NVML last saw it, cannot hold. What NVML
shows each process holding is passed to its hook, which counts what its own ledger misses
(module globals, heaps, stacks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuUse
from appliance.core.lock import Lock
from appliance.core.state import Client, NodeState, Phase
from appliance.policy.model import Backing, Mode, RealtimeCheckMode
from appliance.policy.quantity import format_bytes

log = logging.getLogger("nvshare.scheduler")

UNBOUNDED = 1 << 62
# What NVML shows a process holding for its CUDA context (module images, stacks, the runtime's
# own buffers) and the hook does not charge; measured on H100/H200 (bench/results/gpu.md).
CONTEXT_ALLOWANCE_BYTES = 768 << 20
OBSERVED_STEP_BYTES = 2 << 20  # smaller NVML changes are not sent to the hook
# How long a refused reservation waits for its peers to give back their unused reservations;
# hooks answer at once (their reader thread), so this only bounds a peer that does not.
RECLAIM_WAIT_S = 0.25


def counted(c: Client) -> int:
    """What a client holds as its ledger counts it: its allocations, or what NVML shows its
    process holding beyond the context allowance where that is more (as its hook counts)."""
    if c.nvml_used is None:
        return c.used
    return max(c.used, c.nvml_used - CONTEXT_ALLOWANCE_BYTES)


@dataclass(frozen=True, slots=True)
class _FreeSample:
    free: int
    time: float


@dataclass(slots=True)
class _Reclaim:
    """A reservation refused for want of room that peers hold unused, waiting for them."""

    request: ev.MemoryReserveRequested
    waiting_on: set[int]  # peers asked to give back, not yet answered
    deadline: float


class Ledger:
    """Reservations, returns and samples; in mode auto a change of memory may move the lock."""

    def __init__(self, state: NodeState, lock: Lock) -> None:
        self._s = state
        self._lock = lock
        self._free: dict[str, _FreeSample] = {}
        self._stale_logged: set[str] = set()
        self._reclaims: dict[int, _Reclaim] = {}  # by the client whose reservation waits
        self._asked: dict[int, set[int]] = {}  # peer -> the clients waiting for its answer

    # ------------------------------------------------------------ reservations

    def reserve(self, e: ev.MemoryReserveRequested, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        out = self._forget_reclaim(c.id, now)  # a hook asks once at a time; another ask is news
        c.used = self._usage(c, e.used)
        return out + self._decide(c, e, now, may_wait=True)

    def _decide(
        self, c: Client, e: ev.MemoryReserveRequested, now: float, *, may_wait: bool
    ) -> list[act.Action]:
        limit = self._limit(c)
        others = self._others_footprint(c)
        # What c would hold with exactly this grant. Its usage counts even where its reservation
        # does not cover it yet (a hook that reconnected to a restarted daemon).
        holding = max(c.used, c.reserved + e.bytes)
        room = limit - others - holding
        if room < 0 and may_wait:
            asked = self._ask_peers(c, e, shortfall=-room, now=now)
            if asked:
                return asked
        if room < 0 or self._realtime_refuses(c, e.bytes, now):
            self._s.counters["memory_refusals"] += 1
            c.refusals += 1
            log.info(
                "memory refused: client %d (pid %d, %s) asked %s more; its ledger holds %s of %s",
                c.id,
                c.ident.pid,
                self._s.subject(c),
                format_bytes(e.bytes),
                format_bytes(others + c.footprint),
                format_bytes(limit),
            )
            return [act.MemoryGranted(c.id, e.seq, 0, c.reserved)]
        # Round the grant up toward a chunk, so the next allocations need no round trip.
        granted = e.bytes + min(max(self._s.policy.memory.chunk_bytes - e.bytes, 0), room)
        c.reserved += granted
        return [act.MemoryGranted(c.id, e.seq, granted, c.reserved), *self._memory_moved(c, now)]

    def returned(self, e: ev.MemoryReturned, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        c.reserved = max(0, c.reserved - e.bytes)
        c.used = self._usage(c, e.used)
        return self._memory_moved(c, now) + self._answered(c.id, now)

    # ------------------------------------------------------------ reclaims

    def _ask_peers(
        self, c: Client, e: ev.MemoryReserveRequested, *, shortfall: int, now: float
    ) -> list[act.Action]:
        """Where the peers on c's ledger that hold a reservation may hold the room c lacks
        unused: ask each of them to give back what it does not use, and decide c's request
        when they have answered (or after RECLAIM_WAIT_S). A hook reports what it frees inside
        its reservation only at its next tick, so what a peer holds may all be unused by now.
        No actions: nothing to wait for. O(clients on the ledger)."""
        key = self._s.ledger_of.get(c.id)
        members = self._s.ledgers.get(key, set()) if key is not None else set()
        holding = {
            m: self._s.clients[m].footprint
            for m in members
            if m != c.id and self._s.clients[m].reserved > 0
        }
        if not holding or sum(holding.values()) < shortfall:
            return []
        self._reclaims[c.id] = _Reclaim(e, set(holding), now + RECLAIM_WAIT_S)
        for m in holding:
            self._asked.setdefault(m, set()).add(c.id)
        self._s.counters["memory_reclaims"] += 1
        return [act.MemoryReclaim(m) for m in sorted(holding)]

    def _answered(self, peer: int, now: float) -> list[act.Action]:
        """A peer answered (any return counts: it can only have made room) or left: the
        requests that waited for it alone are decided now."""
        out: list[act.Action] = []
        for waiting in sorted(self._asked.pop(peer, ())):
            r = self._reclaims.get(waiting)
            if r is None:
                continue
            r.waiting_on.discard(peer)
            if not r.waiting_on:
                out += self._settle(waiting, now)
        return out

    def _settle(self, cid: int, now: float) -> list[act.Action]:
        r = self._reclaims.pop(cid)
        for peer in r.waiting_on:
            self._asked.get(peer, set()).discard(cid)
        c = self._s.clients.get(cid)
        return [] if c is None else self._decide(c, r.request, now, may_wait=False)

    def _forget_reclaim(self, cid: int, now: float) -> list[act.Action]:
        """c's waiting request, decided now (c asks again, or is gone: no answer)."""
        return self._settle(cid, now) if cid in self._reclaims else []

    def expire(self, now: float) -> list[act.Action]:
        """Requests whose peers did not answer in time, decided as things stand."""
        out: list[act.Action] = []
        for cid in [cid for cid, r in self._reclaims.items() if r.deadline <= now]:
            out += self._settle(cid, now)
        return out

    def next_deadline(self) -> float | None:
        """When the earliest waiting request is decided without its peers: O(waiting)."""
        if not self._reclaims:  # (asked after every event; usually nobody waits)
            return None
        return min(r.deadline for r in self._reclaims.values())

    def refused_by_hook(self, e: ev.MemoryRefusedByHook, now: float) -> list[act.Action]:
        """What a hook refused without asking (over the limit it knows) counts as refused too."""
        c = self._s.clients.get(e.client_id)
        if c is not None:
            self._s.counters["memory_refusals_hook"] += e.count
            c.refusals += e.count
            log.debug(
                "client %d (pid %d): its hook refused %d allocation(s), the largest %s",
                c.id,
                c.ident.pid,
                e.count,
                format_bytes(e.largest),
            )
        return []

    def _usage(self, c: Client, reported: int) -> int:
        """What a client's report of its own usage counts for: up to what the daemon granted
        it, and beyond that (a hook that reconnected to a restarted daemon holds memory granted
        before) up to what its ledger may hold at all, never more. A client that claims more
        can only crowd its own ledger, and only that far."""
        bound = max(c.reserved, self._limit(c))
        if reported <= bound:
            return reported
        self._s.counters["usage_reports_capped"] += 1
        if not c.usage_capped:
            c.usage_capped = True
            log.warning(
                "client %d (pid %d) reports %s in use, more than it was granted or may hold "
                "(%s); counted as %s (said once per client)",
                c.id,
                c.ident.pid,
                format_bytes(reported),
                format_bytes(bound),
                format_bytes(bound),
            )
        return bound

    def _memory_moved(self, c: Client, now: float) -> list[act.Action]:
        """In mode auto what fits decides who runs: look at c's GPU again."""
        if self._s.gpu_mode(c.gpu) is Mode.AUTO:
            return self._lock.schedule(now)
        return []

    def _limit(self, c: Client) -> int:
        """What c's ledger may hold: the limit without c's own environment's (the ledger is
        shared by the pod), else the GPU."""
        limit = self._s.resolve(c, with_env=False).memory_bytes
        if limit is not None:
            return limit
        size = self._s.gpu_memory(c.gpu)
        if self._s.policy.memory.backing is Backing.MANAGED or not size:
            return UNBOUNDED  # an unknown size bounds nothing: the driver refuses past the GPU
        return size - self._s.policy.memory.reserve_bytes

    def _others_footprint(self, c: Client) -> int:
        """What the other clients on c's ledger (same subject, same GPU) use or have reserved."""
        key = self._s.ledger_of.get(c.id)
        members = self._s.ledgers.get(key, set()) if key is not None else set()
        return sum(self._s.clients[m].footprint for m in members if m != c.id)

    def joined(self, c: Client) -> list[act.Action]:
        """c registered: it shares its ledger's count. O(clients on that ledger)."""
        key = (self._s.subject(c), c.gpu)
        self._s.ledgers.setdefault(key, set()).add(c.id)
        self._s.ledger_of[c.id] = key
        return self._tell(key)

    def left(self, c: Client, now: float) -> list[act.Action]:
        """c is gone (already out of `clients`): one process fewer on its ledger."""
        key = self._s.ledger_of.pop(c.id, None)
        if key is None:
            return []
        members = self._s.ledgers[key]
        members.discard(c.id)
        if not members:
            del self._s.ledgers[key]
        self._forget_reclaim(c.id, now)  # gone: its request needs no answer
        return self._tell(key) + self._answered(c.id, now)

    def peer_updates(self) -> list[act.Action]:
        """Every client filed by its ledger again (what a subject is may have changed: pods,
        policy), and told of a changed count: O(clients)."""
        self._s.ledgers.clear()
        self._s.ledger_of.clear()
        for c in self._s.clients.values():
            key = (self._s.subject(c), c.gpu)
            self._s.ledgers.setdefault(key, set()).add(c.id)
            self._s.ledger_of[c.id] = key
        out: list[act.Action] = []
        for key in list(self._s.ledgers):
            out += self._tell(key)
        return out

    def _tell(self, key: tuple[str, str]) -> list[act.Action]:
        """Tell each hook of a ledger how many processes share it, when that changed: while
        the daemon is unreachable a hook may grow only to an equal share of a shared limit."""
        members = [self._s.clients[m] for m in sorted(self._s.ledgers.get(key, ()))]
        n = len({c.ident.pid for c in members})
        out: list[act.Action] = []
        for c in members:
            if n != c.peers_told:
                c.peers_told = n
                out.append(act.PeersChanged(c.id, n))
        return out

    # ------------------------------------------------------------ real-time check

    def sampled(self, e: ev.GpuFreeMemory, now: float) -> list[act.Action]:
        for uuid, free in e.samples.items():
            self._free[uuid] = _FreeSample(free, now)
            self._stale_logged.discard(uuid)
            self._s.use[uuid] = GpuUse(
                uuid=uuid,
                index=self._s.facts(uuid).index,
                memory_used=e.used.get(uuid),
                utilization_percent=e.utilization.get(uuid),
                sampled_at=now,
            )
        out, shown = self._observed(e.processes)
        if shown:  # a waiting gang member's context on its GPU is now known (`gang.touched`)
            out += self._lock.schedule(now)
        return out

    def _realtime_refuses(self, c: Client, need: int, now: float) -> bool:
        rt = self._s.policy.realtime_check
        mode = rt.mode_for(pod_opt_in=self._realtime_opt_in(c))
        if mode is RealtimeCheckMode.DISABLED:
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
            self._s.counters["realtime_skipped"] += 1
            return False
        available = sample.free - rt.safety_margin_bytes
        if need <= available:
            return False
        free, margin = format_bytes(max(available, 0)), format_bytes(rt.safety_margin_bytes)
        if mode is RealtimeCheckMode.WARNING:
            self._s.counters["realtime_warnings"] += 1
            log.warning(
                "real-time check (warning): client %d wants %s, gpu %s has %s free beyond the "
                "%s margin; granted anyway",
                c.id,
                format_bytes(need),
                c.gpu,
                free,
                margin,
            )
            return False
        self._s.counters["realtime_refusals"] += 1
        log.warning(
            "real-time check (strict): refused %s to client %d (pid %d): gpu %s has %s free "
            "beyond the %s margin",
            format_bytes(need),
            c.id,
            c.ident.pid,
            c.gpu,
            free,
            margin,
        )
        return True

    def _realtime_opt_in(self, c: Client) -> bool | None:
        """What the client's pod says by annotation (None: nothing, the policy decides)."""
        pod, _ = self._s.pod_of(c.ident)
        override = self._s.pods.overrides_of(pod)
        return None if override is None else override.realtime_check

    def _observed(
        self, processes: Mapping[str, Mapping[int, int]]
    ) -> tuple[list[act.Action], bool]:
        """Tell each hook what NVML shows its process holding, so that memory which never
        passed an allocation call (module globals, heaps, stacks) counts against its limit.
        True where a waiting client was shown on its GPU for the first time."""
        out: list[act.Action] = []
        shown = False
        for c in self._s.clients.values():
            used = processes.get(c.gpu, {}).get(c.ident.pid)
            if used is None:
                continue
            shown |= c.nvml_used is None and c.phase is Phase.WAITING
            c.nvml_used = used
            limit = c.limits.memory_bytes
            if limit is not None and used > limit + CONTEXT_ALLOWANCE_BYTES:
                self._s.counters["nvml_over_limit"] += 1
            if c.nvml_told is None or abs(used - c.nvml_told) >= OBSERVED_STEP_BYTES:
                c.nvml_told = used
                out.append(act.MemoryObserved(c.id, used, CONTEXT_ALLOWANCE_BYTES))
        return out, shown
