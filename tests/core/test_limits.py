"""Limit resolution order and provenance."""

from __future__ import annotations

from appliance.core.annotations import PodInfo, PodOverrides
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.limits import resolve_limits
from appliance.policy.model import GpuMatch, GpuRule, Limits, Mode, Policy, Rule, RuleMatch

GiB = 1 << 30
GPU = GpuFacts(uuid="GPU-1", index=0, model="NVIDIA H100 80GB HBM3", memory_total=80 * GiB)
IDENT = ClientIdentity(
    pid=5,
    uid=1000,
    gid=1000,
    user="ana",
    groups=frozenset({"ml"}),
    executable="/usr/bin/python3.11",
)


def test_rules_apply_in_order_and_say_where_they_came_from() -> None:
    policy = Policy(
        defaults=Limits(memory_bytes=8 * GiB, core_percent=100),
        rules=(
            Rule(
                "ml-group",
                RuleMatch(group="ml"),
                Limits(memory_bytes=16 * GiB),
                source="10-ws.yaml#/rules/0",
            ),
            Rule("python", RuleMatch(executable="*/python3*"), Limits(core_percent=50)),
            Rule("other-user", RuleMatch(user="bob"), Limits(memory_bytes=1 * GiB)),
            Rule("ops", RuleMatch(user="ana"), Limits(), mode=Mode.OFF),
        ),
    )
    r = resolve_limits(policy=policy, ident=IDENT, gpu=GPU)
    assert (r.memory_bytes, r.core_percent, r.exempt) == (16 * GiB, 50, True)
    assert r.sources.memory == "rule 'ml-group' (10-ws.yaml#/rules/0)"


def test_pod_rules_annotation_and_caps() -> None:
    policy = Policy(
        rules=(
            Rule(
                "team-a",
                RuleMatch(namespace="team-a", pod_labels={"tier": "batch"}),
                Limits(memory_bytes=2 * GiB),
            ),
        )
    )
    pod = PodInfo(uid="u", namespace="team-a", name="job-1", node="n", labels={"tier": "batch"})
    r = resolve_limits(policy=policy, ident=IDENT, gpu=GPU, pod=pod)
    assert r.memory_bytes == 2 * GiB
    r = resolve_limits(
        policy=policy, ident=IDENT, gpu=GPU, pod=pod, annotations=PodOverrides(memory_bytes=6 * GiB)
    )
    assert r.memory_bytes == 6 * GiB and r.sources.memory == "annotation"
    other = PodInfo(uid="v", namespace="team-b", name="x", node="n", labels={"tier": "batch"})
    assert resolve_limits(policy=policy, ident=IDENT, gpu=GPU, pod=other).memory_bytes is None


def test_declared_gpu_size_limits_unlimited_clients() -> None:
    policy = Policy(gpus=(GpuRule(GpuMatch(model="*H100*"), memory_bytes=10 * GiB),))
    r = resolve_limits(policy=policy, ident=IDENT, gpu=GPU)
    assert r.memory_bytes == 10 * GiB
