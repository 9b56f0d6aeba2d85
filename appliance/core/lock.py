"""The GPU lock: one queue per GPU, modes, time quanta, compute quotas, and when to wake up.

Rules, per GPU (keyed by UUID):
- `on`: one holder at a time, first come first served.
- `off`: everyone runs; clients are told not to gate at all (unless they carry a core quota).
- `auto`: holders run concurrently while their memory fits the GPU; a client that does not fit
  waits, and the time quantum then serialises until it fits again.
- A holder is asked to drop only when someone eligible waits and its quantum has run out, or
  when its compute quota for the window is spent. A client that disconnects frees everything.
- A drop has a deadline (`scheduler.dropDeadline`): a holder that has not released by then
  (a hostile client, a hook wedged in a synchronisation) no longer holds the GPU hostage. It is
  taken off the holders, so the next client is granted; it is marked as an offender (status,
  metrics, log, a Warning Event on its pod) and queued behind every client that drops in time,
  until it completes a drop in time itself.

Priorities (`priority`) order each queue and let a waiter of higher priority take the GPU after
a short slice of the holder's; the starvation limit bounds how long a low priority waits. While
someone waits, the holder's hook is told to hand the lock over after a short idle time
(`scheduler.idleHandoff`) instead of `scheduler.idleRelease` (`LockTerms`).

Guaranteed shares (`share`) come before both: a waiter still owed its share goes first and
takes the GPU from a holder that has had its own; a holder inside its share keeps the GPU.

Compute quotas (`quota.QuotaAccount`) bill the time a client holds the lock; a quota holder is
dropped early enough for its drain to end on its budget, and a client whose budget is spent waits
for its next window.

Every client's lock time is accounted exactly here (`state.LockUsage`): how long it held the lock
(from the grant to the release, the drain included), how long it waited for it, and why it was
dropped; status, `nvsharectl top` and the metrics read it.
"""

from __future__ import annotations

import logging

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import priority, share
from appliance.core.quota import EPSILON_S
from appliance.core.state import Client, Gpu, NodeState, Phase
from appliance.policy.model import Mode

log = logging.getLogger("nvshare.scheduler")

LOCK_NOT_RELEASED = "NvshareLockNotReleased"  # the reason of the Event on an offender's pod
MIN_IDLE_HANDOFF_S = 0.001  # the hook counts idle time in milliseconds; below, no hand-off


