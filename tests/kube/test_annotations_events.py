"""Refused annotations are reported on the pod as Warning Events, deduplicated, never raising."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakeapi import FakeApiServer
from kubernetes import client

from appliance.core.annotations import MEMORY_LIMIT, PodRef, resolve_overrides
from appliance.kube.recorder import EventRecorder
from appliance.policy.model import AnnotationPolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def recorder(
    service_account_client: Callable[[str], client.ApiClient], clock: FakeClock
) -> Iterator[EventRecorder]:
    """Writes with the node daemon's service account: deploy/'s RBAC must allow what it does."""
    api = service_account_client("nvshare-node")
    rec = EventRecorder(api, node_name="gpu-node-1", window_s=60.0, clock=clock)
    yield rec
    rec.close()


def pod_ref(fake_api: FakeApiServer, name: str) -> PodRef:
    meta = fake_api.add_pod(name, node="gpu-node-1")["metadata"]
    return PodRef(uid=meta["uid"], namespace=meta["namespace"], name=name)


def events(fake_api: FakeApiServer) -> list[dict[str, Any]]:
    items, _ = fake_api.store.list("events", "default")
    return items


def test_a_refused_annotation_becomes_a_warning_event_on_the_pod(
    fake_api: FakeApiServer, recorder: EventRecorder
) -> None:
    pod = pod_ref(fake_api, "trainer")
    _, problems = resolve_overrides(
        {MEMORY_LIMIT: "99Gi"},
        pod=pod,
        policy=AnnotationPolicy(max_memory_bytes=8 << 30),
        previous=None,
    )
    for p in problems:
        recorder.warn(p.pod, "InvalidAnnotation", str(p))
    assert recorder.flush()
    [event] = events(fake_api)
    assert event["type"] == "Warning" and event["reason"] == "InvalidAnnotation"
    assert event["involvedObject"]["uid"] == pod.uid
    assert (event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("Pod", "trainer")
    assert "99Gi" in event["message"] and "8Gi" in event["message"]
    assert event["source"] == {"component": "nvshare-scheduler", "host": "gpu-node-1"}
    assert event["count"] == 1


def test_repeats_within_the_window_bump_the_count(
    fake_api: FakeApiServer, recorder: EventRecorder, clock: FakeClock
) -> None:
    pod = pod_ref(fake_api, "p")
    for _ in range(3):
        recorder.warn(pod, "InvalidAnnotation", "same")
    recorder.warn(pod, "InvalidAnnotation", "different")
    assert recorder.flush()
    by_message = {e["message"]: e["count"] for e in events(fake_api)}
    assert by_message == {"same": 3, "different": 1}

    clock.now += 61  # past the window: a fresh Event
    recorder.warn(pod, "InvalidAnnotation", "same")
    assert recorder.flush()
    assert sorted(e["count"] for e in events(fake_api) if e["message"] == "same") == [1, 3]


def test_an_unreachable_api_server_is_logged_not_raised(
    fake_api: FakeApiServer,
    recorder: EventRecorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pod = pod_ref(fake_api, "p")
    fake_api.stop()
    with caplog.at_level(logging.WARNING, logger="appliance.kube.recorder"):
        recorder.warn(pod, "InvalidAnnotation", "lost")
        assert recorder.flush(timeout=60)
    assert any(
        "could not record event InvalidAnnotation on pod default/p" in r.getMessage()
        for r in caplog.records
    )
    fake_api.start()
    recorder.warn(pod, "InvalidAnnotation", "delivered")
    assert recorder.flush()
    assert [e["message"] for e in events(fake_api)] == ["delivered"]


def test_an_event_deleted_meanwhile_is_created_again(
    fake_api: FakeApiServer, recorder: EventRecorder
) -> None:
    pod = pod_ref(fake_api, "p")
    recorder.warn(pod, "InvalidAnnotation", "m")
    assert recorder.flush()
    fake_api.delete("events", events(fake_api)[0]["metadata"]["name"], namespace="default")
    recorder.warn(pod, "InvalidAnnotation", "m")
    assert recorder.flush()
    assert [e["count"] for e in events(fake_api)] == [1]
