"""Gang locks: a job's clients on several GPUs hold all of them together or none; a drop asks
the whole gang and stops it at one cut of its collectives; quanta and quotas count per gang."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.node import NodeCore
from appliance.core.state import GangPhase, Phase
from appliance.policy.model import Limits, Policy, Rule, RuleMatch, SchedulerSettings

from .conftest import Harness, of
from .test_views import scrape, value

GPU0 = "GPU-00000000-0000-0000-0000-0000000000a0"
GPU1 = "GPU-00000000-0000-0000-0000-0000000000a1"
GPU2 = "GPU-00000000-0000-0000-0000-0000000000a2"
TQ = 5.0
DEADLINE = 2.0


def harness(**settings: float) -> Harness:
    scheduler = SchedulerSettings(
        time_quantum_s=TQ,
        drop_deadline_s=DEADLINE,
        **settings,  # type: ignore[arg-type]
    )
    return Harness(NodeCore(Policy(scheduler=scheduler)))


def job(h: Harness, pod: str, gpus: tuple[str, ...] = (GPU0, GPU1)) -> list[int]:
    """One process per GPU of one pod (torchrun's ranks), each with a context on its GPU, as
    NVML shows it."""
    ranks = [h.register(pod_uid=pod, gpu=gpu) for gpu in gpus]
    shown(h, *ranks)
    return ranks


def shown(h: Harness, *clients: int) -> None:
    """NVML shows these clients' processes on their GPUs (`gang.touched`)."""
    processes: dict[str, dict[int, int]] = {}
    for cid in clients:
        c = h.state.clients[cid]
        processes.setdefault(c.gpu, {})[c.ident.pid] = 1 << 20
    h.feed(ev.GpuFreeMemory(samples={}, processes=processes))


def ask(h: Harness, *clients: int) -> list[act.Action]:
    out: list[act.Action] = []
    for c in clients:
        out += h.feed(ev.LockRequested(c, 1))
    return out


def stop(h: Harness, members: list[int], positions: list[int]) -> list[act.Action]:
    """The members of a dropped gang answer where they stand; returns what the daemon says."""
    out: list[act.Action] = []
    for m, n in zip(members, positions, strict=True):
        [drop] = of(h.sent, act.GangDrop, m)[-1:]
        out += h.feed(ev.GangPosition(m, drop.cut_id, n))
    return out


def a_told_to_drop(h: Harness) -> tuple[list[int], list[int]]:
    """Gang a holds both GPUs, b waits for them, and a's quantum ends: a is told to drop."""
    a, b = job(h, "a"), job(h, "b")
    ask(h, *a)
    ask(h, *b)
    h.advance(TQ)
    return a, b


def release(h: Harness, *clients: int) -> list[act.Action]:
    out: list[act.Action] = []
    for c in clients:
        out += h.feed(ev.LockReleased(c, ev.ReleaseReason.DROPPED))
    return out


def granted(actions: list[act.Action]) -> set[int]:
    return {g.client_id for g in of(actions, act.Grant)}


def test_a_gang_holds_all_its_gpus_and_alternates_with_another_gang() -> None:
    h = harness()
    a, b = job(h, "a"), job(h, "b")
    assert granted(ask(h, a[0])) == {a[0]}  # alone, rank 0 is a lone client
    assert granted(ask(h, a[1])) == {a[1]}  # rank 1 makes it a gang: GPU 1 is free
    assert granted(ask(h, *b)) == set()  # B waits for both, holding neither
    assert h.state.gangs["pod:b"].phase is GangPhase.WAITING
    assert h.state.gpus[GPU0].holders == {a[0]} and h.state.gpus[GPU1].holders == {a[1]}
    out = h.advance(TQ)
    assert {d.client_id for d in of(out, act.GangDrop)} == set(a)  # the whole gang, at once
    assert of(out, act.Drop) == []
    cut = stop(h, a, [40, 41])
    assert {(c.client_id, c.collectives) for c in of(cut, act.GangCut)} == {(a[0], 41), (a[1], 41)}
    assert granted(release(h, a[0])) == set()  # nothing moves while a member still drains
    out = release(h, a[1])
    assert granted(out) == set(b)
    assert {o.client_id for o in of(out, act.GangCutOver)} == set(a)
    ask(h, *a)
    assert {d.client_id for d in of(h.advance(TQ), act.GangDrop)} == set(b)  # B's quantum


def test_a_member_behind_the_cut_gets_its_gpu_back_to_reach_it() -> None:
    h = harness()
    a, b = a_told_to_drop(h)
    stop(h, a, [9, 8])  # rank 1 was stopped one collective before rank 0
    assert granted(release(h, a[1])) == set()  # it released at 8; rank 0 waits for it
    out = h.feed(ev.LockRequested(a[1], 5, catch_up=True))
    assert [(g.client_id, g.seq) for g in of(out, act.Grant)] == [(a[1], 5)]
    assert h.state.clients[a[1]].phase is Phase.DRAINING
    release(h, a[1])  # it reached the cut
    assert granted(release(h, a[0])) == set(b)


def test_a_catch_up_is_an_ordinary_request_once_the_gang_has_released() -> None:
    h = harness()
    a, _ = a_told_to_drop(h)
    stop(h, a, [3, 3])
    release(h, *a)
    assert granted(h.feed(ev.LockRequested(a[1], 6, catch_up=True))) == set()
    assert h.state.clients[a[1]].phase is Phase.WAITING


def test_a_gang_waits_for_single_gpu_clients_and_nobody_skips_ahead_of_it() -> None:
    h = harness()
    g = job(h, "g")
    ask(h, *g)
    release(h, *g)  # a turn as a gang, then idle
    single = h.register(gpu=GPU1)
    assert granted(ask(h, single)) == {single}
    assert granted(ask(h, *g)) == set()  # GPU 0 is free but GPU 1 is not: it takes neither
    assert h.state.gangs["pod:g"].held == set()
    late = h.register(gpu=GPU0)
    assert granted(ask(h, late)) == set()  # GPU 0 stays for the gang that came first
    assert h.queued(GPU0) == [g[0], late]
    out = h.advance(TQ)
    assert of(out, act.Drop, single)  # the single client's quantum, for the gang
    assert granted(release(h, single)) == set(g)
    assert h.state.gpus[GPU0].holders == {g[0]}


def test_a_job_starting_keeps_the_gpu_its_first_rank_got_while_it_waits_for_the_next() -> None:
    """Rank 0 asked before rank 1 made the job a gang: it keeps GPU 0 (its collectives may
    already wait for rank 1), the holder of GPU 1 is asked to drop at once rather than at the
    end of its quantum, and the gang is next on GPU 1."""
    h = harness()
    single = h.register(gpu=GPU1)
    ask(h, single)
    g = job(h, "g")
    assert granted(ask(h, g[0])) == {g[0]}
    out = ask(h, g[1])
    assert granted(out) == set() and of(out, act.Drop, single)
    assert h.state.clients[single].usage.drops["gang"] == 1
    late = h.register(gpu=GPU1)
    ask(h, late)
    assert granted(release(h, single)) == {g[1]}  # before `late`, who came after the gang
    assert h.state.gangs["pod:g"].held == {GPU0, GPU1}


def test_two_jobs_each_started_on_the_others_second_gpu_untangle_without_a_deadline() -> None:
    """Job A's rank 0 got GPU 0 and job B's rank 1 got GPU 1, each alone, before their other
    ranks asked: each job holds what the other needs. The younger drops at once; its rank
    that never had its GPU catches up to the cut beside the holder, and both jobs then run
    whole, one after the other."""
    h = harness()
    a, b = job(h, "a"), job(h, "b")
    ask(h, a[0], b[1])
    ask(h, a[1])
    out = ask(h, b[0])
    assert {d.client_id for d in of(out, act.GangDrop)} == set(b)  # B is the younger gang
    assert of(out, act.GangDrop, a[0]) == []
    cut = stop(h, [b[1], b[0]], [1, 0])  # rank 1's first collective waits for rank 0's
    assert {c.collectives for c in of(cut, act.GangCut)} == {1}
    out = h.feed(ev.LockRequested(b[0], 2, catch_up=True))
    assert granted(out) == {b[0]}  # beside A's rank 0, until it reaches the cut
    assert granted(release(h, b[1])) == set()
    assert granted(release(h, b[0])) == {a[1]}
    assert h.state.gangs["pod:a"].held == {GPU0, GPU1}
    assert h.state.gangs["pod:b"].gpus == {GPU0, GPU1}  # what both its ranks asked for
    assert granted(ask(h, *b)) == set()
    assert {d.client_id for d in of(h.advance(TQ), act.GangDrop)} == set(a)
    assert h.state.counters["drops_overdue"] == 0


def test_single_gpu_clients_beside_a_gang_keep_their_own_turns() -> None:
    h = harness()
    g = job(h, "g")
    x, y = h.register(gpu=GPU2), h.register(gpu=GPU2)
    ask(h, *g)
    assert granted(ask(h, x)) == {x}
    assert granted(ask(h, y)) == set()
    assert of(h.advance(TQ), act.Drop, x)  # on GPU 2, one lone client after another
    assert granted(h.feed(ev.LockReleased(x, ev.ReleaseReason.DROPPED))) == {y}
    assert h.state.gangs["pod:g"].phase is GangPhase.HOLDING  # nobody waits for its GPUs


def test_processes_of_a_pod_on_one_gpu_stay_lone_clients() -> None:
    h = harness()
    a, b = h.register(pod_uid="p", gpu=GPU0), h.register(pod_uid="p", gpu=GPU0)
    assert granted(ask(h, a)) == {a}
    assert granted(ask(h, b)) == set()  # serialised, as before gangs
    assert h.state.clients[a].gang != h.state.clients[b].gang


def test_a_member_dying_frees_the_gpu_only_it_used() -> None:
    h = harness()
    g = job(h, "g")
    ask(h, *g)
    single = h.register(gpu=GPU1)
    ask(h, single)
    out = h.feed(ev.ClientGone(g[1]))
    assert granted(out) == {single}
    gang = h.state.gangs["pod:g"]
    assert gang.held == {GPU0} and gang.phase is GangPhase.HOLDING


def dropped_with_one_answer(h: Harness, collectives: int) -> tuple[list[int], list[int]]:
    """Gang a holds both GPUs, b waits; a's quantum ends and only a's rank 0 says where it
    stands."""
    a, b = a_told_to_drop(h)
    [drop] = of(h.sent, act.GangDrop, a[0])
    h.feed(ev.GangPosition(a[0], drop.cut_id, collectives))
    return a, b


def test_a_member_dying_during_the_cut_leaves_the_rest_to_finish() -> None:
    h = harness()
    a, b = dropped_with_one_answer(h, 4)
    out = h.feed(ev.ClientGone(a[1]))  # it never answered
    assert [(c.client_id, c.collectives) for c in of(out, act.GangCut)] == [(a[0], 4)]
    assert granted(release(h, a[0])) == set(b)


def test_a_member_joining_late_runs_with_the_gang() -> None:
    h = harness()
    g = job(h, "g")
    ask(h, *g)
    third = h.register(pod_uid="g", gpu=GPU0)  # another process of the pod
    assert granted(ask(h, third)) == {third}
    assert h.state.clients[third].gang == "pod:g"
    assert h.state.gpus[GPU0].holders == {g[0], third}


def test_a_member_asking_for_a_new_gpu_waits_for_it_keeping_what_it_holds() -> None:
    h = harness()
    g = job(h, "g")
    ask(h, *g)
    other = h.register(gpu=GPU2)
    ask(h, other)
    new = h.register(pod_uid="g", gpu=GPU2)
    shown(h, new)
    assert granted(ask(h, new)) == set()
    assert h.state.gangs["pod:g"].held == {GPU0, GPU1}
    assert of(h.sent, act.Drop, other)  # at once: the gang may be waiting for `new`
    assert granted(h.feed(ev.LockReleased(other, ev.ReleaseReason.DROPPED))) == {new}
    assert h.state.gangs["pod:g"].held == {GPU0, GPU1, GPU2}


def test_a_member_nvml_does_not_show_on_its_gpu_takes_it_at_the_holders_quantum() -> None:
    # Issue 24 item 4: one process, a second hook connection on a GPU it never made a context
    # on, used to make its gang hold part of its GPUs and drop the GPU's holder at once.
    h = harness()
    (holder,) = job(h, "g", (GPU0,))
    ask(h, holder)
    victim = h.register(gpu=GPU1)
    shown(h, victim)
    ask(h, victim)
    h.advance(1.0)
    claim = h.register(pod_uid="g", gpu=GPU1)  # no context there: NVML does not show it
    assert granted(ask(h, claim)) == set()
    assert h.state.gangs["pod:g"].held == {GPU0}
    assert not of(h.sent, act.Drop, victim)  # not at once
    assert not of(h.advance(TQ - 1.0 - 0.01), act.Drop, victim)
    assert of(h.advance(0.02), act.Drop, victim)  # at the end of its quantum, as for anyone
    assert granted(h.feed(ev.LockReleased(victim, ev.ReleaseReason.DROPPED))) == {claim}
    shown(h, claim)  # it does use the GPU after all: from now on a member like any other
    assert h.state.gangs["pod:g"].held == {GPU0, GPU1}


def test_the_gang_keeps_the_gpus_its_members_asked_for_in_its_last_turn() -> None:
    h = harness()
    g = job(h, "g")
    ask(h, *g)
    release(h, *g)  # (an idle release)
    ask(h, g[0])  # only rank 0 asked during that turn
    assert h.state.gangs["pod:g"].held == {GPU0, GPU1}
    release(h, g[0])
    assert h.state.gangs["pod:g"].gpus == {GPU0}
    single = h.register(gpu=GPU1)
    assert granted(ask(h, single)) == {single}
    assert granted(ask(h, g[0])) == {g[0]}  # the gang no longer waits for GPU 1


def test_a_gang_member_passed_over_marks_the_gang() -> None:
    h = harness()
    a, b = a_told_to_drop(h)
    stop(h, a, [1, 1])
    release(h, a[0])
    out = h.advance(DEADLINE)  # rank 1 never releases
    assert granted(out) == set(b)
    assert h.state.clients[a[1]].phase is Phase.OVERDUE
    assert h.state.gangs["pod:a"].offender


def test_the_cut_is_forced_at_the_deadline_when_a_member_never_answers() -> None:
    h = harness()
    a, b = dropped_with_one_answer(h, 2)
    out = h.advance(DEADLINE)
    assert {c.client_id for c in of(out, act.GangCut)} == set(a)
    assert granted(out) == set(b)


def test_quota_counts_per_gang() -> None:
    settings = SchedulerSettings(time_quantum_s=TQ, compute_window_s=1.0)
    rule = Rule(name="half", match=RuleMatch(), limits=Limits(core_percent=50))
    h = Harness(NodeCore(Policy(scheduler=settings, rules=(rule,))))
    g = job(h, "g")
    ask(h, *g)
    assert h.state.gangs["pod:g"].quota is not None
    assert of(h.advance(0.49), act.GangDrop) == []
    drops = of(h.advance(0.02), act.GangDrop)
    assert {d.client_id for d in drops} == set(g)  # one budget of 0.5 s for both, not one each


def test_outside_pods_a_users_processes_naming_one_job_form_a_gang() -> None:
    h = harness()
    r0, r1 = h.register(gpu=GPU0, uid=1000), h.register(gpu=GPU1, uid=1000)
    stranger = h.register(gpu=GPU1, uid=2000)
    for c in (r0, r1, stranger):
        h.feed(ev.GangHint(c, "torch/none@127.0.0.1:29500"))
    ask(h, r0, r1, stranger)
    assert (
        h.state.clients[r0].gang
        == h.state.clients[r1].gang
        == "uid:1000:torch/none@127.0.0.1:29500"
    )
    assert h.state.clients[stranger].gang != h.state.clients[r0].gang


def test_without_a_hint_one_process_on_two_gpus_is_a_gang() -> None:
    h = harness()
    on0, on1 = h.register(pid=42, gpu=GPU0), h.register(pid=42, gpu=GPU1)
    other = h.register(pid=43, gpu=GPU1)
    ask(h, other)
    assert granted(ask(h, on0)) == {on0}  # a lone client until it asks for a second GPU
    assert granted(ask(h, on1)) == set()  # now a gang: it waits for GPU 1, keeping GPU 0
    assert h.state.clients[on0].gang == "pid:42"


def test_status_and_metrics_name_each_clients_gang() -> None:
    h = harness()
    g, single = job(h, "g"), h.register(gpu=GPU1)
    ask(h, g[0], single, g[1])  # the gang's second rank has the single client dropped at once
    rows = {c.id: c for c in h.core.status(h.now).clients}
    assert (rows[g[0]].gang, rows[g[1]].gang, rows[single].gang) == ("pod:g", "pod:g", "")
    text = scrape(h)
    gang_of = {
        s.labels["client_id"]: s.labels["gang"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "nvshare_client_gang_info"
    }
    assert gang_of == {str(g[0]): "pod:g", str(g[1]): "pod:g"}
    assert value(text, "nvshare_scheduler_drops_total", reason="gang") == 1
