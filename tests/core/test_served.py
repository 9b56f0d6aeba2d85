"""A low priority that borrows a higher one's idle GPU in many short slices is served, not
starved.

Found on the core's clock (`bench/crowd_model.py`), with the default settings (quantum and
starvation limit 30 s): an inference loop at high priority, a request every 50 ms, beside two
trainers that lowered themselves. The inference loop lends its GPU between requests and has it
kept for the next one (`reclaimAhead`), so each slice a trainer borrows is cut short, and a turn
cut short kept the trainer's place and its starvation clock. The first trainer in line had
every slice, the other none; after 30 s both counted as starved and each held a whole quantum
while the inference loop waited: 30 and 60 s, p99 89 s. Now what a gang holds in turns cut
short adds up, and once it is the slice any holder has (`scheduler.preemptAfter`) it counts as
a turn: its clock starts again and it goes behind the others (`PriorityRule.dropped`)."""

from __future__ import annotations

import pytest

from appliance.policy.model import SchedulerSettings

from .loops import Crowd, p99


@pytest.mark.parametrize(
    "trainers", [["low:busy"] * 2, ["low:busy"] * 3, ["low:busy", "low:pausing:0.03:0.02:0.08"]]
)
def test_trainers_beside_a_steady_inference_loop_share_its_idle_time_and_never_block_it(
    trainers: list[str],
) -> None:
    crowd = Crowd(["request:0.05:0.021", *trainers], seed=1, settings=SchedulerSettings())
    crowd.run(150.0)
    infer, *low = crowd.loops.values()
    # It waits at most the slice of a trainer granted before it first lent (`preemptAfter`,
    # 1 s), its requests' p99 their own 21 ms.
    assert max(infer.waits) <= 1.0
    assert p99(infer.latency) <= 0.025
    # The busy trainers share what it lends; a pausing one has some of it too.
    busy = [t.held for t in low if t.kind == "busy"]
    assert max(busy) <= 1.2 * min(busy)
    assert all(t.held > 1.0 for t in low)
