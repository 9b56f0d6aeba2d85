"""Who waits past the starvation limit, and what is granted then, with many equals.

Found on the core's clock (`bench/crowd_model.py`, with each wait not over at the end of a run
counted): whenever the loops of one priority each wait past the starvation limit for their
turns (three or more at the default settings, where the quantum is the limit, 30 s; seven or
more at a quantum of 5 s), each of them is starved at every grant, and

- the starved were granted a priority's before another's, so the starved equals above a low
  priority were always ahead of it: a trainer that lowered itself beside two busy loops held
  1 s of 900 (22 of 60 random crowds at the defaults left a lower loop waiting to the end);
- a loop granted as starved kept its whole quantum (`full_quantum`) against the equal that lent
  it a pause, so a data-loader loop lost its quantum at its first pause (0.2 s of 900);
- what an equal lent went to the first starved waiter, never round (`Line._borrower`): the busy
  loop behind a data loader held up to twice each other busy loop's time.

Now the starved go first by how long they have waited, whatever their priority; an equal takes
back the quantum it lent from a starved borrower too, and is granted ahead of its starved
equals (the quantum is its own); lent time goes round the starved waiters as well."""

from __future__ import annotations

import pytest

from appliance.core import events as ev
from appliance.policy.model import SchedulerSettings

from .loops import Crowd
from .test_priority import LOW, by_uid, grants

DEFAULTS = SchedulerSettings()  # quantum 30 s, starvation limit 30 s


def test_the_starved_go_first_by_how_long_they_have_waited_whatever_their_priority() -> None:
    h = by_uid({1: LOW, 2: 0}, SchedulerSettings(time_quantum_s=60.0, starvation_limit_s=30.0))
    holder, low, equal = h.register(uid=2), h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(holder, 1))
    h.feed(ev.LockRequested(low, 1))
    h.advance(5.0)
    h.feed(ev.LockRequested(equal, 1))
    h.advance(35.0)  # both have waited past the limit; the low one 5 s longer
    gpu = h.state.clients[holder].gpu
    assert h.queued(gpu) == [low, equal]
    g_low, g_equal = (h.state.gangs[h.state.clients[c].gang] for c in (low, equal))
    assert h.core.lock.priorities.line([g_equal, g_low], h.now) == [g_low, g_equal]
    assert grants(h.feed(ev.LockReleased(holder, ev.ReleaseReason.EXIT))) == [low]


def run(
    specs: list[str], settings: SchedulerSettings, seconds: float, seed: int = 1, check: bool = True
) -> Crowd:
    """The loops run for `seconds`, the core's indexes checked after every event (`check`)."""
    crowd = Crowd(specs, seed, settings, check)
    crowd.run(seconds)
    return crowd


@pytest.mark.parametrize(
    ("specs", "settings"),
    [
        (["low:busy", "busy", "busy"], DEFAULTS),
        (["low:busy", "busy", "busy", "busy"], DEFAULTS),
        (["low:busy"] + ["busy"] * 7, SchedulerSettings(time_quantum_s=5.0)),
    ],
)
def test_a_low_priority_among_starved_equals_above_it_waits_the_limit_and_a_quantum(
    specs: list[str], settings: SchedulerSettings
) -> None:
    crowd = run(specs, settings, 600.0)
    low, *others = crowd.loops.values()
    tq, limit = settings.time_quantum_s, settings.starvation_limit_s
    # Starved after the limit, it is granted when the quantum it waits behind is over.
    assert max(low.waits) <= limit + 2 * tq + 0.1
    # ... and then holds a whole quantum: a turn a round, as the equals above it do.
    assert low.held >= 0.5 * min(lp.held for lp in others)


def test_a_pausing_loop_among_equals_has_its_quanta_at_the_default_settings() -> None:
    crowd = run(["busy", "pausing:0.026:0.2:0.5", "busy"], DEFAULTS, 600.0, seed=3)
    _, pausing, _ = crowd.loops.values()
    # In its five turns it works 26 ms per 0.2-0.5 s pause: about a second a turn.
    assert pausing.held >= 3.0
    assert max(max(lp.waits) for lp in crowd.loops.values()) <= 2 * 30.0 + 0.5


