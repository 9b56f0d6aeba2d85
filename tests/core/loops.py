"""Loops of several kinds and priorities driven through the core as their hooks would drive
it, on a fake clock (`test_crowd.py`, `test_served.py`, `test_starved.py`, and
`bench/crowd_model.py`'s crowds). A loop is

- `busy`: always has work (a training step after a step);
- `pausing:WORK:LO:HI`: works WORK s, then waits on the host LO-HI s (a data loader), handing
  the GPU over after the idle window (`scheduler.idleHandoff`) and asking again when its batch
  is there;
- `request:GAP:WORK[:poisson]`: a request every GAP s (or at Poisson arrivals of mean GAP),
  WORK s of GPU each; with nothing left to serve it hands the GPU over after the idle window.

A `low:` prefix lowers the loop itself (NVSHARE_GPU_PRIORITY=low); a `g2:` prefix (before it)
puts the loop on a second GPU of the node. A loop told to drop
releases DRAIN_S later and asks again when it has work. `Crowd.run` drives them (after
`Crowd.warm_up`, if asked: a step each and a long pause, as programs start); each `Loop` then
has the seconds it held the GPU, its waits from asking to a grant (the last one to the end of
the run if it is not over), the longest it went without the GPU, its steps (pauses reached),
how long it waited each time it asked again inside its quantum after lending the GPU, with
more of it left than a borrower's drain (`backs`; a quantum that runs out while the borrower
drains is over, and the loop waits its turn like anyone), how often it was told to drop as
it was granted (`flashes`: churn) and its requests' latencies; the crowd has who had each
turn (a hold of `TURN_S` or more) in order.
`check=True` checks the core's indexes after every event (as the core tests do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.policy.model import PRIORITY_NAMES, Policy, SchedulerSettings

GPU = "GPU-model000-0000-0000-0000-000000000000"
GPU2 = "GPU-model000-0000-0000-0000-000000000001"  # a `g2:` loop's
DRAIN_S = 0.002
TURN_S = 1.0  # a hold this long is a turn (a quantum), shorter a borrow or a step
LOW = PRIORITY_NAMES["low"]  # what the hook sends for NVSHARE_GPU_PRIORITY=low
IDLE = ev.ReleaseReason.IDLE


@dataclass
class Loop:
    cid: int
    spec: str
    kind: str
    low: bool
    gpu: str = GPU
    work: float = 0.0
    pause: tuple[float, float] = (0.0, 0.0)
    gap: float = 0.0
    poisson: bool = False
    seq: int = 0
    holds: bool = False
    granted_at: float = 0.0
    asked_at: float | None = None
    release_at: float | None = None  # told to drop: when it releases
    done_at: float | None = None  # holding: when its work in hand is done
    left: float | None = None  # work in hand, not yet started or cut by a drop
    back_at: float | None = None  # pausing: when its next batch is there
    idle_at: float | None = None  # idle, holding: when its hook hands the GPU over
    next_request: float | None = None
    requests: list[float] = field(default_factory=list)  # arrivals not yet served
    latency: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    held: float = 0.0
    steps: int = 0  # idle releases: a pausing loop's steps
    released_at: float = 0.0
    longest_off: float = 0.0  # the longest from a release to the next grant
    quantum_from: float = 0.0  # its last grant that was not a taking back
    asked_back_at: float | None = None  # it asked again after lending, over a drain left
    backs: list[float] = field(default_factory=list)  # those requests' waits
    flashes: int = 0  # grants told to drop at once: held only the drain (churn, if many)


def parse(cid: int, spec: str) -> Loop:
    gpu = GPU2 if spec.startswith("g2:") else GPU
    rest = spec.removeprefix("g2:")
    low = rest.startswith("low:")
    parts = rest.removeprefix("low:").split(":")
    lp = Loop(cid, spec, parts[0], low, gpu)
    if lp.kind == "pausing":
        lp.work, lp.pause = float(parts[1]), (float(parts[2]), float(parts[3]))
    elif lp.kind == "request":
        lp.gap, lp.work, lp.poisson = float(parts[1]), float(parts[2]), parts[3:] == ["poisson"]
    elif lp.kind != "busy":
        raise ValueError(f"no such loop kind: {spec!r}")
    return lp


class Crowd:
    def __init__(
        self, specs: list[str], seed: int, settings: SchedulerSettings, check: bool = False
    ) -> None:
        self.rng = random.Random(seed)
        self.settings = settings
        self.check = check
        self.turns: list[int] = []
        gpus = {uuid: GpuFacts(uuid=uuid, memory_total=80 << 30) for uuid in (GPU, GPU2)}
        self.core = NodeCore(Policy(scheduler=settings), inventory=gpus)
        self.now = 0.0
        self.loops: dict[int, Loop] = {}
        for cid, spec in enumerate(specs, start=1):
            ident = ClientIdentity(pid=1000 + cid, uid=1000, gid=1000)
            lp = self.loops[cid] = parse(cid, spec)
            self.feed(ev.ClientRegistered(cid, 1, ident, lp.gpu, 80 << 30))
            if lp.low:
                self.feed(ev.PriorityHint(cid, LOW))

    def feed(self, event: ev.Event) -> None:
        out = self.core.handle(event, self.now)
        if self.check:
            self.core.check()
        for a in out:
            lp = self.loops.get(getattr(a, "client_id", -1))
            if isinstance(a, act.Grant) and lp is not None:
                self._granted(lp)
            elif isinstance(a, act.Drop) and lp is not None:
                lp.release_at = self.now + DRAIN_S
                if lp.done_at is not None:  # what it had not done yet it does when granted
                    lp.left, lp.done_at = max(lp.done_at - self.now, 1e-4), None

    def _granted(self, lp: Loop) -> None:
        lp.holds, lp.granted_at = True, self.now
        lp.longest_off = max(lp.longest_off, self.now - lp.released_at)
        if lp.asked_back_at is None:
            lp.quantum_from = self.now
        else:
            lp.backs.append(self.now - lp.asked_back_at)
            lp.asked_back_at = None
        if lp.asked_at is not None:
            lp.waits.append(self.now - lp.asked_at)
            lp.asked_at = None
        if lp.kind != "busy":
            lp.done_at, lp.left = self.now + (lp.left if lp.left is not None else lp.work), None

    def ask(self, lp: Loop) -> None:
        if lp.asked_at is None and not lp.holds:
            lp.seq += 1
            lp.asked_at = self.now
            self.feed(ev.LockRequested(lp.cid, lp.seq))

    def release(self, lp: Loop, why: ev.ReleaseReason) -> None:
        lp.holds, lp.release_at, lp.idle_at = False, None, None
        held = self.now - lp.granted_at
        lp.held += held
        lp.steps += why is IDLE
        lp.flashes += why is ev.ReleaseReason.DROPPED and held <= DRAIN_S + 1e-9
        lp.released_at = self.now
        if held >= TURN_S:
            self.turns.append(lp.cid)
        self.feed(ev.LockReleased(lp.cid, why))

    def idle_release(self, lp: Loop) -> None:
        """Nothing to do: its hook hands the GPU over after the idle window, unless its next
        work (a request, a batch) comes inside that window (it submits again: not idle)."""
        window = self.now + self.settings.idle_handoff_s
        if min(t for t in (lp.next_request, lp.back_at, window + 1) if t is not None) < window:
            return  # (`step` sets it working again when the work comes)
        lp.idle_at = window  # (the others' events meanwhile come in their order: `step`)

    def advance_to(self, t: float) -> None:
        while (d := self.core.next_deadline()) is not None and d <= t:
            self.now = max(self.now, d)
            self.feed(ev.Tick())
        self.now = t

    def warm_up(self) -> None:
        """As programs start: a step each in turn, then a pause on the CPU longer than a quantum
        (compiling, waiting for the others), with the GPU lent."""
        for lp in self.loops.values():
            self.ask(lp)
            self.advance_to(self.now + 0.02)
            if lp.holds:
                self.release(lp, IDLE)
            lp.done_at = lp.left = None
        self.advance_to(self.now + 2 * self.settings.time_quantum_s)
        for lp in self.loops.values():
            lp.released_at = self.now
        self.turns.clear()

    def run(self, seconds: float) -> None:
        for lp in self.loops.values():
            if lp.kind == "request":
                lp.next_request = self.now + self.rng.uniform(0, lp.gap)
            else:
                lp.left = lp.work if lp.kind == "pausing" else None
                self.ask(lp)
                self.advance_to(self.now + 0.1)
        end = self.now + seconds
        while self.now < end:
            times = [end, self.core.next_deadline()]
            for lp in self.loops.values():
                times += [lp.release_at, lp.done_at, lp.back_at, lp.next_request, lp.idle_at]
            self.advance_to(max(self.now, min(t for t in times if t is not None)))
            for lp in self.loops.values():
                self.step(lp)
        for lp in self.loops.values():  # a wait not over yet counts as long as it has been
            if lp.asked_at is not None:
                lp.waits.append(self.now - lp.asked_at)

    def step(self, lp: Loop) -> None:
        now = self.now
        if lp.release_at is not None and lp.release_at <= now:
            self.release(lp, ev.ReleaseReason.DROPPED)
            if lp.kind == "busy" or lp.left is not None:
                self.ask(lp)
        if lp.next_request is not None and lp.next_request <= now:
            self._request(lp)
        if lp.back_at is not None and lp.back_at <= now:
            self._batch(lp)
        if lp.done_at is not None and lp.done_at <= now and lp.holds:
            lp.done_at = None
            self.done(lp)
        if lp.idle_at is not None and lp.idle_at <= now:
            lp.idle_at = None
            if lp.holds and lp.release_at is None and lp.done_at is None:
                self.release(lp, IDLE)

    def _request(self, lp: Loop) -> None:
        """A request comes: served at once if the loop holds the GPU and is idle, else asked for."""
        now = self.now
        lp.requests.append(now)
        gap = self.rng.expovariate(1 / lp.gap) if lp.poisson else lp.gap
        lp.next_request = now + gap
        if lp.done_at is None and lp.left is None:
            lp.left = lp.work
            self.ask(lp)
            if lp.holds and lp.release_at is None:
                lp.done_at, lp.left = now + lp.work, None

    def _batch(self, lp: Loop) -> None:
        """A pausing loop's next batch is there."""
        now = self.now
        lp.back_at, lp.left = None, lp.work
        if lp.holds and lp.release_at is None:  # its batch came inside the idle window
            lp.done_at, lp.left = now + lp.work, None
        else:
            if now + DRAIN_S < lp.quantum_from + self.settings.time_quantum_s:
                lp.asked_back_at = now
            self.ask(lp)

    def done(self, lp: Loop) -> None:
        """Its work in hand is done: a pausing loop waits for its batch, a request loop serves
        the next request or goes idle."""
        if lp.kind == "pausing":
            lp.back_at = self.now + self.rng.uniform(*lp.pause)
            self.idle_release(lp)
            return
        lp.latency.append(self.now - lp.requests.pop(0))
        if lp.requests:
            lp.done_at = self.now + lp.work
        else:
            self.idle_release(lp)


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * len(xs))] if xs else 0.0
