"""The scheduler extender over real HTTP, its caches fed by the fake API server.

Requests are what kube-scheduler sends (the bodies its HTTPExtender marshals), the extender
reads the API as the nvshare-extender service account under deploy/'s RBAC, and nodes publish
their status through the node daemon's own publisher as nvshare-node.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from as_operator import annotate as operator_annotates
from extender_client import (
    EXTENDER_ARGS,
    LEGACY_ARGS,
    ExtenderClient,
    args,
    eventually,
    gpu_pod,
)
from fakeapi import FakeApiServer
from kubernetes import client
from prometheus_client import CollectorRegistry
from test_node_status import sample

from appliance.cluster.cluster_view import ClusterView
from appliance.cluster.extender import Extender
from appliance.cluster.extender_server import ExtenderServer, build_extender_server
from appliance.core.gpus import GpuFacts
from appliance.kube.node_status import NodeStatusPublisher
from appliance.placement.status import ANNOTATION
from appliance.policy.model import NodeStatusSettings, Policy

GiB = 1 << 30
MiB = 1 << 20


def publish(api_client: client.ApiClient, node: str, used: int, at: float | None = None) -> None:
    """What the node daemon on `node` writes, through its own publisher."""
    uuid = f"GPU-{node}"
    publisher = NodeStatusPublisher(
        api_client=api_client,
        node_name=node,
        inventory=[GpuFacts(uuid, 0, "NVIDIA H100 80GB HBM3", 80 * GiB)],
        settings=NodeStatusSettings(),
        registry=CollectorRegistry(),
    )
    publisher.consider(sample(used, uuid=uuid, at=at), NodeStatusSettings())


class Cluster:
    def __init__(
        self, api: FakeApiServer, make: Callable[[str], client.ApiClient], tmp: Path
    ) -> None:
        self.api, self.make, self.tmp = api, make, tmp
        self.node_client = make("nvshare-node")
        self.servers: list[ExtenderServer] = []
        self.clients: list[ExtenderClient] = []
        for name in ("full", "roomy"):
            api.add_node(name)
        publish(self.node_client, "full", 78 * GiB)  # 2 GiB free: a process outside the hook
        publish(self.node_client, "roomy", 10 * GiB)

    def extender(self, policy: str = "realtimeCheck: {mode: strict}\n", **kw: Any) -> Any:
        policy_dir = self.tmp / f"policy-{len(self.servers)}"
        policy_dir.mkdir()
        (policy_dir / "policy.yaml").write_text(policy)
        server = build_extender_server(
            policy_dir=policy_dir,
            api_client=self.make("nvshare-extender"),
            switch=kw.get("switch"),
            port=0,
            host="127.0.0.1",
        )
        self.servers.append(server)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        ext = self.client(server.port)
        eventually(lambda: ext.get("/readyz") == 200, "the extender's caches listed")
        return ext

    def client(self, port: int) -> ExtenderClient:
        self.clients.append(ExtenderClient(port))
        return self.clients[-1]

    def close(self) -> None:
        for ext in self.clients:
            ext.close()
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def cluster(
    fake_api: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
    tmp_path: Path,
) -> Iterator[Cluster]:
    c = Cluster(fake_api, service_account_client, tmp_path)
    yield c
    c.close()


NEED_4GI = {"nvshare.com/gpu-memory-limit": "4Gi"}


def test_strict_filters_the_full_node_and_keeps_the_one_that_fits(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    ext = cluster.extender()
    with caplog.at_level(logging.INFO, logger="nvshare.extender"):
        result = ext.filter(args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"]))
    assert result["NodeNames"] == ["roomy"] and result["Nodes"] is None
    assert set(result["FailedNodes"]) == {"full"} and result["Error"] == ""
    assert "needs 4Gi per GPU" in result["FailedNodes"]["full"]
    assert result["FailedAndUnresolvableNodes"] == {}
    failed = [r.getMessage() for r in caplog.records if "check failed" in r.getMessage()]
    assert failed and "node=full" in failed[0] and "requested=4096MiB used=79872MiB" in failed[0]
    assert ext.prioritize(args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"])) == {
        "full": 0,
        "roomy": 10,
    }


def test_warning_keeps_both_and_logs(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    ext = cluster.extender("realtimeCheck: {mode: warning}\n")
    with caplog.at_level(logging.WARNING, logger="nvshare.extender"):
        result = ext.filter(args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"]))
    assert result["NodeNames"] == ["full", "roomy"] and result["FailedNodes"] == {}
    (line,) = [r.getMessage() for r in caplog.records]
    assert "node=full" in line and "mode=warning node kept" in line


def test_disabled_skips_the_check(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    ext = cluster.extender("realtimeCheck: {mode: disabled}\n")
    with caplog.at_level(logging.DEBUG, logger="nvshare.extender"):
        result = ext.filter(
            args(gpu_pod(annotations={"nvshare.com/gpu-memory-limit": "70Gi"}), ["full", "roomy"])
        )
    assert result["NodeNames"] == ["full", "roomy"]
    assert not [r for r in caplog.records if "check" in r.getMessage()]
    assert ext.prioritize(args(gpu_pod(), ["full", "roomy"])) == {"full": 0, "roomy": 0}


def test_the_switch_turns_the_check_on_or_off(cluster: Cluster) -> None:
    body = args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"])
    on = cluster.extender("realtimeCheck: {}\n", switch=True)  # no mode set: HAMi's strict
    assert on.filter(body)["NodeNames"] == ["roomy"]
    off = cluster.extender("realtimeCheck: {mode: strict}\n", switch=False)
    assert off.filter(body)["NodeNames"] == ["full", "roomy"]


def test_hami_variables_mean_what_hami_says(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HAMI_ENABLE_REALTIME_CHECK=true with HAMI_REALTIME_CHECK_MODE=disabled skips the check;
    with the check off, a pod annotated hami.io/enable-realtime-check: "true" is checked."""
    body = args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"])
    monkeypatch.setenv("HAMI_ENABLE_REALTIME_CHECK", "true")
    monkeypatch.setenv("HAMI_REALTIME_CHECK_MODE", "disabled")
    disabled = cluster.extender("", switch=True)
    assert disabled.filter(body)["NodeNames"] == ["full", "roomy"]
    opted_in = gpu_pod(annotations={**NEED_4GI, "hami.io/enable-realtime-check": "true"})
    assert disabled.filter(args(opted_in, ["full", "roomy"]))["NodeNames"] == ["full", "roomy"]
    monkeypatch.setenv("HAMI_ENABLE_REALTIME_CHECK", "false")
    monkeypatch.delenv("HAMI_REALTIME_CHECK_MODE")
    off = cluster.extender("", switch=False)
    assert off.filter(body)["NodeNames"] == ["full", "roomy"]
    assert off.filter(args(opted_in, ["full", "roomy"]))["NodeNames"] == ["roomy"]


