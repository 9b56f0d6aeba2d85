"""Identity from the kernel only, and nothing a client says taken on faith: claimed pod names,
pods the watch has not listed yet (a restart), usage reports, GPU sizes, GPU entries, and the
limits published for hooks that cannot register."""

from __future__ import annotations

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import MEMORY_LIMIT, PodInfo
from appliance.core.node import NodeCore
from appliance.core.published import PublishedLimits
from appliance.core.state import NodeState
from appliance.policy.model import (
    GpuMatch,
    GpuRule,
    Limits,
    MemorySettings,
    Mode,
    Policy,
    Rule,
    RuleMatch,
    SchedulerSettings,
    TrustSettings,
)

from .conftest import GPU, GiB, Harness, MiB, of

A_UID, B_UID = "aaaaaaaa-0000-0000-0000-000000000001", "bbbbbbbb-0000-0000-0000-000000000002"
POD_A = PodInfo(A_UID, "team", "small", "node-1", annotations={MEMORY_LIMIT: "1Gi"})
POD_B = PodInfo(B_UID, "team", "big", "node-1", annotations={MEMORY_LIMIT: "40Gi"})


def make(policy: Policy | None = None, **kw: object) -> Harness:
    chunked = policy or Policy(memory=MemorySettings(chunk_bytes=2 * MiB))
    return Harness(NodeCore(chunked, watching_pods=True, **kw))  # type: ignore[arg-type]


def granted(h: Harness, cid: int, n: int, used: int = 0) -> int:
    [reply] = of(h.feed(ev.MemoryReserveRequested(cid, 3, n, used)), act.MemoryGranted, cid)
    return int(reply.granted)


def ledger_of(state: NodeState, cid: int) -> str:
    return state.subject(state.clients[cid])


# ------------------------------------------------------------------ claimed pod names


def test_a_host_process_claiming_a_pod_is_not_that_pod_by_default() -> None:
    h = make()
    h.feed(ev.PodSeen(POD_B))
    host = h.register(uid=1001, claimed_namespace="team", claimed_pod="big")
    assert h.enforced(host).memory_bytes is None  # not team/big's 40Gi
    assert ledger_of(h.state, host) == f"pid:{h.state.clients[host].ident.pid}"
    assert h.core.status(h.now).clients[0].pod == "-"


def test_a_claim_counts_where_the_policy_trusts_that_uid_and_the_cgroup_shows_no_pod() -> None:
    trusting = Policy(
        memory=MemorySettings(chunk_bytes=2 * MiB),
        trust=TrustSettings(pod_claim_uids=frozenset({1001})),
    )
    h = make(trusting)
    h.feed(ev.PodSeen(POD_B))
    trusted = h.register(uid=1001, claimed_namespace="team", claimed_pod="big")
    other = h.register(uid=1002, claimed_namespace="team", claimed_pod="big")
    assert h.enforced(trusted).memory_bytes == 40 * GiB
    assert h.core.status(h.now).clients[0].pod == "team/big (claimed)"
    assert h.enforced(other).memory_bytes is None
    unread = h.register(uid=1001, claimed_namespace="team", claimed_pod="big", cgroup_known=False)
    assert h.enforced(unread).memory_bytes is None  # where it runs is unknown: no claim


def test_a_process_in_one_pod_claiming_another_is_its_own_pod() -> None:
    trusting = Policy(trust=TrustSettings(pod_claim_uids=frozenset({0})))
    h = make(trusting)
    h.feed(ev.PodSeen(POD_A))
    h.feed(ev.PodSeen(POD_B))
    thief = h.register(uid=0, pod_uid=A_UID, claimed_namespace="team", claimed_pod="big")
    assert h.enforced(thief).memory_bytes == GiB
    assert ledger_of(h.state, thief) == f"pod:{A_UID}"


# ------------------------------------------------------------------ pods the watch has not shown


def test_a_cgroup_naming_a_pod_the_watch_has_not_shown_is_its_uid_until_it_does() -> None:
    # A cgroup named like the kubelet's proves nothing until the pod watch knows the pod: until
    # then no annotation, no pod ledger and no pod gang key applies (the drill:
    # tests/abuse/test_identity.py).
    per_user = Rule(name="per-user", match=RuleMatch(uid=1001), limits=Limits(memory_bytes=GiB))
    h = make(Policy(memory=MemorySettings(chunk_bytes=2 * MiB), rules=(per_user,)))
    ghost = h.register(pid=10, uid=1001, pod_uid=B_UID, listed=False)
    second = h.register(pid=11, uid=1001, pod_uid=B_UID, listed=False)
    assert h.enforced(ghost).memory_bytes == GiB  # its uid's rule, not team/big's 40Gi
    assert ledger_of(h.state, ghost) == "pid:10"
    assert granted(h, ghost, 900 * MiB) == 900 * MiB
    assert granted(h, second, 900 * MiB) == 900 * MiB  # two ledgers, not one of the pod's
    h.feed(ev.LockRequested(ghost, 1))
    assert h.state.clients[ghost].job == "pid:10"  # no pod gang key either
    assert h.core.status(h.now).clients[0].pod == "-"
    out = h.feed(ev.PodSeen(POD_B))  # the watch shows it on this node: now it is the pod
    assert [x.limits.memory_bytes for x in of(out, act.LimitsChanged, ghost)] == [40 * GiB]
    assert ledger_of(h.state, ghost) == ledger_of(h.state, second) == f"pod:{B_UID}"
    assert [x.processes for x in of(out, act.PeersChanged, ghost)] == [2]


# ------------------------------------------------------------------ after a restart