class Lock:
    def __init__(self, state: NodeState) -> None:
        self._s = state

    # ------------------------------------------------------------ requests

    def requested(self, e: ev.LockRequested, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        gpu = self._s.gpus[c.gpu]
        if not c.gated or c.phase is Phase.HOLDING:
            # Not gated, or already holding: answer at once so the hook never blocks on us.
            return [self.grant_message(c, e.seq, now)]
        c.request_seq = e.seq
        if c.phase in (Phase.DRAINING, Phase.OVERDUE):
            c.requeue = True  # asked again before its release arrived: queue it then
            return []
        if c.phase is not Phase.WAITING:
            self._enqueue(gpu, c, now)
        return self.schedule(gpu, now)

    def released(self, e: ev.LockReleased, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        gpu = self._s.gpus[c.gpu]
        if c.id in gpu.holders:
            if c.phase is Phase.DRAINING:
                c.offender = False  # dropped in time: back in line like everyone else
            self._bill(c, now)
            self._end_hold(c, now)
            gpu.holders.discard(c.id)
            self._s.counters[f"releases_{e.reason.value}"] += 1
        elif c.phase is Phase.OVERDUE:
            self._s.counters["releases_late"] += 1
            log.info(
                "client %d (pid %d) released the lock %.1fs after it was told to drop",
                c.id,
                c.ident.pid,
                now - c.dropped_at,
            )
        elif c.id in gpu.queue:  # gave up waiting (e.g. exiting)
            gpu.queue.remove(c.id)
        c.phase = Phase.IDLE
        if e.reason is ev.ReleaseReason.IDLE:
            c.lent_at = now  # it takes the GPU back at once from a lower priority
        if c.requeue:
            c.requeue = False
            self._enqueue(gpu, c, now)
        return self.schedule(gpu, now)

    def _enqueue(self, gpu: Gpu, c: Client, now: float) -> None:
        """Wait in line: behind everyone, except that offenders wait behind every client that
        drops in time."""
        c.phase, c.requested_at = Phase.WAITING, now
        if c.offender:
            gpu.queue.append(c.id)
            return
        clients = self._s.clients
        at = next((i for i, q in enumerate(gpu.queue) if clients[q].offender), len(gpu.queue))
        gpu.queue.insert(at, c.id)

    def leave(self, c: Client, now: float) -> bool:
        """Take a client that is gone out of its GPU's queue and holders; True if it held."""
        gpu = self._s.gpus[c.gpu]
        held = c.id in gpu.holders
        if held:
            self._end_hold(c, now)
        gpu.holders.discard(c.id)
        if c.id in gpu.queue:
            gpu.queue.remove(c.id)
        return held

    def ungate(self, c: Client, now: float) -> list[act.Action]:
        """A client that is no longer gated: a waiting one is answered at once."""
        gpu = self._s.gpus[c.gpu]
        out: list[act.Action] = []
        if c.phase is Phase.WAITING:
            gpu.queue.remove(c.id)
            out.append(self.grant_message(c, c.request_seq, now))
        if c.id in gpu.holders:
            self._end_hold(c, now)
        gpu.holders.discard(c.id)
        c.phase = Phase.IDLE
        return out

    def grant_message(self, c: Client, seq: int, now: float) -> act.Grant:
        c.idle_told_s = self._idle_window(c, self._waiting(self._s.gpus[c.gpu], now))
        return act.Grant(
            c.id,
            seq,
            time_quantum_s=self._s.time_quantum(c.gpu),
            idle_release_s=c.idle_told_s,
        )

    def _idle_window(self, c: Client, waiting: list[Client]) -> float:
        """How long c may sit idle with the lock: the short hand-off while someone waits."""
        settings = self._s.policy.scheduler
        handoff = settings.idle_handoff_s
        if handoff >= MIN_IDLE_HANDOFF_S and any(w is not c for w in waiting):
            return min(handoff, settings.idle_release_s)
        return settings.idle_release_s

    def _tell_idle_windows(self, gpu: Gpu, waiting: list[Client]) -> list[act.Action]:
        """A holder whose idle window changed (someone started or stopped waiting) is told."""
        out: list[act.Action] = []
        for h in [self._s.clients[h] for h in gpu.holders]:
            window = self._idle_window(h, waiting)
            if h.phase is Phase.HOLDING and window != h.idle_told_s:
                h.idle_told_s = window
                out.append(act.LockTerms(h.id, self._s.time_quantum(h.gpu), window))
        return out

    # ------------------------------------------------------------ scheduling

    def schedule_all(self, now: float) -> list[act.Action]:
        out: list[act.Action] = []
        for gpu in self._s.gpus.values():
            out += self.schedule(gpu, now)
        return out

    def schedule(self, gpu: Gpu, now: float) -> list[act.Action]:
        """Drop spent quotas, grant whoever may run, and preempt for whoever waits."""
        out = [
            *self._pass_over_late_holders(gpu, now),
            *self._drop_spent_quotas(gpu, now),
            *self._grant_waiting(gpu, now),
        ]
        waiting = self._waiting(gpu, now)  # who is left waiting, for the holders' turns
        return [
            *out,
            *self._preempt_for_waiters(gpu, waiting, now),
            *self._tell_idle_windows(gpu, waiting),
        ]

    def _pass_over_late_holders(self, gpu: Gpu, now: float) -> list[act.Action]:
        """A holder still draining past the drop deadline no longer holds the GPU."""
        deadline = self._s.policy.scheduler.drop_deadline_s
        out: list[act.Action] = []
        for h in [self._s.clients[h] for h in gpu.holders]:
            if h.phase is Phase.DRAINING and now >= h.dropped_at + deadline - EPSILON_S:
                out += self._pass_over(gpu, h, now)
        return out

    def _pass_over(self, gpu: Gpu, c: Client, now: float) -> list[act.Action]:
        self._bill(c, now)
        self._end_hold(c, now)
        gpu.holders.discard(c.id)
        c.phase = Phase.OVERDUE
        c.offender = True
        c.late_drops += 1
        self._s.counters["drops_overdue"] += 1
        message = (
            f"client {c.id} (pid {c.ident.pid}) did not release GPU {gpu.facts.uuid} within "
            f"{self._s.policy.scheduler.drop_deadline_s:g}s of being told to drop "
            "it (scheduler.dropDeadline); the next client is granted, and this one waits behind "
            "every client that drops in time"
        )
        log.warning("%s", message)
        pod, _ = self._s.pod_of(c.ident)
        if pod is None:
            return []
        return [act.PodWarning(pod.ref, LOCK_NOT_RELEASED, message)]

    def _drop_spent_quotas(self, gpu: Gpu, now: float) -> list[act.Action]:
        """A holder whose quota is spent drops, even if nobody waits."""
        settings = self._s.policy.scheduler
        out: list[act.Action] = []
        for h in [self._s.clients[h] for h in gpu.holders]:
            if h.phase is Phase.HOLDING and h.quota is not None:
                self._bill(h, now)
                h.quota.roll(now, settings)
                min_hold = h.granted_at + settings.quota_sample_interval_s
                if h.quota.hold_s(settings) <= EPSILON_S and now >= min_hold - EPSILON_S:
                    out.append(self._drop(h, now, "quota"))
        return out

    def _grant_waiting(self, gpu: Gpu, now: float) -> list[act.Action]:
        mode = self._s.gpu_mode(gpu.facts.uuid)
        out: list[act.Action] = []
        for c in self._waiters(gpu, now):
            if mode is Mode.ON and gpu.holders:
                break
            # AUTO: first come first served while it fits; never skip ahead of one that does not.
            if mode is Mode.AUTO and gpu.holders and not self._fits(gpu, c):
                break
            out.append(self._grant(gpu, c, now))
        return out

    def _preempt_for_waiters(self, gpu: Gpu, waiting: list[Client], now: float) -> list[act.Action]:
        """The holder whose turn for an eligible waiter has come drops (one at a time)."""
        due = self._next_yield(gpu, waiting, now)
        if due is not None and now >= due[0] - EPSILON_S:
            return [self._drop(due[1], now, due[2])]
        return []

    def _next_yield(
        self, gpu: Gpu, waiting: list[Client], now: float
    ) -> tuple[float, Client, str] | None:
        """The earliest (time, holder, why) a holder must drop for one of the (eligible)
        waiting; None while nobody waits, in mode off, or while a holder is still draining."""
        if self._s.gpu_mode(gpu.facts.uuid) is Mode.OFF:
            return None
        holders = [self._s.clients[h] for h in gpu.holders]
        if not waiting or any(h.phase is Phase.DRAINING for h in holders):
            return None
        owed = self._owed(waiting, now)
        turns = [
            (*self._turn(h, waiting, owed, now), h) for h in holders if h.phase is Phase.HOLDING
        ]
        if not turns:
            return None
        at, why, holder = min(turns, key=lambda t: (t[0], t[2].granted_at))
        return at, holder, why

    def _turn(
        self, h: Client, waiting: list[Client], owed: set[int], now: float
    ) -> tuple[float, str]:
        """When holder h must drop for one of the waiters, and why: by priority and quantum,
        sooner for a waiter owed its share, never while h is inside its own."""
        settings = self._s.policy.scheduler
        quantum = self._s.time_quantum(h.gpu)
        self._bill(h, now)
        shortest = (h.granted_at + settings.quota_sample_interval_s, share.REQUEST)
        turns = []
        for w in priority.kinds(h, waiting, owed):
            turn = priority.yield_at(h, w, quantum_s=quantum, settings=settings)
            if w.id in owed or (h.share_grant and w.limits.priority >= h.limits.priority):
                turn = min(turn, shortest)
            turns.append(turn)
        at, why = min(turns)
        return max(at, now + share.owed_s(h, now, settings)), why

    def _waiting(self, gpu: Gpu, now: float) -> list[Client]:
        """The eligible waiters of a GPU, in the order they came."""
        clients = self._s.clients
        return [c for q in gpu.queue if (c := clients[q]).quota is None or self._eligible(c, now)]

    def _owed(self, waiting: list[Client], now: float) -> set[int]:
        """Those still owed part of their guaranteed share (`share`)."""
        settings = self._s.policy.scheduler
        return {
            c.id
            for c in waiting
            if c.guarantee is not None and share.owed_s(c, now, settings) > EPSILON_S
        }

    def _waiters(self, gpu: Gpu, now: float) -> list[Client]:
        """The eligible waiters of a GPU, in the order they are granted."""
        waiting = self._waiting(gpu, now)
        return priority.line(waiting, now, self._s.policy.scheduler, self._owed(waiting, now))

    def _eligible(self, c: Client, now: float) -> bool:
        if c.quota is None:
            return True
        c.quota.roll(now, self._s.policy.scheduler)
        return c.quota.may_start(self._s.policy.scheduler)

    def _fits(self, gpu: Gpu, c: Client) -> bool:
        size = self._s.gpu_memory(gpu.facts.uuid)
        if not size:
            return False  # nothing is known to fit on a GPU of unknown size: serialise
        limit = size - self._s.policy.memory.reserve_bytes
        running = sum(self._s.clients[h].footprint for h in gpu.holders)
        return running + c.footprint <= limit

    def _grant(self, gpu: Gpu, c: Client, now: float) -> act.Grant:
        gpu.queue.remove(c.id)
        gpu.holders.add(c.id)
        settings = self._s.policy.scheduler
        c.phase = Phase.HOLDING
        c.full_quantum = priority.starved(c, now, settings)
        c.lent_at = None
        # Cut short for another's share, it has the rest of its quantum back; granted for its
        # own share, it gives the GPU back once it has had it (`share`).
        resumed = c.share_cut and now - c.dropped_at < self._s.time_quantum(gpu.facts.uuid)
        c.quantum_from = c.quantum_from if resumed else now
        c.share_cut, c.share_grant = False, gpu.last_drop == share.REQUEST
        gpu.last_drop = ""
        c.granted_at = c.billed_until = now
        c.usage.waited_s += now - c.requested_at
        self._s.counters["grants"] += 1
        log.debug("grant gpu %s -> client %d (pid %d)", gpu.facts.uuid, c.id, c.ident.pid)
        return self.grant_message(c, c.request_seq, now)

    def _drop(self, c: Client, now: float, why: str) -> act.Drop:
        self._bill(c, now)
        c.phase = Phase.DRAINING
        c.dropped_at = now
        c.share_cut = why == share.REQUEST and not c.share_grant
        self._s.gpus[c.gpu].last_drop = why
        c.usage.drops[why] += 1
        self._s.counters[f"drops_{why}"] += 1
        log.debug("drop client %d (pid %d): %s", c.id, c.ident.pid, why)
        return act.Drop(c.id)

    def _bill(self, c: Client, now: float) -> None:
        """Bill a quota holder up to now; a draining one is billed its whole drain at once,
        at its release, so its drain estimate learns the drop-to-release time."""
        settings = self._s.policy.scheduler
        if c.quota is not None and c.phase is Phase.DRAINING:
            c.quota.bill_drain(c.billed_until, now, settings)
        elif c.quota is not None and c.phase is Phase.HOLDING:
            c.quota.bill(c.billed_until, now, settings)
        if c.guarantee is not None and c.phase in (Phase.HOLDING, Phase.DRAINING):
            c.guarantee.bill(c.billed_until, now, settings)  # the drain ran its work too
        c.billed_until = now

    def _end_hold(self, c: Client, now: float) -> None:
        c.usage.held_s += max(0.0, now - c.granted_at)

    # ------------------------------------------------------------ deadlines

    def next_deadline(self, now: float) -> float | None:
        """When the lock must be looked at again: a quantum, a quota or a drop deadline running
        out, or a waiting client's next quota window."""
        times = [t for gpu in self._s.gpus.values() for t in self._deadlines(gpu, now)]
        return min(times) if times else None

    def _deadlines(self, gpu: Gpu, now: float) -> list[float]:
        settings = self._s.policy.scheduler
        waiters = [self._s.clients[q] for q in gpu.queue]
        holding = [self._s.clients[h] for h in gpu.holders]
        times = [
            w.quota.next_window(settings)
            for w in waiters
            if w.quota is not None and not self._eligible(w, now)
        ]
        # A waiter that has had its share is owed a new one when its window turns.
        times += [w.guarantee.next_window(settings) for w in waiters if w.guarantee is not None]
        if (due := self._next_yield(gpu, self._waiting(gpu, now), now)) is not None:
            times.append(due[0])
        for h in holding:
            if h.phase is Phase.DRAINING:
                times.append(h.dropped_at + settings.drop_deadline_s)
            if h.quota is not None and h.phase is Phase.HOLDING:
                # A grant lasts at least one sample interval, so a tiny budget cannot
                # turn into grant/drop ping-pong; otherwise the drop comes its drain before
                # the budget ends.
                left = max(0.0, h.quota.hold_s(settings))
                times.append(
                    max(h.billed_until + left, h.granted_at + settings.quota_sample_interval_s)
                )
        return times