@pytest.mark.parametrize(
    "specs",
    [
        ["busy", "pausing:0.026:0.2:0.5", "busy"],
        ["pausing:0.014:0.066:0.959", "low:pausing:0.043:0.119:0.290", "busy", "busy", "busy"],
        ["pausing:0.012:0.246:0.269", "pausing:0.022:0.422:0.575", "busy", "busy", "busy"],
    ],
)
def test_what_a_loader_lends_goes_round_starved_equals(specs: list[str]) -> None:
    crowd = run(specs, DEFAULTS, 450.0, seed=27)
    busy = [lp.held for lp in crowd.loops.values() if lp.spec == "busy"]
    # A quantum apart at most (the run ends inside someone's), where the loop behind the
    # loader held 1.5-2 times another's.
    assert max(busy) - min(busy) <= 30.0 + 0.05 * min(busy)


def test_lending_slivers_and_taking_them_back_gains_a_loop_nothing() -> None:
    # A hostile loop that lends after every 20 ms step and asks again 6-7 ms later (just past
    # the idle window): what it takes back is what is left of its own quantum, so it holds no
    # more than a busy loop.
    crowd = run(["pausing:0.02:0.006:0.007", "busy", "busy"], DEFAULTS, 900.0, check=False)
    sly, *busy = crowd.loops.values()
    assert sly.held <= min(lp.held for lp in busy)
    assert max(lp.held for lp in busy) <= 1.1 * min(lp.held for lp in busy)


@pytest.mark.parametrize("busy", [1, 2])
def test_a_low_priority_data_loader_keeps_the_quantum_it_was_granted_as_starved(busy: int) -> None:
    # A trainer that lowered itself, fed by a data loader, beside busy trainers: granted after
    # the starvation limit, it lent its GPU at its first pause and lost the rest of its
    # quantum (0.7-1 s of 900), or was granted with nothing left of a quantum it lent long
    # before and dropped at once. What it lends inside a quantum granted as starved it takes
    # back now, and what it lends goes round the busy ones.
    crowd = run(["low:pausing:0.043:0.119:0.290"] + ["busy"] * busy, DEFAULTS, 900.0)
    low, *others = crowd.loops.values()
    assert low.held >= 30.0
    assert max(low.waits) <= 30.0 * (busy + 1) + 0.5
    held = [lp.held for lp in others]
    assert max(held) <= 1.1 * min(held)


def test_what_starved_lower_loops_lend_goes_to_the_higher_priority_not_to_another_starved() -> None:
    # Three loops that lowered themselves beside one at normal priority, at the defaults: the
    # starved low ones lend their pauses and idle time; the busy low one, starved too, took all
    # of it (502 s of 900 against the normal loop's 240).
    crowd = run(
        ["low:busy", "low:pausing:0.029:0.062:0.453", "low:request:0.2:0.025:poisson", "busy"],
        DEFAULTS,
        900.0,
        seed=23,
    )
    low_busy, *_, normal = crowd.loops.values()
    assert normal.held >= 2 * low_busy.held
    # Each low one still waits no longer than the other lows' quanta and the normal one's.
    assert all(max(lp.waits) <= 3 * 30.0 + 0.5 for lp in crowd.loops.values())


def test_a_starved_low_loop_lending_slivers_gains_nothing_over_a_busy_one() -> None:
    # What a quantum granted as starved lends it takes back from any priority: a low loop that
    # lends after every 20 ms step and asks again 6-7 ms later (just past the idle window)
    # holds no more than a busy low loop would (a quantum each time it has waited the limit),
    # and the normal one no less.
    sly = run(["low:pausing:0.02:0.006:0.007", "busy"], DEFAULTS, 900.0, check=False)
    plain = run(["low:busy", "busy"], DEFAULTS, 900.0)
    (sly_low, sly_normal), (plain_low, plain_normal) = sly.loops.values(), plain.loops.values()
    assert sly_low.held <= plain_low.held
    assert sly_normal.held >= plain_normal.held
    assert max(sly_low.waits) <= 30.0 + 30.0 + 0.5


@pytest.mark.parametrize(("tq", "seconds", "most"), [(5.0, 120.0, 20), (30.0, 900.0, 200)])
def test_no_two_borrowers_are_granted_and_dropped_in_turn(
    tq: float, seconds: float, most: int
) -> None:
    # A loop that lowered itself, granted as starved, lends its pauses and asks them back;
    # the equals that borrowed what two others lent on from it were granted and told to drop
    # in turn every 2 ms while it waited (1,692 times in 120 s; 20,512 in 900 s): nobody
    # borrows a GPU a lender takes back now.
    specs = ["pausing:0.045:0.275:0.396", "low:pausing:0.019:0.090:0.131", "busy", "busy"]
    crowd = run(
        [*specs, "pausing:0.008:0.226:0.261"],
        SchedulerSettings(time_quantum_s=tq),
        seconds,
        seed=50,
        check=tq == 5.0,
    )
    assert max(lp.flashes for lp in crowd.loops.values()) <= most


