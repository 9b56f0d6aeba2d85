"""Crowds of mixed loops on the core's own clock: who has the GPU when loops of several kinds
and priorities share it, for workloads the GPU benchmarks do not run.

No GPU and no daemon: the core (`appliance.core.node.NodeCore`) is fed the events the hooks of
such loops would send, on a fake clock, and answers as it does in the daemon (the loops:
`tests/core/loops.py`, `busy`, `pausing:WORK:LO:HI`, `request:GAP:WORK[:poisson]`, `low:` for a
loop that lowers itself, `g2:` before it for one on a second GPU). TQ 5 s unless `--tq`, the
other settings default.

    .venv/bin/python bench/crowd_model.py case 'request:0.2:0.02,busy,busy' [--seconds 120] [--tq 5]
    .venv/bin/python bench/crowd_model.py sweep [--crowds 60] [--seconds 120] [--serving] [--tq 5]
        [--most 5] [--two-gpus]

`case` prints each loop's seconds holding the GPU, its longest wait from asking to a grant (a
wait not over at the end counts as long as it has been) and its requests' p99 latency.
`sweep` runs seeded random crowds (2 to `--most` loops of random kinds, paces and priorities;
`--two-gpus`: one such crowd on each of two GPUs) and prints those where, on a GPU, two busy
loops of the top priority held more than a quarter apart (plus a quantum), a loop waited
longer than the others' quanta (top priority) or the starvation limit and everyone's quanta
(lower), a request loop above all the others, asking for less than 80 % of the GPU, waited
longer than `preemptAfter`, or a loop was told to drop as it was granted more than
`FLASHES` times (churn: each costs a drain). `--serving` lowers every loop but the request
loops.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the loops: tests/core/loops.py)

from appliance.policy.model import SchedulerSettings
from tests.core.loops import Crowd, Loop, p99


def report(crowd: Crowd) -> list[str]:
    return [
        f"{lp.spec:28} held {lp.held:6.1f} s  longest wait {max(lp.waits, default=0):6.3f} s"
        + (f"  p99 latency {p99(lp.latency) * 1e3:8.1f} ms" if lp.kind == "request" else "")
        + (f"  granted and dropped at once {lp.flashes}x" if lp.flashes else "")
        for lp in crowd.loops.values()
    ]


def random_crowd(rng: random.Random, serving: bool = False, most: int = 5) -> list[str]:
    """2-`most` loops of random kinds, paces and priorities; `serving`: every loop that does not
    serve requests lowers itself (inference above trainers)."""
    out = []
    for _ in range(rng.randint(2, most)):
        kind = rng.choice(["busy", "busy", "pausing", "request"])
        if kind == "pausing":
            hi = rng.uniform(0.05, 1.0)
            kind = f"pausing:{rng.uniform(0.005, 0.05):.3f}:{rng.uniform(0.003, hi):.3f}:{hi:.3f}"
        elif kind == "request":
            poisson = ":poisson" if rng.random() < 0.5 else ""
            gap = rng.choice([0.02, 0.05, 0.2])
            kind = f"request:{gap}:{rng.uniform(0.005, 0.05):.3f}{poisson}"
        low = not kind.startswith("request") if serving else rng.random() < 0.33
        out.append(("low:" if low else "") + kind)
    return out


FLASHES = 20  # grants told to drop at once that a crowd may see (churn beyond them)


def judged(crowd: Crowd) -> list[str]:
    """What a user would not expect of this crowd (the module's docstring), GPU by GPU."""
    out = []
    for gpu in sorted({lp.gpu for lp in crowd.loops.values()}):
        out += judged_gpu(crowd, [lp for lp in crowd.loops.values() if lp.gpu == gpu])
    return out


def judged_gpu(crowd: Crowd, loops: list[Loop]) -> list[str]:
    top = [lp for lp in loops if not lp.low] or loops
    settings = crowd.settings
    tq, n = settings.time_quantum_s, len(loops)
    out = []
    for lp in loops:
        bound = (n - 1) * tq if lp in top else settings.starvation_limit_s + n * tq
        if max(lp.waits, default=0.0) > bound + 0.1:
            out.append(f"{lp.spec} waited {max(lp.waits):.2f} s (bound {bound:.0f} s)")
    if churn := [lp for lp in loops if lp.flashes > FLASHES]:
        out += [f"{lp.spec} granted and dropped at once {lp.flashes}x" for lp in churn]
    held = [lp.held for lp in top if lp.kind == "busy"]
    if len(held) > 1 and max(held) > 1.25 * min(held) + tq:
        out.append(f"busy loops of the top priority held {', '.join(f'{h:.1f}' for h in held)} s")
    lone = top[0] if len(top) == 1 < n else None
    if lone is not None and lone.kind == "request" and lone.work < 0.8 * lone.gap:
        # above everyone, asking for less than 80 % of the GPU: lower ones never starve
        if max(lone.waits, default=0.0) > settings.preempt_after_s + 0.05:
            out.append(f"{lone.spec}, above everyone, waited {max(lone.waits):.2f} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["case", "sweep"])
    ap.add_argument("loops", nargs="?", default="request:0.2:0.02:poisson,busy,busy")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--crowds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tq", type=float, default=5.0, help="scheduler.timeQuantum, seconds")
    ap.add_argument("--serving", action="store_true", help="sweep: request loops above the rest")
    ap.add_argument("--most", type=int, default=5, help="sweep: at most this many loops a crowd")
    ap.add_argument("--two-gpus", action="store_true", help="sweep: a crowd on each of two GPUs")
    args = ap.parse_args()
    settings = SchedulerSettings(time_quantum_s=args.tq)
    if args.what == "case":
        crowd = Crowd(args.loops.split(","), args.seed, settings)
        crowd.run(args.seconds)
        print("\n".join(report(crowd)))
        return 0
    flagged = flashes = 0
    for seed in range(args.crowds):
        rng = random.Random(seed)
        specs = random_crowd(rng, args.serving, args.most)
        if args.two_gpus:
            specs += [f"g2:{spec}" for spec in random_crowd(rng, args.serving, args.most)]
        crowd = Crowd(specs, seed, settings)
        crowd.run(args.seconds)
        flashes += sum(lp.flashes for lp in crowd.loops.values())
        if found := judged(crowd):
            flagged += 1
            print(f"seed {seed}: {','.join(specs)}: " + "; ".join(found))
    print(f"{flagged} of {args.crowds} crowds flagged; {flashes} grants dropped at once in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
