"""End to end on the CPU: node daemons publish what (fake) NVML sees; the extender filters.

Two node daemons (`nvshare-scheduler --node-name ...`) read the fake libnvidia-ml.so.1 built
from ld_hook/tests/fake_nvml.c through the real pynvml, and publish on their Nodes as the
nvshare-node service account. The extender (`nvshare-scheduler extender`) runs as the
nvshare-extender account, switched on by HAMI_ENABLE_REALTIME_CHECK. Requests are what
kube-scheduler sends. A "process outside the hook" is the fake NVML's state file saying a GPU
is in use.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon
from kube import manifests
from kube.extender_client import ExtenderClient, args, eventually, gpu_pod
from kube.fakeapi import FakeApiServer

from appliance.placement.status import ANNOTATION, decode

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "ld_hook" / "build" / "fake"
GiB = 1 << 30
# Quick to publish and quick to go stale, so the test is short: a write at most every 0.5 s,
# a heartbeat every 2 s, trusted for 1 s beyond it.
POLICY = (
    "scheduler: {mode: 'off'}\n"
    "realtimeCheck:\n"
    "  maxSampleAge: 1s\n"
    "  nodeStatus: {minInterval: 500ms, refreshInterval: 2s}\n"
)


@dataclass
class Node:
    name: str
    state: Path  # the fake NVML's view of this node's GPU
    daemon: RunningDaemon

    def in_use(self, used: int, processes: int) -> None:
        self.state.write_text(f"0 {used} {processes} 90\n")


@dataclass
class Cluster:
    api: FakeApiServer
    nodes: dict[str, Node]
    extender: ExtenderClient
    extender_log: Path

    def published(self, node: str) -> int | None:
        """Used memory of the node's GPU as its annotation says, or None."""
        text = (self.api.get("nodes", node)["metadata"].get("annotations") or {}).get(ANNOTATION)
        return None if text is None else decode(text).gpus[0].memory_used


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    subprocess.run(["make", "-s", "-C", str(ROOT / "ld_hook")], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="nvs-rt-"))
    api = FakeApiServer().start()
    api.load_rbac(list(manifests.rendered()))
    nodes: dict[str, Node] = {}
    extender: subprocess.Popen[bytes] | None = None
    try:
        for name in ("gpu-a", "gpu-b"):
            api.add_node(name)
            home = tmp / name
            home.mkdir()
            state = home / "nvml-state"
            state.write_text("")
            env = {
                "KUBECONFIG": api.write_kubeconfig(
                    home / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
                ),
                "LD_LIBRARY_PATH": str(FAKE),
                "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
                "NVSHARE_FAKE_NVML_STATE": str(state),
            }
            daemon = start_daemon(home, POLICY, args=["--node-name", name], extra_env=env)
            nodes[name] = Node(name, state, daemon)
        policy = tmp / "extender-policy"
        policy.mkdir()
        (policy / "policy.yaml").write_text(POLICY)  # realtimeCheck.mode: disabled there
        port = free_port()
        log = tmp / "extender.log"
        env = {
            **os.environ,
            "KUBECONFIG": api.write_kubeconfig(
                tmp / "extender.kubeconfig",
                namespace="nvshare-system",
                service_account="nvshare-extender",
            ),
            "HAMI_ENABLE_REALTIME_CHECK": "true",
        }
        with log.open("w") as out:
            extender = subprocess.Popen(
                [
                    str(BIN / "nvshare-scheduler"),
                    "extender",
                    f"--port={port}",
                    "--host=127.0.0.1",
                    f"--policy-dir={policy}",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        client = ExtenderClient(port)

        def ready() -> bool:
            assert extender is not None and extender.poll() is None, log.read_text()
            try:
                return client.get("/readyz") == 200
            except OSError:
                client.conn.close()
                return False

        eventually(ready, "the extender serving with its caches listed")
        yield Cluster(api, nodes, client, log)
        client.close()
    finally:
        if extender is not None and extender.poll() is None:
            extender.send_signal(signal.SIGTERM)
            extender.wait(10)
        for node in nodes.values():
            node.daemon.stop()
        api.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_gpu_filled_outside_the_hook_is_filtered_out_until_it_is_free(
    cluster: Cluster,
) -> None:
    eventually(lambda: cluster.published("gpu-a") == 0, "gpu-a publishes its idle GPU")
    eventually(lambda: cluster.published("gpu-b") == 0, "gpu-b publishes its idle GPU")
    pod = gpu_pod(annotations={"nvshare.com/gpu-memory-limit": "4Gi"})
    body = args(pod, ["gpu-a", "gpu-b"])
    assert cluster.extender.filter(body)["NodeNames"] == ["gpu-a", "gpu-b"]

    cluster.nodes["gpu-a"].in_use(15 * GiB, processes=1)  # a process nobody manages
    eventually(lambda: cluster.published("gpu-a") == 15 * GiB, "gpu-a publishes the process")
    eventually(  # the extender's watch delivers it
        lambda: cluster.extender.filter(body)["NodeNames"] == ["gpu-b"], "gpu-a filtered out"
    )
    result = cluster.extender.filter(body)
    assert "1 compute process)" in result["FailedNodes"]["gpu-a"]
    assert cluster.extender.prioritize(body) == {"gpu-a": 0, "gpu-b": 10}

    cluster.nodes["gpu-a"].in_use(0, processes=0)  # the process exits
    eventually(lambda: cluster.published("gpu-a") == 0, "gpu-a publishes the freed GPU")
    eventually(
        lambda: cluster.extender.filter(body)["NodeNames"] == ["gpu-a", "gpu-b"],
        "gpu-a accepted again",
    )
    log = cluster.extender_log.read_text()
    assert "Real-time check failed node=gpu-a" in log and "requested=4096MiB" in log
    assert "Traceback" not in log


def test_a_node_whose_daemon_died_falls_back_with_the_log_line(cluster: Cluster) -> None:
    eventually(lambda: cluster.published("gpu-b") == 0, "gpu-b publishes")
    cluster.nodes["gpu-b"].daemon.proc.kill()  # no goodbye: its annotation just ages
    body = args(gpu_pod(annotations={"nvshare.com/gpu-memory-limit": "4Gi"}), ["gpu-b"])

    def fell_back() -> bool:
        cluster.extender.filter(body)
        return "using cached data node=gpu-b" in cluster.extender_log.read_text()

    eventually(fell_back, "the extender notices gpu-b's status went stale")
    line = next(
        x for x in cluster.extender_log.read_text().splitlines() if "using cached data" in x
    )
    assert "Failed to get real-time usage, using cached data node=gpu-b gpu=GPU-" in line
    assert "error=GPU status sampled" in line
    assert cluster.extender.filter(body)["NodeNames"] == ["gpu-b"]  # 16 GiB cached, fits
