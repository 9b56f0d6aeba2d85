"""The pod watcher against the fake API server: list, watch, 410 diffs, restarts, silence."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
from fakeapi import FakeApiServer
from kubernetes import client

from appliance.core.annotations import PodInfo, PodRef
from appliance.kube.api import api_client_from_env
from appliance.kube.pod_watch import PodWatcher

LIVENESS_S = 20.0  # how long a test waits for something that should happen at once


class Recorder:
    """Collects callbacks in order; tests wait on conditions over what was seen."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, PodInfo | PodRef]] = []
        self._cond = threading.Condition()

    def on_pod(self, info: PodInfo) -> None:
        with self._cond:
            self.seen.append(("pod", info))
            self._cond.notify_all()

    def on_pod_deleted(self, ref: PodRef) -> None:
        with self._cond:
            self.seen.append(("deleted", ref))
            self._cond.notify_all()

    def wait_for(self, what: str, pred: Callable[[list[tuple[str, object]]], bool]) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: pred(list(self.seen)), timeout=LIVENESS_S)
        assert ok, f"never saw {what}; saw {self.seen}"

    def names(self) -> list[tuple[str, str]]:
        with self._cond:
            return [(kind, x.name) for kind, x in self.seen]

    def clear(self) -> None:
        with self._cond:
            self.seen.clear()


def saw(kind: str, name: str, annotations: dict[str, str] | None = None) -> Callable[..., bool]:
    def pred(seen: list[tuple[str, object]]) -> bool:
        for k, x in seen:
            if k == kind and getattr(x, "name", None) == name:
                if annotations is None or getattr(x, "annotations", None) == annotations:
                    return True
        return False

    return pred


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def start_watcher(
    service_account_client: Callable[[str], client.ApiClient], recorder: Recorder
) -> Iterator[Callable[..., PodWatcher]]:
    """Watchers with the node daemon's token: deploy/'s RBAC must allow what they do."""
    made: list[PodWatcher] = []

    def start(**kwargs: object) -> PodWatcher:
        api = service_account_client("nvshare-node")
        options: dict[str, object] = {"backoff": (0.05, 0.2)} | kwargs
        watcher = PodWatcher(
            api_client=api,
            node_name="n1",
            on_pod=recorder.on_pod,
            on_pod_deleted=recorder.on_pod_deleted,
            **options,  # type: ignore[arg-type]
        )
        made.append(watcher)
        watcher.start()
        assert watcher.synced.wait(LIVENESS_S), "the first list never completed"
        return watcher

    yield start
    for watcher in made:
        watcher.stop()


def wait_until(
    pred: Callable[[], bool], what: str, *, poke: Callable[[], None] = lambda: None
) -> None:
    """Wait for `pred`, calling `poke` between looks (for things that may need a nudge)."""
    pause = threading.Event()
    for _ in range(int(LIVENESS_S / 0.01)):
        if pred():
            return
        poke()
        pause.wait(0.01)
    raise AssertionError(f"never happened: {what}")