def test_a_lender_first_in_its_bucket_hides_no_starved_equal_on_another_gpu() -> None:
    # Two GPUs: four equals on one, a crowd with a starved low loop and request loops on the
    # other. A lender taking its GPU back is given out ahead of its starved equals; with the
    # first ticket of its bucket it ended the walk of their starved part, and a loop on the
    # first GPU was granted again after its own quantum, ahead of the equal that had waited
    # three quanta (120 s where 90 are due).
    specs = ["busy"] * 4 + ["g2:busy", "g2:low:busy", "g2:busy"]
    specs += ["g2:request:0.2:0.021", "g2:request:0.2:0.035:poisson"]
    crowd = run(specs, DEFAULTS, 600.0, seed=30)
    first = [lp for lp in crowd.loops.values() if lp.spec == "busy"]
    assert max(lp.longest_off for lp in first) <= 3 * 30.0 + 0.5
    assert max(lp.held for lp in first) - min(lp.held for lp in first) <= 0.5


def test_a_lender_taking_back_on_another_gpu_hides_none_on_this_one() -> None:
    # Two GPUs. On the second, a low loop holds a quantum granted as starved while an equal of
    # the first GPU's loops asked back what it lent inside its quantum (it waits: the GPU is
    # the low loop's). On the first, a pausing loop lends and asks back. The line gave out
    # only the earliest lender taking back of the whole class, the second GPU's: the first
    # GPU's lender was not first there, so a busy equal was granted and dropped for it, then
    # the other busy equal, in turn every 2 ms (1,372 times in 120 s) while it waited 5.5 s.
    specs = ["pausing:0.012:0.246:0.269", "pausing:0.022:0.422:0.575", "busy", "busy", "busy"]
    specs += ["g2:low:busy", "g2:low:busy", "g2:busy", "g2:pausing:0.015:0.617:0.849"]
    crowd = run(specs, SchedulerSettings(time_quantum_s=5.0), 120.0, seed=41, check=True)
    assert max(lp.flashes for lp in crowd.loops.values()) <= 2


def test_a_lender_taking_back_a_starved_quantum_goes_ahead_of_the_starved() -> None:
    # A request loop was granted as starved (a quantum of its own against any priority) and
    # lends between requests. As it asks back, a low loop that had waited longer was starved
    # too; the starved were read before the lender (an equal's first part), so the low loop
    # was granted, then dropped at once for the lender (`lent_back`), 134 times in 120 s.
    specs = ["low:busy", "request:0.2:0.020", "request:0.02:0.041:poisson", "low:busy"]
    crowd = run(specs, DEFAULTS, 120.0, seed=47)
    assert max(lp.flashes for lp in crowd.loops.values()) <= 2
    bound = DEFAULTS.starvation_limit_s + len(specs) * DEFAULTS.time_quantum_s
    assert max(max(lp.waits) for lp in crowd.loops.values()) <= bound


@pytest.mark.parametrize(
    "first_gpu", [["low:busy", "busy", "busy"], ["low:busy", "request:0.05:0.034", "busy"]]
)
def test_the_starved_of_a_gpu_are_ordered_by_their_own_waits_not_another_gpus(
    first_gpu: list[str],
) -> None:
    # Three loops on the first GPU, a low one among them, starved after a quantum's wait (the
    # defaults: 30 s each) and so granted every other turn with its equals'. On the second GPU
    # five loops, two of them low, waiting longer. The starved were ordered by the longest
    # waiting of their class on any GPU: the second GPU's low loops put the first GPU's low
    # loop ahead of the equals that had waited longer there (one waited 90 s: three quanta).
    second_gpu = ["g2:low:busy", "g2:busy", "g2:busy", "g2:low:busy", "g2:busy"]
    crowd = run(first_gpu + second_gpu, DEFAULTS, 300.0)
    first = [lp for lp in crowd.loops.values() if not lp.spec.startswith("g2:")]
    assert max(max(lp.waits) for lp in first) <= 2 * DEFAULTS.time_quantum_s + 0.1
