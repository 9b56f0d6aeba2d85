"""Annotation rules: what a pod may ask for, and what is kept when it asks wrongly."""

from __future__ import annotations

from appliance.core.annotations import (
    CORE_LIMIT,
    CORE_REQUEST,
    HAMI_REALTIME_CHECK,
    MEMORY_LIMIT,
    PRIORITY,
    REALTIME_CHECK,
    PodOverrides,
    PodRef,
    resolve_overrides,
)
from appliance.policy.model import AnnotationPolicy

POD = PodRef(uid="u-1", namespace="team-a", name="trainer-0")
OPEN = AnnotationPolicy()
GiB = 1 << 30
MiB = 1 << 20


def resolve(
    annotations: dict[str, str],
    *,
    policy: AnnotationPolicy = OPEN,
    previous: PodOverrides | None = None,
) -> tuple[PodOverrides, list[str], list[str]]:
    overrides, problems = resolve_overrides(annotations, pod=POD, policy=policy, previous=previous)
    return overrides, [str(p) for p in problems], [p.kept for p in problems]


def test_no_annotations_means_no_overrides() -> None:
    assert resolve({"unrelated": "x"})[0] == PodOverrides()


def test_quantities_and_a_bare_number_in_mib() -> None:
    assert resolve({MEMORY_LIMIT: "4Gi"})[0].memory_bytes == 4 * GiB
    assert resolve({MEMORY_LIMIT: "1500"})[0].memory_bytes == 1500 * MiB
    assert resolve({MEMORY_LIMIT: "2G"})[0].memory_bytes == 2 * 10**9


def test_core_limit_and_realtime_check() -> None:
    got, problems, _ = resolve({CORE_LIMIT: "40", REALTIME_CHECK: "false"})
    assert (got.core_percent, got.realtime_check, problems) == (40, False, [])


def test_hami_realtime_annotation_is_honoured_and_ours_wins() -> None:
    assert resolve({HAMI_REALTIME_CHECK: "true"})[0].realtime_check is True
    both = {HAMI_REALTIME_CHECK: "true", REALTIME_CHECK: "false"}
    assert resolve(both)[0].realtime_check is False


def test_invalid_memory_keeps_previous_and_says_where_and_what() -> None:
    previous = PodOverrides(memory_bytes=2 * GiB, core_percent=50)
    got, problems, kept = resolve({MEMORY_LIMIT: "lots", CORE_LIMIT: "30"}, previous=previous)
    assert got == PodOverrides(memory_bytes=2 * GiB, core_percent=30)
    assert len(problems) == 1
    assert "team-a/trainer-0" in problems[0] and MEMORY_LIMIT in problems[0]
    assert "'lots'" in problems[0]
    assert kept == ["previous override 2Gi"]


def test_invalid_value_without_previous_falls_back_to_policy() -> None:
    got, problems, kept = resolve({CORE_LIMIT: "half"})
    assert got.core_percent is None
    assert kept == ["the policy value"]
    assert "not a whole number" in problems[0]


def test_out_of_range_core_limits_are_refused() -> None:
    for bad in ("0", "101", "-5", "50.5"):
        got, problems, _ = resolve({CORE_LIMIT: bad}, previous=PodOverrides(core_percent=20))
        assert got.core_percent == 20, bad
        assert len(problems) == 1, bad


def test_policy_caps_memory_and_core_range() -> None:
    policy = AnnotationPolicy(max_memory_bytes=8 * GiB, min_core_percent=10, max_core_percent=60)
    got, problems, _ = resolve({MEMORY_LIMIT: "16Gi", CORE_LIMIT: "80"}, policy=policy)
    assert (got.memory_bytes, got.core_percent) == (None, None)
    assert "above the policy cap" in problems[0] and "8Gi" in problems[0]
    assert "outside the policy range 10-60" in problems[1]
    assert resolve({MEMORY_LIMIT: "8Gi", CORE_LIMIT: "60"}, policy=policy)[0] == PodOverrides(
        memory_bytes=8 * GiB, core_percent=60
    )


def test_previous_value_beyond_a_tightened_cap_is_not_kept() -> None:
    policy = AnnotationPolicy(max_memory_bytes=4 * GiB)
    previous = PodOverrides(memory_bytes=6 * GiB)
    got, _, kept = resolve({MEMORY_LIMIT: "12Gi"}, policy=policy, previous=previous)
    assert got.memory_bytes is None
    assert kept == ["the policy value"]


def test_annotations_disallowed_by_policy() -> None:
    policy = AnnotationPolicy(allowed=False)
    got, problems, _ = resolve(
        {MEMORY_LIMIT: "1Gi", CORE_LIMIT: "10", REALTIME_CHECK: "true"},
        policy=policy,
        previous=PodOverrides(memory_bytes=GiB),
    )
    assert got == PodOverrides()
    assert len(problems) == 3
    assert all("annotations.allowed is false" in p for p in problems)


def test_removing_an_annotation_restores_the_policy_value() -> None:
    previous, _, _ = resolve({MEMORY_LIMIT: "1Gi", CORE_LIMIT: "25"})
    got, problems, _ = resolve({CORE_LIMIT: "25"}, previous=previous)
    assert got == PodOverrides(memory_bytes=None, core_percent=25)
    assert problems == []


def test_zero_memory_and_bad_boolean_are_refused() -> None:
    got, problems, _ = resolve(
        {MEMORY_LIMIT: "0", REALTIME_CHECK: "maybe"},
        previous=PodOverrides(realtime_check=True),
    )
    assert got == PodOverrides(memory_bytes=None, realtime_check=True)
    assert len(problems) == 2


def test_by_default_a_pod_may_not_ask_for_high_priority_or_more_than_half_the_gpu() -> None:
    # a high pod lent and took back; a 100 % request starved everyone else (issue 24)
    overrides, problems, _ = resolve({PRIORITY: "high", CORE_REQUEST: "100"})
    assert overrides.priority is None and overrides.core_request is None
    assert any("low to normal" in p for p in problems), problems
    assert any("annotations.maxCoreRequest=50" in p for p in problems), problems
    overrides, problems, _ = resolve({PRIORITY: "low", CORE_REQUEST: "50"})
    assert (overrides.priority, overrides.core_request, problems) == (-100, 50, [])
    trusting = AnnotationPolicy(max_priority=100, max_core_request=100)
    assert resolve({PRIORITY: "high"}, policy=trusting)[0].priority == 100


def test_disabled_annotations_refuse_every_key_and_drop_previous_overrides() -> None:
    asked = {
        MEMORY_LIMIT: "4Gi",
        CORE_LIMIT: "40",
        HAMI_REALTIME_CHECK: "true",
        PRIORITY: "low",
        CORE_REQUEST: "10",
    }
    previous = PodOverrides(
        memory_bytes=GiB, core_percent=50, realtime_check=True, priority=-100, core_request=5
    )
    closed = AnnotationPolicy(allowed=False)
    got, problems, kept = resolve(asked, policy=closed, previous=previous)
    assert got == PodOverrides()
    assert kept == ["the policy value"] * 5
    assert [p.split(" ignored: ")[0] for p in problems] == [
        f"pod team-a/trainer-0: annotation {key}={value!r}" for key, value in asked.items()
    ]
    disabled = "annotations are disabled by policy (annotations.allowed is false)"
    assert all(p.endswith(f"ignored: {disabled}; kept the policy value") for p in problems)
