"""The node daemon's GPU status publisher against the fake API server, under deploy/'s RBAC.

It writes as the nvshare-node service account, whose ClusterRole the fake API server enforces;
what it wrote is read back with the real kubectl, as an operator would.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fakeapi import FakeApiServer
from kubernetes import client
from prometheus_client import CollectorRegistry

from appliance.core.gpus import GpuFacts
from appliance.gpu.nvml import GpuSample
from appliance.kube.node_status import NodeStatusPublisher
from appliance.placement.status import ANNOTATION, decode
from appliance.policy.load import load_policy_dir
from appliance.policy.model import NodeStatusSettings

ROOT = Path(__file__).resolve().parents[2]

GiB = 1 << 30
MiB = 1 << 20
UUID = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
INVENTORY = [GpuFacts(UUID, 0, "NVIDIA H100 80GB HBM3", 80 * GiB)]
SETTINGS = NodeStatusSettings(
    min_interval_s=5.0, refresh_interval_s=60.0, memory_change_bytes=256 * MiB
)
WAIT = 20.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(
    used: int, *, processes: int = 1, uuid: str = UUID, at: float | None = None
) -> list[GpuSample]:
    """One NVML sample of one 80 GiB GPU, taken now unless `at` says when."""
    return [
        GpuSample(
            uuid=uuid,
            memory_total=80 * GiB,
            memory_used=used,
            memory_free=80 * GiB - used,
            utilization_percent=90,
            healthy=True,
            time=time.time() if at is None else at,
            compute_processes=processes,
        )
    ]


def publisher(
    make: Callable[[str], client.ApiClient],
    account: str = "nvshare-node",
    clock: Callable[[], float] | None = None,
) -> tuple[NodeStatusPublisher, CollectorRegistry]:
    registry = CollectorRegistry()
    return (
        NodeStatusPublisher(
            api_client=make(account),
            node_name="gpu-1",
            inventory=INVENTORY,
            settings=SETTINGS,
            registry=registry,
            clock=clock or Clock(),
        ),
        registry,
    )


def patches(api: FakeApiServer) -> int:
    return sum(1 for m, path, _ in api.requests if m == "PATCH" and path.endswith("/nodes/gpu-1"))


@pytest.fixture
def node(fake_api: FakeApiServer) -> FakeApiServer:
    fake_api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"})
    fake_api.update(
        "nodes",
        "gpu-1",
        lambda n: {**n, "metadata": {**n["metadata"], "annotations": {"kept": "yes"}}},
    )
    return fake_api


def test_the_status_lands_on_the_node_and_kubectl_reads_it(
    node: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    pub, registry = publisher(service_account_client)
    pub.consider(sample(70 * GiB), SETTINGS)
    written = node.get("nodes", "gpu-1")
    meta = written["metadata"]
    assert meta["annotations"]["kept"] == "yes"  # a merge patch of one key, nothing else
    assert meta["labels"] == {"nvidia.com/gpu.present": "true"}
    status = decode(meta["annotations"][ANNOTATION])
    (gpu,) = status.gpus
    assert (status.node, gpu.uuid, gpu.model) == ("gpu-1", UUID, "NVIDIA H100 80GB HBM3")
    assert (gpu.memory_used, gpu.memory_free, gpu.compute_processes) == (70 * GiB, 10 * GiB, 1)
    assert registry.get_sample_value("nvshare_node_status_publishes_total", {"reason": "first"})
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed; the annotation was checked through the API")
    shown = subprocess.run(
        [
            "kubectl",
            f"--server={node.url}",
            "get",
            "node",
            "gpu-1",
            "-o",
            r"jsonpath={.metadata.annotations.nvshare\.com/gpu-status}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "KUBECONFIG": "/dev/null"},
    )
    assert json.loads(shown.stdout)["gpus"][0]["memoryUsedMiB"] == 70 * 1024


def test_the_api_server_sees_few_writes(
    node: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    clock = Clock()
    pub, registry = publisher(service_account_client, clock=clock)
    for second in range(300):  # five minutes of one sample a second, jittering by 100 MiB
        clock.now += 1
        pub.consider(sample(40 * GiB + (second % 2) * 100 * MiB), SETTINGS)
    # The first write, then only refreshes: one a minute.
    assert patches(node) == 1 + 4
    assert registry.get_sample_value("nvshare_node_status_publishes_total", {"reason": "refresh"})
    clock.now += 1
    pub.consider(sample(79 * GiB, processes=2), SETTINGS)  # a process outside the hook arrives
    assert patches(node) == 6
    assert decode(node.get("nodes", "gpu-1")["metadata"]["annotations"][ANNOTATION]).gpus[
        0
    ].memory_used == (79 * GiB)


def test_a_refused_write_is_counted_said_once_and_retried_at_min_interval(
    node: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    # The webhook's account may read nodes but not patch them: the fake API server says 403.
    pub, registry = publisher(service_account_client, "nvshare-webhook", clock)
    with caplog.at_level(logging.INFO, logger="nvshare.node_status"):
        for _ in range(12):
            clock.now += 1
            pub.consider(sample(GiB), SETTINGS)
        assert patches(node) == 3  # at 1 s, 6 s and 11 s: never closer than minInterval
        assert registry.get_sample_value("nvshare_node_status_publish_failures_total") == 3
        (said,) = [r.getMessage() for r in caplog.records]
        assert "HTTP 403" in said and "needs `patch` on nodes" in said
        node.load_rbac(  # the operator fixes RBAC
            [
                {
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": "fix"},
                    "roleRef": {"kind": "ClusterRole", "name": "nvshare-node"},
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "name": "nvshare-webhook",
                            "namespace": "nvshare-system",
                        }
                    ],
                }
            ]
        )
        clock.now += 5
        pub.consider(sample(GiB), SETTINGS)
    assert ANNOTATION in node.get("nodes", "gpu-1")["metadata"]["annotations"]
    assert "published again" in caplog.records[-1].getMessage()


def test_the_publisher_thread_writes_what_it_is_offered_and_stops(
    node: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    pub, _ = publisher(service_account_client)
    pub.start()
    try:
        pub.offer(sample(5 * GiB))
        done = threading.Event()
        for _ in range(int(WAIT / 0.01)):
            if ANNOTATION in (node.get("nodes", "gpu-1")["metadata"].get("annotations") or {}):
                done.set()
                break
            done.wait(0.01)
        assert done.is_set(), "the offered sample was never published"
    finally:
        pub.stop()
    assert not any(t.name == "node-status" for t in threading.enumerate())


def test_publishing_can_be_switched_off_by_policy(
    node: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    pub, _ = publisher(service_account_client)
    pub.consider(sample(GiB), NodeStatusSettings(publish=False))
    assert patches(node) == 0


def published_used(node: FakeApiServer) -> int | None:
    annotations = node.get("nodes", "gpu-1")["metadata"].get("annotations") or {}
    if ANNOTATION not in annotations:
        return None
    return decode(annotations[ANNOTATION]).gpus[0].memory_used


@pytest.mark.parametrize("sample_every", [1.0, 0.2])
def test_the_extenders_view_is_fresh_within_a_second_of_a_change_beyond_the_margin(
    node: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
    sample_every: float,
) -> None:
    """A fake NVML whose used memory moves by 30 MiB at every sample and now and then jumps by
    more than the 100 MB safety margin, sampled every `sample_every` seconds on a fake clock
    and offered as the daemon's sampler offers samples, under the shipped policy. Measured:
    how long the Node's status stays off by more than the margin (from the jump to the write
    that shows it), and the most writes within one second."""
    policy = load_policy_dir(ROOT / "configmaps" / "default", environ={}).realtime_check
    settings, margin = policy.published(), policy.safety_margin_bytes
    clock = Clock()
    pub, _ = publisher(service_account_client, clock=clock)
    start, end = clock.now, clock.now + 30.0
    jumps = {start + at: moved * MiB for at, moved in [(3.3, 150), (7.05, -120), (7.4, 110)]}
    jumps.update({start + at: moved * MiB for at, moved in [(12.9, 101), (13.1, -300)]})
    ticks = sorted({*jumps, *(start + k * sample_every for k in range(1, int(30 / sample_every)))})
    truth, jitter = 40 * GiB, 0
    held: tuple[float, list[GpuSample]] | None = None  # what the publisher's thread waits on
    off_since: float | None = None
    off_for: list[float] = []
    writes: list[float] = []

    def offer(samples: list[GpuSample]) -> None:
        nonlocal held
        before = patches(node)
        due = pub.consider(samples, settings)
        held = (due, samples) if due is not None else None
        if patches(node) > before:
            writes.append(clock.now)

    def look() -> None:
        nonlocal off_since
        shown = published_used(node)
        off = shown is not None and abs(shown - (truth + jitter)) > margin
        if off and off_since is None:
            off_since = clock.now
        elif not off and off_since is not None:
            off_for.append(clock.now - off_since)
            off_since = None

    for tick in ticks:
        while held is not None and held[0] < tick:  # the thread wakes for a held-back write
            clock.now = held[0]
            offer(held[1])
            look()
        clock.now = tick
        if tick in jumps:
            truth += jumps[tick]
        else:
            jitter = 30 * MiB - jitter
            offer(sample(truth + jitter, at=tick))
        look()
    assert off_since is None and len(off_for) >= 2  # the jumps were seen, and all were shown
    worst = max(off_for)
    assert worst <= 1.0, f"the Node was off by more than the margin for {worst:.2f}s"
    per_second = max(sum(1 for w in writes if t <= w < t + 1.0) for t in writes)
    assert per_second <= 2, f"{per_second} writes within one second"
    assert clock.now <= end
    print(
        f"sampled every {sample_every}s: off by more than the margin for at most {worst:.2f}s;"
        f" {len(writes)} writes, at most {per_second} within a second"
    )
