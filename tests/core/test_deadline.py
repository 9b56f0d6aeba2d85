"""The lock's next deadline is kept where it changes (`yielding.Yields`, `line.Line.moved`):
after every event of a long, mixed, seeded run it equals one worked out afresh.

The harness (`conftest.Harness`) compares the two after each event of every core test; this
run reaches the paths those scripted tests pass quickly: events that schedule nothing arriving
after a window turned or a share changed, gangs forming over two GPUs, clients leaving while
they hold, priorities and shares changing under holders, the clock jumping past deadlines.
"""

from __future__ import annotations

import random

from appliance.core import events as ev
from appliance.core.node import NodeCore
from appliance.policy.model import Limits, Policy, Rule, RuleMatch, SchedulerSettings

from .conftest import GPU, Harness

GPU2 = "GPU-00000000-0000-0000-0000-000000000002"
SETTINGS = SchedulerSettings(time_quantum_s=0.3, preempt_after_s=0.05, starvation_limit_s=1.0)
RULES = (  # uid 1001 asks for a share, 1002 has a quota, 1003 both
    Rule(name="share", match=RuleMatch(uid=1001), limits=Limits(core_request=30)),
    Rule(name="quota", match=RuleMatch(uid=1002), limits=Limits(core_percent=40)),
    Rule(name="both", match=RuleMatch(uid=1003), limits=Limits(core_percent=60, core_request=20)),
)
REASONS = list(ev.ReleaseReason)


def drive(seed: int, steps: int) -> Harness:
    rnd = random.Random(seed)
    h = Harness(NodeCore(Policy(scheduler=SETTINGS, rules=RULES)))
    live: list[int] = []
    seq = 10
    for _ in range(steps):
        roll = rnd.random()
        if roll < 0.08 or len(live) < 3:
            gpu = rnd.choice((GPU, GPU2))
            live.append(h.register(uid=rnd.choice((1000, 1001, 1002, 1003)), gpu=gpu))
            if rnd.random() < 0.3:  # two processes of one job, on two GPUs
                h.feed(ev.GangHint(live[-1], "job"))
            continue
        cid = rnd.choice(live)
        seq += 1
        if roll < 0.45:
            h.feed(ev.LockRequested(cid, seq))
        elif roll < 0.75:
            h.feed(ev.LockReleased(cid, rnd.choice(REASONS)))
        elif roll < 0.8:
            h.feed(ev.ClientGone(cid))
            live.remove(cid)
        elif roll < 0.86:
            h.feed(ev.PriorityHint(cid, rnd.choice((-2, 0, 2))))
        elif roll < 0.9:
            h.now += rnd.uniform(0.0, 2.5)  # a window turns; the next event schedules nothing
            h.feed(ev.GangHint(cid, "late"))
        else:
            h.advance(rnd.uniform(0.0, 0.4))  # the deadlines fire as they come
        h.now += rnd.uniform(0.0, 0.02)
    return h


def test_the_kept_deadline_equals_one_worked_out_afresh_after_every_event() -> None:
    for seed in range(6):
        h = drive(seed, 300)
        assert h.state.counters["grants"] > 15, "the run hands the GPUs over"
