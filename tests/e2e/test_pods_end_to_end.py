"""End to end on the CPU: fake API server + daemon + fake-CUDA processes under the hook.

Two "pods" are two probe processes (ld_hook/tests/probe.c on the fake libcuda.so.1, with
libnvshare.so preloaded). They name their pod through NVSHARE_POD_NAMESPACE/NAME, because
test processes are not in a pod's cgroup, and the policy trusts this uid's claims
(`trust.podClaimUids`); kernel identity from cgroups is tested on its own in
tests/host/test_cgroup_identity.py and against a real daemon in tests/abuse. Annotations
are changed with real kubectl where it is installed and with the real kubernetes client
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon
from kube import as_operator, manifests
from kube.fakeapi import FakeApiServer

from appliance.cli.client import ControlClient
from appliance.wire import protocol as p

from .probes import Probe

GiB = 1 << 30
KEY = "nvshare.com/gpu-memory-limit"
OOM = "err 2"


@pytest.fixture
def cluster() -> Iterator[tuple[FakeApiServer, RunningDaemon]]:
    api = FakeApiServer().start()
    api.add_node("node-1")
    api.add_pod("pod-a", namespace="team", node="node-1", annotations={KEY: "1Gi"})
    api.add_pod("pod-b", namespace="team", node="node-1", annotations={KEY: "3Gi"})
    api.add_pod("elsewhere", namespace="team", node="node-2", annotations={KEY: "1Mi"})
    tmp = Path(tempfile.mkdtemp(prefix="nvs-e2e-"))
    # The daemon reads the API as the DaemonSet's service account, through a kubeconfig as
    # a real client would, under the RBAC of the rendered deploy/ manifests.
    api.load_rbac(list(manifests.rendered()))
    kubeconfig = api.write_kubeconfig(
        tmp / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
    )
    (tmp / "policy").mkdir()
    (tmp / "policy" / "zz-trust.yaml").write_text(f"trust: {{podClaimUids: [{os.getuid()}]}}\n")
    d = start_daemon(
        tmp,
        "scheduler: {mode: 'off'}\n",
        args=["--node-name", "node-1"],
        extra_env={"KUBECONFIG": kubeconfig},
    )
    try:
        yield api, d
    finally:
        d.stop()
        api.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def annotate(api: FakeApiServer, value: str | None) -> None:
    as_operator.annotate(api.url, "pod", "pod-a", KEY, value, namespace="team")


def wait_for(probe: Probe, n: int, want: str, timeout: float = 5.0) -> float:
    """Seconds until an allocation of n bytes gives `want`."""
    start = time.monotonic()
    while (got := probe.try_alloc(n)) != want:
        assert time.monotonic() - start < timeout, f"still {got!r}, wanted {want!r}"
        time.sleep(0.005)
    return time.monotonic() - start


def status(d: RunningDaemon) -> dict[str, object]:
    with ControlClient(d.socket_dir) as c:
        return c.request(p.StatusRequest()).doc  # type: ignore[no-any-return]


def test_annotations_reach_running_pods(cluster: tuple[FakeApiServer, RunningDaemon]) -> None:
    api, d = cluster
    a, b = Probe(d, "team", "pod-a"), Probe(d, "team", "pod-b")
    assert a.ask("init") == "ok" and b.ask("init") == "ok"
    wait_for(a, 2 * GiB, OOM)  # the watch's first list may still be on its way
    assert b.try_alloc(2 * GiB) == "ok"
    assert a.ask("total") == f"ok {GiB}"

    annotate(api, "4Gi")  # resize with no restart
    wait_for(a, 2 * GiB, "ok", timeout=1.0)
    explain = subprocess.run(
        [str(BIN / "nvsharectl"), "policy", "explain", "--pod", "team/pod-a"],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert explain.returncode == 0, explain.stderr
    assert "pod team/pod-a (claimed)" in explain.stdout
    assert "memory: 4Gi (from annotation)" in explain.stdout
    # Seed 000's log line: one per change, old -> new, and what set it.
    said = [line for line in d.output().splitlines() if "limits of pod team/pod-a" in line]
    assert any("memory 1Gi -> 4Gi (from annotation)" in line for line in said), said

    for i in range(20):
        value = "1Gi" if i % 2 == 0 else "4Gi"
        annotate(api, value) if i < 2 else api.set_pod_annotations(
            "pod-a", {KEY: value}, namespace="team"
        )
        wait_for(a, 2 * GiB, OOM if value == "1Gi" else "ok", timeout=1.0)

    annotate(api, "1ki")  # invalid (it used to escape as a KeyError): the previous 4Gi stays
    deadline = time.monotonic() + 5
    while not (
        events := [
            e for e in api.store.list("events", "team")[0] if e["involvedObject"]["name"] == "pod-a"
        ]
    ):
        assert time.monotonic() < deadline, "no Event on the pod"
        time.sleep(0.05)
    assert KEY in events[0]["message"] and "kept previous override 4Gi" in events[0]["message"]
    assert "did you mean Ki?" in events[0]["message"]
    assert a.try_alloc(2 * GiB) == "ok"

    annotate(api, None)  # removed: the policy value (no limit) applies again
    wait_for(a, 8 * GiB, "ok", timeout=1.0)

    clients = {c["pod"]: c for c in status(d)["clients"]}  # type: ignore[union-attr]
    assert clients["team/pod-a (claimed)"]["memory_used"] == 0  # nothing leaked
    assert clients["team/pod-b (claimed)"]["memory_limit"] == 3 * GiB
    assert [a.close(), b.close()] == [0, 0]
    assert "Traceback" not in d.output()


def test_pod_limit_is_shared_by_its_processes(cluster: tuple[FakeApiServer, RunningDaemon]) -> None:
    _api, d = cluster
    first, second = Probe(d, "team", "pod-b"), Probe(d, "team", "pod-b")  # 3Gi together
    assert first.ask("init") == "ok" and second.ask("init") == "ok"
    wait_for(first, 4 * GiB, OOM)
    held = first.ask(f"alloc mem {2 * GiB}")
    assert held.startswith("ok")
    assert second.try_alloc(2 * GiB) == OOM  # 4Gi together would exceed the pod's 3Gi
    assert second.try_alloc(GiB - (64 << 20)) == "ok"
    doc = json.dumps(status(d))
    assert "pod-b" in doc
    assert [first.close(), second.close()] == [0, 0]


def test_a_lowered_annotation_cap_applies_to_running_pods(
    cluster: tuple[FakeApiServer, RunningDaemon],
) -> None:
    api, d = cluster
    policy = d.policy_dir / "policy.yaml"
    policy.write_text(
        "scheduler: {mode: 'off'}\nannotations: {maxMemoryLimit: 8Gi}\n"
        "defaults: {memoryLimit: 1Gi}\n"
    )
    b = Probe(d, "team", "pod-b")  # annotated 3Gi
    assert b.ask("init") == "ok"
    wait_for(b, 2 * GiB, "ok")
    policy.write_text(
        "scheduler: {mode: 'off'}\nannotations: {maxMemoryLimit: 2Gi}\n"
        "defaults: {memoryLimit: 1Gi}\n"
    )
    wait_for(b, 2 * GiB, OOM)  # 3Gi is now over the cap: the policy's 1Gi applies
    deadline = time.monotonic() + 5
    while not [
        e
        for e in api.store.list("events", "team")[0]
        if e["involvedObject"]["name"] == "pod-b" and "cap" in e["message"]
    ]:
        assert time.monotonic() < deadline, "no Event about the cap on pod-b"
        time.sleep(0.05)
    policy.write_text(
        "scheduler: {mode: 'off'}\nannotations: {maxMemoryLimit: 8Gi}\n"
        "defaults: {memoryLimit: 1Gi}\n"
    )
    wait_for(b, 2 * GiB, "ok")  # the same annotation is allowed again
    assert b.close() == 0
