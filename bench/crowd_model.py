"""Crowds of mixed loops on the core's own clock: who has the GPU when loops of several kinds
and priorities share it, for workloads the GPU benchmarks do not run.

No GPU and no daemon: the core (`appliance.core.node.NodeCore`) is fed the events the hooks of
such loops would send, on a fake clock, and answers as it does in the daemon. A loop is

- `busy`: always has work (a training step after a step);
- `pausing:WORK:LO:HI`: works WORK s, then waits on the host LO-HI s (a data loader), handing
  the GPU over after the idle window (`scheduler.idleHandoff`) and asking again when its batch
  is there;
- `request:GAP:WORK[:poisson]`: a request every GAP s (or at Poisson arrivals of mean GAP),
  WORK s of GPU each; with nothing left to serve it hands the GPU over after the idle window.

A `low:` prefix lowers the loop itself (NVSHARE_GPU_PRIORITY=low). A loop told to drop
releases DRAIN_S later and asks again when it has work. TQ 5 s, the other settings default.

    .venv/bin/python bench/crowd_model.py case 'request:0.2:0.02,busy,busy' [--seconds 120]
    .venv/bin/python bench/crowd_model.py sweep [--crowds 60] [--seconds 120]

`case` prints each loop's seconds holding the GPU, its longest wait from asking to a grant and
its requests' p99 latency. `sweep` runs seeded random crowds (2-5 loops of random kinds, paces
and priorities) and prints those where two busy loops of the top priority held more than a
quarter apart (plus a quantum), or a loop waited longer than the others' quanta (top priority)
or the starvation limit and everyone's quanta (lower).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.policy.model import PRIORITY_NAMES, Policy, SchedulerSettings

GPU = "GPU-model000-0000-0000-0000-000000000000"
SETTINGS = SchedulerSettings(time_quantum_s=5.0)
DRAIN_S = 0.002
LOW = PRIORITY_NAMES["low"]  # what the hook sends for NVSHARE_GPU_PRIORITY=low
IDLE = ev.ReleaseReason.IDLE


@dataclass
class Loop:
    cid: int
    spec: str
    kind: str
    low: bool
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
    next_request: float | None = None
    requests: list[float] = field(default_factory=list)  # arrivals not yet served
    latency: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    held: float = 0.0


def parse(cid: int, spec: str) -> Loop:
    low = spec.startswith("low:")
    parts = spec.removeprefix("low:").split(":")
    lp = Loop(cid, spec, parts[0], low)
    if lp.kind == "pausing":
        lp.work, lp.pause = float(parts[1]), (float(parts[2]), float(parts[3]))
    elif lp.kind == "request":
        lp.gap, lp.work, lp.poisson = float(parts[1]), float(parts[2]), parts[3:] == ["poisson"]
    elif lp.kind != "busy":
        raise ValueError(f"no such loop kind: {spec!r}")
    return lp


class Crowd:
    def __init__(self, specs: list[str], seed: int) -> None:
        self.rng = random.Random(seed)
        policy = Policy(scheduler=SETTINGS)
        self.core = NodeCore(policy, inventory={GPU: GpuFacts(uuid=GPU, memory_total=80 << 30)})
        self.now = 0.0
        self.loops: dict[int, Loop] = {}
        for cid, spec in enumerate(specs, start=1):
            ident = ClientIdentity(pid=1000 + cid, uid=1000, gid=1000)
            self.feed(ev.ClientRegistered(cid, 1, ident, GPU, 80 << 30))
            lp = self.loops[cid] = parse(cid, spec)
            if lp.low:
                self.feed(ev.PriorityHint(cid, LOW))

    def feed(self, event: ev.Event) -> None:
        for a in self.core.handle(event, self.now):
            lp = self.loops.get(getattr(a, "client_id", -1))
            if isinstance(a, act.Grant) and lp is not None:
                self._granted(lp)
            elif isinstance(a, act.Drop) and lp is not None:
                lp.release_at = self.now + DRAIN_S
                if lp.done_at is not None:  # what it had not done yet it does when granted
                    lp.left, lp.done_at = max(lp.done_at - self.now, 1e-4), None

    def _granted(self, lp: Loop) -> None:
        lp.holds, lp.granted_at = True, self.now
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
        lp.holds, lp.release_at = False, None
        lp.held += self.now - lp.granted_at
        self.feed(ev.LockReleased(lp.cid, why))

    def idle_release(self, lp: Loop) -> None:
        """Nothing to do: its hook hands the GPU over after the idle window."""
        self.advance_to(self.now + SETTINGS.idle_handoff_s)
        if lp.holds and lp.release_at is None:
            self.release(lp, IDLE)

    def advance_to(self, t: float) -> None:
        while (d := self.core.next_deadline()) is not None and d <= t:
            self.now = max(self.now, d)
            self.feed(ev.Tick())
        self.now = t

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
                times += [lp.release_at, lp.done_at, lp.back_at, lp.next_request]
            self.advance_to(max(self.now, min(t for t in times if t is not None)))
            for lp in self.loops.values():
                self.step(lp)

    def step(self, lp: Loop) -> None:
        now = self.now
        if lp.release_at is not None and lp.release_at <= now:
            self.release(lp, ev.ReleaseReason.DROPPED)
            if lp.kind == "busy" or lp.left is not None:
                self.ask(lp)
        if lp.next_request is not None and lp.next_request <= now:
            lp.requests.append(now)
            gap = self.rng.expovariate(1 / lp.gap) if lp.poisson else lp.gap
            lp.next_request = now + gap
            if lp.done_at is None and lp.left is None:
                lp.left = lp.work
                self.ask(lp)
                if lp.holds and lp.release_at is None:
                    lp.done_at, lp.left = now + lp.work, None
        if lp.back_at is not None and lp.back_at <= now:
            lp.back_at, lp.left = None, lp.work
            self.ask(lp)
        if lp.done_at is not None and lp.done_at <= now and lp.holds:
            lp.done_at = None
            self.done(lp)

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


def report(crowd: Crowd) -> list[str]:
    return [
        f"{lp.spec:28} held {lp.held:6.1f} s  longest wait {max(lp.waits, default=0):6.3f} s"
        + (f"  p99 latency {p99(lp.latency) * 1e3:8.1f} ms" if lp.kind == "request" else "")
        for lp in crowd.loops.values()
    ]


def random_crowd(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(["busy", "busy", "pausing", "request"])
        if kind == "pausing":
            hi = rng.uniform(0.05, 1.0)
            kind = f"pausing:{rng.uniform(0.005, 0.05):.3f}:{rng.uniform(0.003, hi):.3f}:{hi:.3f}"
        elif kind == "request":
            poisson = ":poisson" if rng.random() < 0.5 else ""
            gap = rng.choice([0.02, 0.05, 0.2])
            kind = f"request:{gap}:{rng.uniform(0.005, 0.05):.3f}{poisson}"
        out.append(("low:" if rng.random() < 0.33 else "") + kind)
    return out


def judged(crowd: Crowd) -> list[str]:
    """What a user would not expect of this crowd (the module's docstring)."""
    loops = list(crowd.loops.values())
    top = [lp for lp in loops if not lp.low] or loops
    tq, n = SETTINGS.time_quantum_s, len(loops)
    out = []
    for lp in loops:
        bound = (n - 1) * tq if lp in top else SETTINGS.starvation_limit_s + n * tq
        if max(lp.waits, default=0.0) > bound + 0.1:
            out.append(f"{lp.spec} waited {max(lp.waits):.2f} s (bound {bound:.0f} s)")
    held = [lp.held for lp in top if lp.kind == "busy"]
    if len(held) > 1 and max(held) > 1.25 * min(held) + tq:
        out.append(f"busy loops of the top priority held {', '.join(f'{h:.1f}' for h in held)} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["case", "sweep"])
    ap.add_argument("loops", nargs="?", default="request:0.2:0.02:poisson,busy,busy")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--crowds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.what == "case":
        crowd = Crowd(args.loops.split(","), args.seed)
        crowd.run(args.seconds)
        print("\n".join(report(crowd)))
        return 0
    flagged = 0
    for seed in range(args.crowds):
        specs = random_crowd(random.Random(seed))
        crowd = Crowd(specs, seed)
        crowd.run(args.seconds)
        if found := judged(crowd):
            flagged += 1
            print(f"seed {seed}: {','.join(specs)}: " + "; ".join(found))
    print(f"{flagged} of {args.crowds} crowds flagged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