@pytest.mark.parametrize("key", ["nvshare.com/realtime-check", "hami.io/enable-realtime-check"])
def test_a_pod_opts_out_or_in_by_annotation(cluster: Cluster, key: str) -> None:
    ext = cluster.extender()
    out = ext.filter(args(gpu_pod(annotations={**NEED_4GI, key: "false"}), ["full", "roomy"]))
    assert out["NodeNames"] == ["full", "roomy"]
    opt_in = cluster.extender("realtimeCheck: {mode: strict, enabledByDefault: false}\n")
    assert opt_in.filter(args(gpu_pod(annotations=NEED_4GI), ["full"]))["NodeNames"] == ["full"]
    asked = opt_in.filter(args(gpu_pod(annotations={**NEED_4GI, key: "true"}), ["full"]))
    assert asked["NodeNames"] == [] and "full" in asked["FailedNodes"]


def test_hamis_resource_and_mode_variable(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAMI_REALTIME_CHECK_MODE", "strict")
    ext = cluster.extender("realtimeCheck: {mode: disabled}\n")  # the variable wins
    hami = gpu_pod(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"})
    result = ext.filter(args(hami, ["full", "roomy"]))
    assert result["NodeNames"] == ["roomy"]
    assert "nvidia.com/gpumem" in result["FailedNodes"]["full"]
    small = gpu_pod(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"})
    assert ext.filter(args(small, ["full", "roomy"]))["NodeNames"] == ["full", "roomy"]


def test_the_policy_rule_for_the_pod_sets_its_need(cluster: Cluster) -> None:
    ext = cluster.extender(
        "realtimeCheck: {mode: strict}\n"
        "rules: [{name: research, match: {namespace: research}, memoryLimit: 8Gi}]\n"
    )
    research = ext.filter(args(gpu_pod(namespace="research"), ["full", "roomy"]))
    assert research["NodeNames"] == ["roomy"] and "policy rule 'research'" in str(research)
    other = ext.filter(args(gpu_pod(namespace="other"), ["full", "roomy"]))
    assert other["NodeNames"] == ["full", "roomy"]  # no need known: only the margin


def annotate(api: FakeApiServer, node: str, value: str) -> None:
    """As an operator (or a broken node) would."""
    operator_annotates(api.url, "node", node, ANNOTATION, value)


def fallback_lines(caplog: pytest.LogCaptureFixture, node: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(
            f"Failed to get real-time usage, using cached data node={node} "
        )
    ]


def test_stale_status_falls_back_to_the_cached_capacity(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    publish(cluster.node_client, "full", 78 * GiB, at=time.time() - 3600)  # its daemon died
    ext = cluster.extender()
    with caplog.at_level(logging.WARNING, logger="nvshare.extender"):
        result = ext.filter(args(gpu_pod(annotations=NEED_4GI), ["full", "roomy"]))
    assert result["NodeNames"] == ["full", "roomy"]  # 80 GiB cached, nothing bound there
    (line,) = fallback_lines(caplog, "full")
    assert "gpu=GPU-full" in line and "is the node daemon running?" in line
    # Pods bound there already need most of it: the cached view refuses a big pod.
    cluster.api.add_pod(
        "big",
        namespace="team",
        node="full",
        annotations={"nvshare.com/gpu-memory-limit": "70Gi"},
        spec={"containers": [{"name": "m", "resources": {"limits": {"nvshare.com/gpu": "1"}}}]},
    )
    want = gpu_pod(annotations={"nvshare.com/gpu-memory-limit": "20Gi"})
    eventually(
        lambda: ext.filter(args(want, ["full", "roomy"]))["NodeNames"] == ["roomy"],
        "the bound pod counted against the cached capacity",
    )
    assert (
        "pods bound there need 71680MiB" in ext.filter(args(want, ["full"]))["FailedNodes"]["full"]
    )


def test_missing_and_malformed_status_fall_back_with_the_log_line(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.api.add_node("new")  # no daemon has published yet
    ext = cluster.extender()
    annotate(cluster.api, "full", "{this is not json")
    body = args(gpu_pod(annotations=NEED_4GI), ["full", "new"])
    with caplog.at_level(logging.WARNING, logger="nvshare.extender"):
        eventually(lambda: bool(ext.filter(body) and fallback_lines(caplog, "full")), "fallback")
    (new,) = fallback_lines(caplog, "new")
    assert "gpu=unknown" in new and f"no {ANNOTATION} annotation" in new
    (broken, *_) = fallback_lines(caplog, "full")
    assert "gpu=GPU-full" in broken and "unreadable: not JSON" in broken
    # Malformed now, but its last good status is cached: 80 GiB, nothing bound, 4 GiB fits.
    assert ext.filter(body)["NodeNames"] == ["full", "new"]
    publish(cluster.node_client, "full", 78 * GiB)  # the daemon writes again: real-time again
    eventually(lambda: ext.filter(body)["NodeNames"] == ["new"], "fresh status used again")


def test_kube_schedulers_field_names_in_and_out(cluster: Cluster) -> None:
    ext = cluster.extender()
    pod = gpu_pod(annotations=NEED_4GI)
    for body in (args(pod, ["full", "roomy"]), {"pod": pod, "nodenames": ["full", "roomy"]}):
        assert set(body) <= EXTENDER_ARGS | LEGACY_ARGS
        assert ext.filter(body)["NodeNames"] == ["roomy"]
    # A scheduler without nodeCacheCapable sends whole Nodes and gets the kept ones back.
    nodes = [cluster.api.get("nodes", n) for n in ("full", "roomy")]
    result = ext.filter({"Pod": pod, "Nodes": {"items": nodes}, "NodeNames": None})
    assert result["NodeNames"] is None
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["roomy"]
    assert set(ext.prioritize(args(pod, ["full", "roomy"]))) == {"full", "roomy"}


def test_a_request_that_is_not_extender_args_is_a_400(cluster: Cluster) -> None:
    ext = cluster.extender()
    assert ext.post("filter", b"{nope")[0] == 400
    assert ext.post("filter", {"NodeNames": ["full"]})[0] == 400  # no Pod
    assert ext.post("bind", args(gpu_pod(), ["full"]))[0] == 404
    assert ext.get("/healthz") == 200
    metrics = cluster.client(cluster.servers[0].port)
    metrics.conn.request("GET", "/metrics")
    text = metrics.conn.getresponse().read().decode()
    assert "nvshare_extender_filter_nodes_total" in text


def test_before_its_caches_list_it_keeps_every_node_and_is_not_ready() -> None:
    dead = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))  # nothing there
    cluster = ClusterView(api_client=dead, backoff=(5.0, 5.0))
    registry = CollectorRegistry()
    policy = Policy()
    server = ExtenderServer(
        extender=Extender(cluster=cluster, policy=lambda: policy, switch=True, registry=registry),
        registry=registry,
        host="127.0.0.1",
        port=0,
        not_ready=cluster.not_ready,
        sources=[cluster],
    )
    cluster.start()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    ext = ExtenderClient(server.port)
    try:
        assert ext.get("/readyz") == 503
        body = args(gpu_pod(annotations={"nvshare.com/gpu-memory-limit": "70Gi"}), ["a", "b"])
        assert ext.filter(body)["NodeNames"] == ["a", "b"]
    finally:
        ext.close()
        server.shutdown()
        server.server_close()


def test_the_command_says_what_is_wrong_instead_of_starting(tmp_path: Path) -> None:
    command = [str(Path(sys.executable).parent / "nvshare-scheduler"), "extender"]
    (tmp_path / "policy.yaml").write_text("realtimeCheck: {mode: sometimes}\n")
    env = {**os.environ, "NVSHARE_KUBE_API": "http://127.0.0.1:9"}
    bad_policy = subprocess.run(
        [*command, f"--policy-dir={tmp_path}", "--port=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_policy.returncode == 2
    assert "policy.yaml:1: /realtimeCheck/mode: 'sometimes' is not one of" in bad_policy.stderr
    bad_switch = subprocess.run(
        command,
        env={**env, "HAMI_ENABLE_REALTIME_CHECK": "maybe"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_switch.returncode == 2 and "--enable-realtime-check" in bad_switch.stderr
    assert "Traceback" not in bad_policy.stderr + bad_switch.stderr


def test_the_extenders_account_reads_nodes_and_pods_and_writes_nothing(cluster: Cluster) -> None:
    core = client.CoreV1Api(cluster.make("nvshare-extender"))
    assert {n.metadata.name for n in core.list_node().items} == {"full", "roomy"}
    core.list_pod_for_all_namespaces()
    with pytest.raises(client.ApiException) as refused:
        core.patch_node("full", {"metadata": {"annotations": {ANNOTATION: "{}"}}})
    assert refused.value.status == 403
    with pytest.raises(client.ApiException) as no_get:
        core.read_node("full")  # list and watch only, as its role says
    assert no_get.value.status == 403