def test_a_pod_not_listed_yet_waits_under_its_uid_with_its_last_published_limit() -> None:
    h = make(remembered={A_UID: GiB, B_UID: 40 * GiB})
    a = h.register(pid=10, pod_uid=A_UID, listed=False)
    b = h.register(pod_uid=B_UID, listed=False)
    assert h.enforced(a).memory_bytes == GiB
    assert ledger_of(h.state, a) == "pid:10"  # its own until the watch shows the pod
    assert granted(h, a, 2 * GiB) == 0  # not B's budget, not the GPU's
    assert granted(h, b, 30 * GiB) == 30 * GiB
    out = h.feed(ev.PodSeen(POD_A))  # the watch lists it: the API's word from now on
    assert not of(out, act.LimitsChanged, a)  # the same 1Gi
    annotated = PodInfo(A_UID, "team", "small", "node-1", annotations={MEMORY_LIMIT: "2Gi"})
    out = h.feed(ev.PodSeen(annotated))
    assert [x.limits.memory_bytes for x in of(out, act.LimitsChanged, a)] == [2 * GiB]


def test_a_full_list_forgets_remembered_pods_that_are_gone() -> None:
    h = make(remembered={A_UID: GiB, B_UID: 40 * GiB})
    out = h.feed(ev.PodsListed(frozenset({A_UID})))
    [published] = of(out, act.LimitsPublished)
    assert published.limits.pods == {A_UID: GiB}


# ------------------------------------------------------------------ usage reports


def test_a_usage_report_counts_no_further_than_the_client_may_hold() -> None:
    h = make()
    h.feed(ev.PodSeen(POD_A))
    liar = h.register(pod_uid=A_UID)
    h.feed(ev.MemoryReturned(liar, 0, 1 << 62))
    assert h.state.clients[liar].used == GiB  # its pod's limit, not 2^62
    assert h.state.counters["usage_reports_capped"] == 1
    honest = h.register(pod_uid=A_UID)
    h.feed(ev.MemoryReturned(honest, 0, 0))
    assert granted(h, honest, 2 * MiB) == 0  # the liar crowds only its own pod


def test_a_reconnected_hooks_usage_counts_up_to_its_limit() -> None:
    h = make()
    h.feed(ev.PodSeen(POD_A))
    back = h.register(pod_uid=A_UID)
    h.feed(ev.MemoryReturned(back, 0, 512 * MiB))  # holds what the previous daemon granted
    assert h.state.clients[back].used == 512 * MiB


# ------------------------------------------------------------------ GPU facts


def test_without_nvml_a_gpus_size_is_not_the_hooks_word() -> None:
    h = make(Policy(scheduler=SchedulerSettings(mode=Mode.AUTO)))
    a = h.register(total=4 * MiB, nvml=False)  # a hook claiming a tiny GPU
    assert h.state.gpus[GPU].facts.memory_total == 0
    assert granted(h, a, 8 * GiB) == 8 * GiB  # nothing refused for a size nobody knows
    b = h.register(total=4 * MiB, nvml=False)
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 1))
    assert h.state.gpus[GPU].holders == {a}  # auto serialises on an unknown size


def test_a_declared_size_or_trusted_hooks_set_it() -> None:
    declared = Policy(gpus=(GpuRule(match=GpuMatch(), memory_bytes=8 * GiB),))
    h = make(declared)
    h.register(total=4 * MiB, nvml=False)
    assert h.state.gpu_memory(GPU) == 8 * GiB
    trusting = make(Policy(trust=TrustSettings(hook_gpu_size=True)))
    trusting.register(total=12 * GiB, nvml=False)
    assert trusting.state.gpu_memory(GPU) == 12 * GiB


def test_a_gpu_nobody_uses_is_forgotten_unless_nvml_lists_it() -> None:
    h = make()
    ghosts = [h.register(gpu=f"GPU-{n:08d}", nvml=False) for n in range(50)]
    listed = h.register()
    for cid in [*ghosts, listed]:
        h.feed(ev.ClientGone(cid))
    assert list(h.state.gpus) == [GPU]


# ------------------------------------------------------------------ published limits


def test_published_limits_follow_pods_and_policy_and_change_only_when_they_change() -> None:
    h = make(Policy(defaults=Limits(memory_bytes=GiB, core_percent=100)))
    assert h.sent[-1] == act.LimitsPublished(PublishedLimits(default=GiB, pods={}))
    out = h.feed(ev.PodSeen(POD_B))
    [published] = of(out, act.LimitsPublished)
    assert published.limits == PublishedLimits(default=GiB, pods={B_UID: 40 * GiB})
    assert not of(h.feed(ev.PodSeen(POD_B)), act.LimitsPublished)  # nothing changed
    out = h.feed(ev.PodRemoved(POD_B.ref))
    assert of(out, act.LimitsPublished)[0].limits.pods == {}


def test_where_the_policy_limits_anyone_the_published_default_is_never_no_limit() -> None:
    # a 1 GiB rule per user and no default: a program kept from registering used to get none
    per_user = Rule(name="per-user", match=RuleMatch(uid=1001), limits=Limits(memory_bytes=GiB))
    roomy = Rule(name="trainers", match=RuleMatch(user="ml"), limits=Limits(memory_bytes=8 * GiB))
    h = make(Policy(rules=(roomy, per_user)))
    assert h.sent[-1] == act.LimitsPublished(PublishedLimits(default=GiB, pods={}))
    h = make(Policy(defaults=Limits(memory_bytes=512 * MiB), rules=(roomy,)))
    assert h.sent[-1] == act.LimitsPublished(PublishedLimits(default=512 * MiB, pods={}))
    assert make(Policy()).sent[-1] == act.LimitsPublished(PublishedLimits(default=None, pods={}))
