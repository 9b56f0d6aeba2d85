"""The fake API server keeps the promises the watcher relies on, seen through real clients."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import urllib3
from fakeapi import ApiError, FakeApiServer
from kubernetes import client

Event = dict[str, Any]
HERE = Path(__file__).parent


def watch_events(api_client: client.ApiClient, **kwargs: Any) -> Iterator[Event]:
    resp = cast(
        urllib3.HTTPResponse,
        client.CoreV1Api(api_client).list_pod_for_all_namespaces(
            watch=True, _preload_content=False, **kwargs
        ),
    )
    pending = b""
    try:
        for chunk in resp.stream(None, decode_content=False):
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                yield json.loads(line)
    finally:
        resp.release_conn()


def names_and_types(events: list[Event]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def test_resource_versions_increase_globally(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    api = client.CoreV1Api(api_client)
    fake_api.add_node("n1")
    rvs = []
    for i in range(3):
        spec = {"containers": [{"name": "c", "image": "cuda"}]}
        pod = api.create_namespaced_pod("default", {"metadata": {"name": f"p{i}"}, "spec": spec})
        rvs.append(int(pod.metadata.resource_version))
    node = api.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    rvs.append(int(node.metadata.resource_version))
    assert rvs == sorted(rvs) and len(set(rvs)) == 4
    listed = api.list_pod_for_all_namespaces()
    assert int(listed.metadata.resource_version) == rvs[-1] == fake_api.resource_version


def test_field_and_label_selectors_filter(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("a", node="n1", labels={"team": "x"})
    fake_api.add_pod("b", node="n2", labels={"team": "y"})
    fake_api.add_pod("c", node="n1", namespace="other", labels={"team": "y", "gpu": "1"})
    api = client.CoreV1Api(api_client)

    def names(**kw: str) -> list[str]:
        return sorted(p.metadata.name for p in api.list_pod_for_all_namespaces(**kw).items)

    assert names(field_selector="spec.nodeName=n1") == ["a", "c"]
    assert names(field_selector="spec.nodeName=n1,metadata.namespace=default") == ["a"]
    assert names(field_selector="metadata.name!=a") == ["b", "c"]
    assert names(label_selector="team=y") == ["b", "c"]
    assert names(label_selector="team in (x,z),!gpu") == ["a"]
    assert names(label_selector="gpu") == ["c"]
    assert [p.metadata.name for p in api.list_namespaced_pod("other").items] == ["c"]


def test_watch_from_a_resource_version_replays_in_order(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("old", node="n1")
    start = fake_api.resource_version
    fake_api.add_pod("new", node="n1")
    fake_api.set_pod_annotations("old", {"k": "v"})
    fake_api.add_pod("elsewhere", node="n2")
    fake_api.delete("pods", "new", namespace="default")
    events = list(
        watch_events(
            api_client,
            resource_version=str(start),
            field_selector="spec.nodeName=n1",
            timeout_seconds=1,
        )
    )
    assert names_and_types(events) == [("ADDED", "new"), ("MODIFIED", "old"), ("DELETED", "new")]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > start
    assert events[1]["object"]["metadata"]["annotations"] == {"k": "v"}


def test_watch_without_a_version_starts_with_what_exists(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("a", node="n1")
    fake_api.add_pod("b", node="n2")
    events = list(watch_events(api_client, field_selector="spec.nodeName=n1", timeout_seconds=1))
    assert names_and_types(events) == [("ADDED", "a")]


def test_binding_a_pod_to_the_node_shows_as_added(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("pending")
    start = fake_api.resource_version

    def bind(pod: dict[str, Any]) -> dict[str, Any]:
        pod["spec"]["nodeName"] = "n1"
        return pod

    fake_api.update("pods", "pending", bind, namespace="default")
    events = list(
        watch_events(
            api_client,
            resource_version=str(start),
            field_selector="spec.nodeName=n1",
            timeout_seconds=1,
        )
    )
    assert names_and_types(events) == [("ADDED", "pending")]


def test_bookmarks_arrive_when_asked_and_carry_the_current_version(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("a", node="n1")
    fake_api.set_pod_annotations("a", {"x": "1"})
    seen: list[Event] = []
    for event in watch_events(
        api_client,
        resource_version=str(fake_api.resource_version - 1),
        field_selector="spec.nodeName=n1",
        allow_watch_bookmarks=True,
        timeout_seconds=30,
    ):
        seen.append(event)
        if event["type"] == "MODIFIED":  # the watch is live: move the version on, unseen here
            fake_api.add_pod("b", node="n2")
            fake_api.bookmark_now()
        if event["type"] == "BOOKMARK":
            break
    assert [e["type"] for e in seen] == ["MODIFIED", "BOOKMARK"]
    bookmark = seen[-1]["object"]
    assert bookmark["kind"] == "Pod"
    assert bookmark["metadata"]["resourceVersion"] == str(fake_api.resource_version)


def test_watch_without_bookmarks_gets_none(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.bookmark_interval_s = 0.05
    fake_api.add_pod("a", node="n1")
    events = list(watch_events(api_client, resource_version="1", timeout_seconds=1))
    assert [e["type"] for e in events] == ["ADDED"]


def test_compaction_makes_old_versions_gone(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("a", node="n1")
    old = fake_api.resource_version
    fake_api.set_pod_annotations("a", {"x": "1"})
    fake_api.compact()
    events = list(watch_events(api_client, resource_version=str(old), timeout_seconds=1))
    assert [e["type"] for e in events] == ["ERROR"]
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"
    fake_api.set_pod_annotations("a", {"x": "2"})
    since = str(fake_api.resource_version - 1)
    fresh = list(watch_events(api_client, resource_version=since, timeout_seconds=1))
    assert [e["type"] for e in fresh] == ["MODIFIED"]


def test_history_older_than_the_watch_window_is_gone(api_client: client.ApiClient) -> None:
    fake = FakeApiServer(watch_window_s=0.2).start()
    try:
        api = client.ApiClient(client.Configuration(host=fake.url))
        fake.add_pod("a", node="n1")
        old = fake.resource_version
        fake.set_pod_annotations("a", {"x": "1"})
        time.sleep(0.3)  # older than the window: the next change pushes it out
        fake.set_pod_annotations("a", {"x": "2"})
        events = list(watch_events(api, resource_version=str(old), timeout_seconds=1))
        assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
        recent = list(
            watch_events(api, resource_version=str(fake.resource_version - 1), timeout_seconds=1)
        )
        assert [e["type"] for e in recent] == ["MODIFIED"]
        api.close()
    finally:
        fake.stop()


def test_unsupported_field_selectors_are_a_400(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    api = client.CoreV1Api(api_client)
    for call, selector in [
        (api.list_pod_for_all_namespaces, "spec.containers=x"),
        (api.list_pod_for_all_namespaces, "metadata.labels=x"),
        (api.list_node, "spec.nodeName=n1"),
        (api.list_node, "status.allocatable=1"),
    ]:
        with pytest.raises(client.ApiException) as error:
            call(field_selector=selector)
        assert error.value.status == 400
        label = selector.split("=")[0]
        assert json.loads(error.value.body)["message"] == f"field label not supported: {label}"
    supported = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
    assert api.list_pod_for_all_namespaces(field_selector=supported).items == []
    assert api.list_node(field_selector="spec.unschedulable=false").items == []


def test_paging_serves_a_consistent_snapshot_until_its_history_is_gone(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    api = client.CoreV1Api(api_client)
    for name in "abcde":
        fake_api.add_pod(name, node="n1")
    first = api.list_pod_for_all_namespaces(limit=2)
    assert [p.metadata.name for p in first.items] == ["a", "b"]
    assert first.metadata.remaining_item_count == 3
    fake_api.delete("pods", "d", namespace="default")  # after the snapshot: still listed
    fake_api.add_pod("f", node="n1")  # after the snapshot: not listed
    rest = api.list_pod_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    last = api.list_pod_for_all_namespaces(limit=2, _continue=rest.metadata._continue)
    names = [p.metadata.name for p in rest.items + last.items]
    assert names == ["c", "d", "e"] and not last.metadata._continue
    assert rest.metadata.resource_version == first.metadata.resource_version
    # The watch cache answers resourceVersion=0 whole, whatever the limit.
    assert len(api.list_pod_for_all_namespaces(limit=2, resource_version="0").items) == 5
    again = api.list_pod_for_all_namespaces(limit=2)
    fake_api.add_pod("g", node="n1")
    fake_api.compact()  # the snapshot's version is older than what is left
    with pytest.raises(client.ApiException) as error:
        api.list_pod_for_all_namespaces(limit=2, _continue=again.metadata._continue)
    assert error.value.status == 410


def test_service_accounts_get_what_the_deploy_manifests_grant_and_nothing_else(
    fake_api: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    fake_api.add_pod("a", node="n1")
    node = client.CoreV1Api(service_account_client("nvshare-node"))
    webhook = client.CoreV1Api(service_account_client("nvshare-webhook"))
    assert [p.metadata.name for p in node.list_pod_for_all_namespaces().items] == ["a"]
    assert webhook.list_node().items == []
    denied = [
        (node.list_node, (), 'cannot list resource "nodes" in API group "" at the cluster scope'),
        (
            node.read_namespaced_pod,  # it lists and watches its node's pods, never reads one
            ("a", "default"),
            'cannot get resource "pods" in API group "" in the namespace "default"',
        ),
        (
            node.delete_namespaced_pod,
            ("a", "default"),
            'cannot delete resource "pods" in API group "" in the namespace "default"',
        ),
        (
            webhook.read_namespaced_pod,
            ("a", "default"),
            'cannot get resource "pods" in API group "" in the namespace "default"',
        ),
        (
            webhook.patch_namespaced_pod_status,
            ("a", "default", {"status": {"phase": "Failed"}}),
            'cannot patch resource "pods/status"',
        ),
    ]
    for call, args, message in denied:
        with pytest.raises(client.ApiException) as error:
            call(*args)
        assert error.value.status == 403, call
        body = json.loads(error.value.body)
        assert 'User "system:serviceaccount:nvshare-system:' in body["message"]
        assert message in body["message"]
    stranger = client.Configuration(host=fake_api.url)
    stranger.api_key = {"authorization": "Bearer not-a-token"}
    with client.ApiClient(stranger) as api, pytest.raises(client.ApiException) as error:
        client.CoreV1Api(api).list_node()
    assert error.value.status == 401


def test_patch_types_put_conflicts_and_no_op_writes(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_pod("p", node="n1", annotations={"keep": "1", "drop": "2"})
    api = client.CoreV1Api(api_client)
    merged = api.patch_namespaced_pod(
        "p",
        "default",
        {"metadata": {"annotations": {"drop": None, "new": "3"}}},
        _content_type="application/merge-patch+json",
    )
    assert merged.metadata.annotations == {"keep": "1", "new": "3"}
    strategic = api.patch_namespaced_pod(
        "p", "default", {"metadata": {"labels": {"l": "x"}, "annotations": {"keep": None}}}
    )
    assert strategic.metadata.labels == {"l": "x"} and strategic.metadata.annotations == {
        "new": "3"
    }
    assert fake_api.requests[-1][0] == "PATCH"
    jsonpatch = api.patch_namespaced_pod(
        "p",
        "default",
        [
            {
                "op": "add",
                "path": "/metadata/annotations/nvshare.com~1gpu-core-limit",
                "value": "5",
            },
            {"op": "replace", "path": "/metadata/annotations/new", "value": "4"},
            {"op": "remove", "path": "/metadata/labels/l"},
        ],
        _content_type="application/json-patch+json",
    )
    assert jsonpatch.metadata.annotations == {"new": "4", "nvshare.com/gpu-core-limit": "5"}
    assert jsonpatch.metadata.labels == {}

    rv = fake_api.resource_version
    same = api.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"new": "4"}}})
    assert same.metadata.resource_version == str(rv) == str(fake_api.resource_version)

    stale = api.read_namespaced_pod("p", "default")
    fake_api.set_pod_annotations("p", {"other": "writer"})
    stale.metadata.annotations["mine"] = "1"
    with pytest.raises(client.ApiException) as conflict:
        api.replace_namespaced_pod("p", "default", stale)
    assert conflict.value.status == 409
    fresh = api.read_namespaced_pod("p", "default")
    fresh.metadata.annotations["mine"] = "1"
    assert api.replace_namespaced_pod("p", "default", fresh).metadata.annotations["mine"] == "1"


def test_errors_are_status_objects(fake_api: FakeApiServer, api_client: client.ApiClient) -> None:
    api = client.CoreV1Api(api_client)
    with pytest.raises(client.ApiException) as missing:
        api.read_namespaced_pod("nope", "default")
    assert missing.value.status == 404
    assert json.loads(missing.value.body)["reason"] == "NotFound"
    fake_api.add_pod("dup")
    with pytest.raises(client.ApiException) as dup:
        api.create_namespaced_pod("default", {"metadata": {"name": "dup"}})
    assert dup.value.status == 409
    with pytest.raises(client.ApiException) as no_ns:
        api.create_namespaced_pod("ghost", {"metadata": {"name": "x"}})
    assert no_ns.value.status == 404


def test_events_nodes_and_deletes(fake_api: FakeApiServer, api_client: client.ApiClient) -> None:
    api = client.CoreV1Api(api_client)
    fake_api.add_node("gpu-1", labels={"nvidia.com/mig.capable": "true"})
    assert api.read_node("gpu-1").metadata.labels == {"nvidia.com/mig.capable": "true"}
    body = {"metadata": {"name": "e1"}, "reason": "R", "message": "m", "involvedObject": {}}
    api.create_namespaced_event("default", body)
    assert [e.reason for e in api.list_namespaced_event("default").items] == ["R"]
    pod = fake_api.add_pod("gone", node="gpu-1")
    deleted = api.delete_namespaced_pod("gone", "default")
    assert deleted.metadata.uid == pod["metadata"]["uid"]
    assert api.list_namespaced_pod("default").items == []


def test_status_changes_only_through_the_status_subresource(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.add_node("n1", status={"allocatable": {"nvshare.com/gpu": "10"}})
    api = client.CoreV1Api(api_client)
    ignored = api.patch_node(
        "n1", {"metadata": {"labels": {"x": "1"}}, "status": {"allocatable": {"cpu": "1"}}}
    )
    assert ignored.metadata.labels == {"x": "1"}
    assert ignored.status.allocatable == {"nvshare.com/gpu": "10"}
    changed = api.patch_node_status(
        "n1", {"metadata": {"labels": {"y": "2"}}, "status": {"allocatable": {"cpu": "1"}}}
    )
    assert changed.metadata.labels == {"x": "1"}
    assert changed.status.allocatable == {"nvshare.com/gpu": "10", "cpu": "1"}


def test_unknown_patch_type_is_415(fake_api: FakeApiServer) -> None:
    import http.client

    fake_api.add_pod("p")
    conn = http.client.HTTPConnection(fake_api.host, fake_api.port)
    try:
        conn.request("PATCH", "/api/v1/namespaces/default/pods/p", "{}", {"Content-Type": "text/x"})
        resp = conn.getresponse()
        assert resp.status == 415 and json.loads(resp.read())["reason"] == "UnsupportedMediaType"
    finally:
        conn.close()


@pytest.fixture
def kubectl(fake_api: FakeApiServer, tmp_path: Path) -> Any:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "absent-kubeconfig"), "HOME": str(tmp_path)}

    def run(*args: str) -> str:
        proc = subprocess.run(
            [exe, f"--server={fake_api.url}", "--insecure-skip-tls-verify", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {proc.stderr}"
        return proc.stdout

    return run


def test_kubectl_annotate_sets_and_removes(kubectl: Any, fake_api: FakeApiServer) -> None:
    fake_api.add_pod("trainer", node="n1", annotations={"other": "x"})
    before = fake_api.resource_version
    out = kubectl("annotate", "pod", "trainer", "nvshare.com/gpu-memory-limit=2Gi", "--overwrite")
    assert "annotated" in out
    pod = fake_api.get("pods", "trainer", namespace="default")
    assert pod["metadata"]["annotations"] == {"other": "x", "nvshare.com/gpu-memory-limit": "2Gi"}
    assert int(pod["metadata"]["resourceVersion"]) > before
    patches = [(m, p) for m, p, _ in fake_api.requests if m == "PATCH"]
    assert patches == [("PATCH", "/api/v1/namespaces/default/pods/trainer")]

    kubectl("annotate", "pod", "trainer", "nvshare.com/gpu-memory-limit-")
    pod = fake_api.get("pods", "trainer", namespace="default")
    assert pod["metadata"]["annotations"] == {"other": "x"}


def test_kubectl_delete_sends_a_body_and_the_pod_goes(
    kubectl: Any, fake_api: FakeApiServer
) -> None:
    fake_api.add_pod("a", node="n1")
    fake_api.add_pod("b", node="n1")
    kubectl("delete", "pod", "a", "b", "--wait=false")
    assert fake_api.store.list("pods", "default")[0] == []


def test_kubectl_get_lists_pods_and_reads_json(kubectl: Any, fake_api: FakeApiServer) -> None:
    fake_api.add_pod("a", node="n1")
    fake_api.add_pod("b", node="n1")
    table = kubectl("get", "pods")
    assert [line.split()[0] for line in table.splitlines()] == ["NAME", "a", "b"]
    one = json.loads(kubectl("get", "pod", "a", "-o", "json"))
    assert one["kind"] == "Pod" and one["spec"]["nodeName"] == "n1"


def test_standalone_process_serves_seeded_pods(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with subprocess.Popen(
        [
            sys.executable,
            str(HERE / "fakeapi.py"),
            "--port",
            str(port),
            "--seed-node",
            "n1",
            "--seed-pods",
            "3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert f"http://127.0.0.1:{port}" in proc.stdout.readline()
            api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
            with api:
                pods = client.CoreV1Api(api).list_pod_for_all_namespaces(
                    field_selector="spec.nodeName=n1"
                )
            assert sorted(p.metadata.name for p in pods.items) == ["pod-0", "pod-1", "pod-2"]
        finally:
            proc.terminate()
            assert proc.wait(timeout=10) == 0


def test_kubectl_validates_by_default_through_the_server(
    fake_api: FakeApiServer, tmp_path: Path
) -> None:
    """kubectl's default `--validate=strict` asks the server: without the OpenAPI v3 documents
    every `kubectl apply` failed with "failed to download openapi" unless --validate=false."""
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "absent-kubeconfig"), "HOME": str(tmp_path)}
    container = {"name": "c", "image": "busybox"}
    for name, extra in (("good", {}), ("typo", {"imagePulPolicy": "Always"})):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}}
        pod["spec"] = {"containers": [{**container, **extra}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(pod))

    def apply(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [exe, f"--server={fake_api.url}", "apply", "-f", str(tmp_path / f"{name}.json")],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip

    good = apply("good")
    assert good.returncode == 0, good.stderr
    typo = apply("typo")
    assert typo.returncode == 1
    assert "strict decoding error" in typo.stderr and "imagePulPolicy" in typo.stderr, typo.stderr
    assert fake_api.get("pods", "good", namespace="default")
    with pytest.raises(ApiError):
        fake_api.get("pods", "typo", namespace="default")
