"""The real-time check as a pure function: which nodes a pod may go to, why, and what is logged."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from appliance.placement.demand import PodDemand, pod_demand
from appliance.placement.fit import Basis, NodeJudge, NodeView, check_mode, scores
from appliance.policy.model import (
    AnnotationPolicy,
    GpuMatch,
    GpuRule,
    Limits,
    Policy,
    RealtimeCheck,
    RealtimeCheckMode,
    Rule,
    RuleMatch,
)
from placement.test_status import T0, GiB, MiB, gpu, node

STRICT, WARNING, DISABLED = (
    RealtimeCheckMode.STRICT,
    RealtimeCheckMode.WARNING,
    RealtimeCheckMode.DISABLED,
)
POLICY = Policy(realtime_check=RealtimeCheck(mode=STRICT, max_sample_age_s=5.0))
FULL = NodeView("full", node(gpu(used=78 * GiB, processes=1)))  # 2 GiB free
ROOMY = NodeView("roomy", node(gpu(used=10 * GiB, processes=1)))  # 70 GiB free


def need(gib: float, *, gpus: int = 1) -> PodDemand:
    return PodDemand(
        pod="team/train",
        memory_bytes=int(gib * GiB),
        source="annotation nvshare.com/gpu-memory-limit",
        gpus=gpus,
        realtime_check=None,
    )


def judge(view: NodeView, demand: PodDemand, mode: RealtimeCheckMode = STRICT, **kw: Any) -> Any:
    return NodeJudge().judge(view, demand, mode=mode, policy=kw.get("policy", POLICY), now=T0 + 1)


def test_strict_filters_the_full_node_and_keeps_the_one_that_fits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="nvshare.extender"):
        full, roomy = judge(FULL, need(4)), judge(ROOMY, need(4))
    assert (full.keep, full.fits, full.basis) == (False, False, Basis.REALTIME)
    assert (roomy.keep, roomy.fits) == (True, True)
    assert "needs 4Gi per GPU" in full.reason and "1948MiB free beyond the 100Mi margin" in (
        full.reason
    )
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Real-time check failed node=full gpu=GPU-a pod=team/train")
    assert "requested=4096MiB used=79872MiB total=81920MiB" in line and "filtered out" in line


def test_the_safety_margin_counts() -> None:
    exactly = NodeView("edge", node(gpu(used=76 * GiB - 100 * MiB)))  # 4Gi + 100Mi free
    assert judge(exactly, need(4)).fits
    short = NodeView("edge", node(gpu(used=76 * GiB - 99 * MiB)))
    assert not judge(short, need(4)).fits


def test_warning_keeps_both_and_logs_what_it_would_have_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="nvshare.extender"):
        full, roomy = judge(FULL, need(4), WARNING), judge(ROOMY, need(4), WARNING)
    assert full.keep and not full.fits and roomy.keep and roomy.fits
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "mode=warning node kept" in record.getMessage()


def test_disabled_judges_nothing_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="nvshare.extender"):
        verdict = judge(FULL, need(400), DISABLED)
    assert verdict.keep and verdict.basis is Basis.NONE and not caplog.records


def test_a_pod_on_several_gpus_needs_that_many_gpus_with_room() -> None:
    two = NodeView("two", node(gpu("GPU-a", used=10 * GiB), gpu("GPU-b", used=78 * GiB)))
    assert judge(two, need(8, gpus=1)).fits
    assert not judge(two, need(8, gpus=2)).fits
    unhealthy = NodeView("sick", node(gpu(healthy=False)))
    assert not judge(unhealthy, need(1)).fits


@pytest.mark.parametrize(
    ("view", "error"),
    [
        (NodeView("quiet", node(at=T0 - 120)), "sampled 121s ago, beyond its 60s refresh"),
        (NodeView("bare", None, "no nvshare.com/gpu-status annotation"), "no nvshare.com/gpu"),
        (
            NodeView("broken", None, "nvshare.com/gpu-status: not JSON", node(gpu(used=0))),
            "not JSON",
        ),
        (NodeView("ahead", node(at=T0 + 60)), "in the future"),
    ],
    ids=["stale", "missing", "malformed", "future"],
)
def test_stale_missing_and_malformed_status_falls_back_with_the_log_line(
    view: NodeView, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="nvshare.extender"):
        verdict = judge(view, need(4))
    assert verdict.basis in (Basis.CACHED, Basis.NONE) and verdict.keep
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"Failed to get real-time usage, using cached data node={view.name} ")
    assert " gpu=" in line and error in line


def test_the_fallback_line_is_said_once_per_node_gpu_and_kind_until_it_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    judge_ = NodeJudge()
    stale = NodeView("quiet", node(at=T0 - 120))
    with caplog.at_level(logging.WARNING, logger="nvshare.extender"):
        for _ in range(3):
            judge_.judge(stale, need(1), mode=STRICT, policy=POLICY, now=T0)
        assert len(caplog.records) == 1
        judge_.judge(NodeView("quiet", node()), need(1), mode=STRICT, policy=POLICY, now=T0)
        judge_.judge(stale, need(1), mode=STRICT, policy=POLICY, now=T0)
    assert len(caplog.records) == 2


def test_the_fallback_judges_by_cached_and_declared_capacity_minus_bound_pods() -> None:
    cached = node(gpu(used=0))  # an 80 GiB GPU, use unknown now
    stale = node(gpu(used=0), at=T0 - 600)
    assert judge(NodeView("n", stale, None, cached, bound_bytes=70 * GiB), need(8)).fits
    crowded = judge(NodeView("n", stale, None, cached, bound_bytes=75 * GiB), need(8))
    assert (crowded.basis, crowded.fits, crowded.keep) == (Basis.CACHED, False, False)
    assert "pods bound there need 76800MiB" in crowded.reason
    declared_small = Policy(
        realtime_check=POLICY.realtime_check,
        gpus=(GpuRule(match=GpuMatch(model="NVIDIA H100*"), memory_bytes=16 * GiB),),
    )
    assert not judge(NodeView("n", stale, None, cached), need(20), policy=declared_small).fits


def test_nothing_known_keeps_the_node_even_in_strict_mode() -> None:
    verdict = judge(NodeView("new", None, "no nvshare.com/gpu-status annotation"), need(400))
    assert verdict.keep and verdict.basis is Basis.NONE


def test_scores_follow_the_real_room_for_the_pod() -> None:
    judged = [judge(v, need(4)) for v in (FULL, ROOMY, NodeView("half", node(gpu(used=40 * GiB))))]
    got = scores(judged)
    assert got["roomy"] == 10 and got["full"] == 0 and 0 < got["half"] < 10


@pytest.mark.parametrize(
    ("mode", "switch", "pod", "expected"),
    [
        (STRICT, None, None, STRICT),
        (WARNING, None, None, WARNING),
        (STRICT, False, None, DISABLED),  # --enable-realtime-check=false
        (None, True, None, STRICT),  # --enable-realtime-check=true, no mode set: HAMi's strict
        (WARNING, True, None, WARNING),
        (DISABLED, True, None, DISABLED),  # HAMI_REALTIME_CHECK_MODE=disabled: disabled
        (STRICT, None, False, DISABLED),  # the pod opts out
        (STRICT, False, True, STRICT),  # the pod opts in while the switch is off
        (None, None, True, STRICT),  # ... or while nothing turned the check on
        (DISABLED, None, True, DISABLED),  # but not into a mode set to disabled
    ],
)
def test_the_mode_comes_from_policy_switch_and_pod_with_hamis_meaning(
    mode: RealtimeCheckMode | None,
    switch: bool | None,
    pod: bool | None,
    expected: RealtimeCheckMode,
) -> None:
    check = RealtimeCheck() if mode is None else RealtimeCheck(mode=mode, mode_set=True)
    policy = Policy(realtime_check=check)
    assert check_mode(policy, switch=switch, pod_opt_in=pod) is expected


def test_a_pod_opts_in_where_the_policy_does_not_check_by_default() -> None:
    check = RealtimeCheck(mode=STRICT, mode_set=True, enabled_by_default=False, enabled_set=True)
    policy = Policy(realtime_check=check)
    assert check_mode(policy, switch=None, pod_opt_in=None) is DISABLED
    assert check_mode(policy, switch=None, pod_opt_in=True) is STRICT


# ---------------------------------------------------------------- what a pod needs


def pod(
    annotations: dict[str, str] | None = None,
    resources: dict[str, str] | None = None,
    *,
    namespace: str = "team",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "train",
            "namespace": namespace,
            "uid": "u1",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": resources or {}}}]},
    }


def test_the_annotation_sets_the_need_first() -> None:
    demand = pod_demand(
        pod({"nvshare.com/gpu-memory-limit": "6Gi"}, {"nvidia.com/gpumem": "1000"}), POLICY
    )
    assert demand.memory_bytes == 6 * GiB and "annotation" in demand.source


def test_hamis_gpumem_resource_is_mib_per_gpu_and_its_gpu_count_counts() -> None:
    demand = pod_demand(pod(resources={"nvidia.com/gpumem": "3000", "nvidia.com/gpu": "2"}), POLICY)
    assert demand.memory_bytes == 3000 * MiB and demand.gpus == 2
    assert demand.source == "resource nvidia.com/gpumem"


def test_the_policy_rule_for_the_pod_then_its_default() -> None:
    policy = Policy(
        defaults=Limits(memory_bytes=2 * GiB),
        rules=(
            Rule("research", RuleMatch(namespace="research"), Limits(memory_bytes=20 * GiB)),
            Rule("alice", RuleMatch(user="alice"), Limits(memory_bytes=1 * GiB)),  # a process
        ),
    )
    assert pod_demand(pod(namespace="research"), policy).memory_bytes == 20 * GiB
    assert pod_demand(pod(namespace="research"), policy).source == "policy rule 'research'"
    assert pod_demand(pod(namespace="other"), policy).memory_bytes == 2 * GiB
    nothing = pod_demand(pod(), Policy())
    assert nothing.memory_bytes is None and nothing.gpus == 1


def test_a_refused_annotation_falls_through_and_is_reported() -> None:
    capped = Policy(annotations=AnnotationPolicy(max_memory_bytes=8 * GiB))
    demand = pod_demand(pod({"nvshare.com/gpu-memory-limit": "40Gi"}), capped)
    assert demand.memory_bytes is None and "above the policy cap" in demand.problems[0]


@pytest.mark.parametrize("key", ["nvshare.com/realtime-check", "hami.io/enable-realtime-check"])
def test_either_annotation_opts_a_pod_in_or_out(key: str) -> None:
    assert pod_demand(pod({key: "false"}), POLICY).realtime_check is False
    assert pod_demand(pod({key: "true"}), POLICY).realtime_check is True