def test_list_then_watch_delivers_adds_modifies_deletes_for_this_node_only(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("mine", node="n1", annotations={"nvshare.com/gpu-core-limit": "50"})
    fake_api.add_pod("theirs", node="n2")
    watcher = start_watcher()
    assert recorder.names() == [("pod", "mine")]
    first = recorder.seen[0][1]
    assert isinstance(first, PodInfo)
    assert (first.namespace, first.node) == ("default", "n1")
    assert first.annotations == {"nvshare.com/gpu-core-limit": "50"}

    fake_api.add_pod("new", node="n1", labels={"app": "x"})
    fake_api.set_pod_annotations("mine", {"nvshare.com/gpu-core-limit": "20"})
    fake_api.set_pod_annotations("theirs", {"ignored": "yes"})
    fake_api.add_pod("theirs-too", node="n2")
    fake_api.delete("pods", "new", namespace="default")
    fake_api.add_pod("last", node="n1")
    recorder.wait_for("the last pod", saw("pod", "last"))
    assert recorder.names() == [
        ("pod", "mine"),
        ("pod", "new"),
        ("pod", "mine"),
        ("deleted", "new"),
        ("pod", "last"),
    ]
    assert recorder.seen[2][1].annotations == {"nvshare.com/gpu-core-limit": "20"}  # type: ignore[union-attr]
    assert set(watcher.pods()) == {
        fake_api.get("pods", n, namespace="default")["metadata"]["uid"] for n in ("mine", "last")
    }
    watch_queries = [q for m, p, q in fake_api.requests if q.get("watch") == "true"]
    assert watch_queries and all(
        q["fieldSelector"] == "spec.nodeName=n1" and q["allowWatchBookmarks"] == "true"
        for q in watch_queries
    )


def test_status_only_updates_are_not_passed_on(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("p", node="n1")
    start_watcher()

    def set_phase(pod: dict[str, object]) -> dict[str, object]:
        return {**pod, "status": {"phase": "Succeeded"}}

    fake_api.update("pods", "p", set_phase, namespace="default")
    fake_api.add_pod("marker", node="n1")
    recorder.wait_for("the marker pod", saw("pod", "marker"))
    assert recorder.names() == [("pod", "p"), ("pod", "marker")]


def test_bookmarks_advance_the_tracked_version(
    fake_api: FakeApiServer, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("p", node="n1")
    watcher = start_watcher()
    listed = int(watcher.resource_version)
    fake_api.add_pod("elsewhere", node="n2")  # invisible to this watch
    target = fake_api.resource_version
    assert target > listed
    # A bookmark asked for before the watch is open is not owed to it, so ask until one lands.
    wait_until(
        lambda: int(watcher.resource_version) >= target, "a bookmark", poke=fake_api.bookmark_now
    )
    assert int(watcher.resource_version) == target


def test_survives_410_with_a_correct_diff(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("stays", node="n1")
    fake_api.add_pod("changes", node="n1", annotations={"a": "1"})
    fake_api.add_pod("vanishes", node="n1")
    watcher = start_watcher()
    recorder.clear()

    fake_api.stop()  # while we are away, history moves on and is compacted
    fake_api.delete("pods", "vanishes", namespace="default")
    fake_api.set_pod_annotations("changes", {"a": "2"})
    fake_api.add_pod("arrives", node="n1")
    fake_api.compact()
    fake_api.start()

    recorder.wait_for("the new pod", saw("pod", "arrives"))
    recorder.wait_for("the deleted pod", saw("deleted", "vanishes"))
    assert sorted(recorder.names()) == [
        ("deleted", "vanishes"),
        ("pod", "arrives"),
        ("pod", "changes"),
    ]
    changed = next(x for k, x in recorder.seen if x.name == "changes")
    assert changed.annotations == {"a": "2"}  # type: ignore[union-attr]
    assert watcher.relists == 2
    assert int(watcher.resource_version) == fake_api.resource_version


def test_a_410_status_also_leads_to_a_relist(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.expired_as_status = True
    fake_api.add_pod("vanishes", node="n1")
    watcher = start_watcher()
    wait_until(lambda: fake_api.watch_count() >= 1, "a watch request")
    fake_api.stop()
    fake_api.delete("pods", "vanishes", namespace="default")
    fake_api.compact()
    fake_api.start()
    recorder.wait_for("the deleted pod", saw("deleted", "vanishes"))
    assert watcher.relists == 2


def test_reconnects_after_a_server_restart_and_replays_what_it_missed(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("p", node="n1")
    watcher = start_watcher()
    wait_until(lambda: fake_api.watch_count() >= 1, "a watch request")
    port = fake_api.port
    fake_api.stop()
    fake_api.set_pod_annotations("p", {"while": "down"})
    fake_api.start()
    assert fake_api.port == port
    recorder.wait_for("the change made while down", saw("pod", "p", {"while": "down"}))
    fake_api.set_pod_annotations("p", {"while": None, "after": "restart"})
    recorder.wait_for("a change after the restart", saw("pod", "p", {"after": "restart"}))
    assert watcher.relists == 1  # resumed from its version; no relist needed


def test_a_silent_watch_is_dropped_and_reopened(
    fake_api: FakeApiServer, recorder: Recorder, start_watcher: Callable[..., PodWatcher]
) -> None:
    fake_api.add_pod("p", node="n1")
    start_watcher(inactivity_timeout_s=0.5)
    wait_until(lambda: fake_api.watch_count() >= 1, "a watch request")
    assert fake_api.stall_open_watches() >= 1
    fake_api.set_pod_annotations("p", {"x": "1"})
    recorder.wait_for("the change after the stall", saw("pod", "p", {"x": "1"}))
    assert fake_api.watch_count() >= 2


def test_stop_ends_the_thread_promptly(
    fake_api: FakeApiServer, start_watcher: Callable[..., PodWatcher]
) -> None:
    watcher = start_watcher()
    wait_until(lambda: fake_api.watch_count() >= 1, "a watch request")
    watcher.stop(timeout=10)
    assert not watcher.alive


def test_a_failing_callback_is_logged_and_the_watch_goes_on(
    fake_api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake_api.add_pod("bad", node="n1")
    recorder = Recorder()

    def on_pod(info: PodInfo) -> None:
        if info.name == "bad":
            raise ValueError("consumer bug")
        recorder.on_pod(info)

    api = api_client_from_env(fake_api.url)
    watcher = PodWatcher(
        api_client=api, node_name="n1", on_pod=on_pod, on_pod_deleted=recorder.on_pod_deleted
    )
    watcher.start()
    try:
        fake_api.add_pod("good", node="n1")
        recorder.wait_for("the good pod", saw("pod", "good"))
    finally:
        watcher.stop()
        api.close()
    assert any("callback failed for pod default/bad" in r.getMessage() for r in caplog.records)
    assert watcher.relists == 1


def test_relists_read_from_the_watch_cache(
    fake_api: FakeApiServer, start_watcher: Callable[..., PodWatcher]
) -> None:
    start_watcher()
    (listed,) = [q for m, _, q in fake_api.requests if m == "GET" and "watch" not in q]
    assert listed["resourceVersion"] == "0" and listed["fieldSelector"] == "spec.nodeName=n1"


def test_a_server_without_bookmarks_is_reopened_quietly(
    fake_api: FakeApiServer,
    recorder: Recorder,
    start_watcher: Callable[..., PodWatcher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_api.add_pod("p", node="n1")
    with caplog.at_level(logging.DEBUG, logger="appliance.kube.informer"):
        start_watcher(bookmark=False, inactivity_timeout_s=0.2)
        wait_until(lambda: fake_api.watch_count() >= 4, "three quiet reopens")
        fake_api.set_pod_annotations("p", {"x": "1"})
        recorder.wait_for("a change after the reopens", saw("pod", "p", {"x": "1"}))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "a quiet watch (no bookmarks)" in caplog.text


def test_silence_from_a_server_that_sends_bookmarks_is_a_warning(
    fake_api: FakeApiServer,
    start_watcher: Callable[..., PodWatcher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    watcher = start_watcher(inactivity_timeout_s=0.5)
    wait_until(lambda: fake_api.watch_count() >= 1, "a watch request")
    before = watcher.resource_version
    fake_api.add_pod("elsewhere", node="n2")
    wait_until(lambda: watcher.resource_version != before, "a bookmark", poke=fake_api.bookmark_now)
    fake_api.stall_open_watches()
    wait_until(lambda: fake_api.watch_count() >= 2, "a reopen after the stall")
    assert "silent for 0.5s although the server sends bookmarks" in caplog.text
