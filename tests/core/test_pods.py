"""Pods in the core: annotations judged where every other decision is made, warnings for the
pod's user, a policy reload that judges every pod again, and the device plugin's replicas."""

from __future__ import annotations

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import MEMORY_LIMIT, PodInfo
from appliance.core.node import ANNOTATION_WARNING
from appliance.policy.model import AnnotationPolicy, DevicePluginSettings, Limits, Policy

from .conftest import ADMIN, GiB, Harness


def pod(memory: str) -> ev.PodSeen:
    return ev.PodSeen(PodInfo("u1", "ml", "trainer", "node-1", annotations={MEMORY_LIMIT: memory}))


def test_a_bad_annotation_keeps_the_previous_limit_and_warns_on_the_pod(harness: Harness) -> None:
    harness.feed(pod("2Gi"))
    a = harness.register(pod_uid="u1")
    out = harness.feed(pod("lots"))
    [warning] = [w for w in out if isinstance(w, act.PodWarning)]
    assert warning.reason == ANNOTATION_WARNING and str(warning.pod) == "ml/trainer"
    assert "kept previous override 2Gi" in warning.message
    assert harness.enforced(a).memory_bytes == 2 * GiB
    assert not [x for x in out if isinstance(x, act.LimitsChanged)]  # nothing to tell the hook


def test_a_policy_that_lowers_the_cap_judges_every_pod_again(harness: Harness) -> None:
    harness.feed(pod("8Gi"))
    a = harness.register(pod_uid="u1")
    capped = Policy(annotations=AnnotationPolicy(max_memory_bytes=4 * GiB))
    out = harness.feed(ev.PolicyChanged(capped))
    assert [w.message for w in out if isinstance(w, act.PodWarning)] == [
        "pod ml/trainer: annotation nvshare.com/gpu-memory-limit='8Gi' ignored: 8Gi is above "
        "the policy cap annotations.maxMemory=4Gi; kept the policy value"
    ]
    assert [
        (x.client_id, x.limits.memory_bytes) for x in out if isinstance(x, act.LimitsChanged)
    ] == [(a, None)]


def test_the_device_plugin_hears_of_a_new_replica_count_only(harness: Harness) -> None:
    same = harness.feed(ev.PolicyChanged(Policy(defaults=Limits(core_percent=50))))
    assert not [x for x in same if isinstance(x, act.ReplicasChanged)]
    out = harness.feed(ev.PolicyChanged(Policy(device_plugin=DevicePluginSettings(4))))
    assert [x for x in out if isinstance(x, act.ReplicasChanged)] == [act.ReplicasChanged(4)]


def test_a_limit_request_that_names_nobody_is_refused(harness: Harness) -> None:
    [answer] = harness.feed(ev.AdminLimitSet(None, Limits(memory_bytes=GiB), reply_to=ADMIN))
    assert isinstance(answer, act.Reply) and answer.outcome is act.Outcome.INVALID
    assert answer.message == "name a --pid, or a --pod as NAMESPACE/NAME; nothing changed"
