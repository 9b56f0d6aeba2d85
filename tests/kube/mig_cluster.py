"""Seed 004's two-node MIG cluster on the fake API server, and the parts of Kubernetes that place
its pods: a binder (kube-scheduler's binding, reduced to counting MIG devices) and the slow-start
batches in which the ReplicaSet and Job controllers create pods.

Nodes look the way fake-gpu-operator makes them look: labels naming the simulated GPU and node
pool, and MIG devices as extended resources in capacity and allocatable (mixed strategy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fakeapi import FakeApiServer

MIG = "nvidia.com/mig-"
# name -> (node pool, MIG devices): 4 H200 cards each, partitioned as the seed says.
SEED_004_NODES = {
    "gpu-sim-small": ("small", {"1g.10gb": 28}),
    "gpu-sim-medium": ("medium", {"2g.20gb": 12, "1g.10gb": 4}),
}


def add_seed_004_nodes(fake_api: FakeApiServer) -> None:
    for name, (pool, devices) in SEED_004_NODES.items():
        resources = {MIG + profile: str(n) for profile, n in devices.items()}
        resources.update(cpu="16", memory="64Gi", pods="110")
        fake_api.add_node(
            name,
            labels={
                "run.ai/simulated-gpu-node-pool": pool,
                "nvidia.com/gpu.product": "NVIDIA-H200",
                "nvidia.com/gpu.count": "4",
                "nvidia.com/mig.strategy": "mixed",
            },
            status={
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        )


def gpu_pod(profile: str = "2g.20gb", *, generate_name: str = "gpu-test-") -> dict[str, Any]:
    """A pod as a Deployment's template makes it: a generateName, one MIG device."""
    amount = {MIG + profile: "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": generate_name, "labels": {"app": "gpu-test"}},
        "spec": {
            "containers": [
                {
                    "name": "cuda",
                    "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                    "resources": {"limits": dict(amount), "requests": dict(amount)},
                }
            ]
        },
    }


def mig_requests(pod: dict[str, Any]) -> dict[str, int]:
    total: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            if name.startswith(MIG):
                total[name] = total.get(name, 0) + int(value)
    return total


def pods_by_state(fake_api: FakeApiServer) -> dict[str, list[dict[str, Any]]]:
    """`{"bound": [...], "pending": [...]}` of the pods asking for MIG devices."""
    with fake_api.store.cond:
        pods = [o for (plural, _, _), o in fake_api.store.objects.items() if plural == "pods"]
    state: dict[str, list[dict[str, Any]]] = {"bound": [], "pending": []}
    for pod in pods:
        if mig_requests(pod):
            state["bound" if pod["spec"].get("nodeName") else "pending"].append(pod)
    return state


class Binder:
    """Binds pending pods to a node with their MIG devices free, as kube-scheduler would.

    Pods are taken oldest first; a pod that fits nowhere stays Pending, which is what a real
    cluster shows. `bind_pending` runs once; `start` runs it every `interval_s` on a thread.
    """

    def __init__(self, fake_api: FakeApiServer, *, interval_s: float = 0.02) -> None:
        self.fake_api = fake_api
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bind_pending(self) -> int:
        fake = self.fake_api
        bound = 0
        with fake.store.cond:
            nodes = {
                key[2]: {
                    r: int(v)
                    for r, v in ((o.get("status") or {}).get("allocatable") or {}).items()
                    if r.startswith(MIG)
                }
                for key, o in fake.store.objects.items()
                if key[0] == "nodes"
            }
            pods = sorted(
                (o for key, o in fake.store.objects.items() if key[0] == "pods"),
                key=lambda o: int(o["metadata"]["resourceVersion"]),
            )
            for pod in pods:
                node = pod["spec"].get("nodeName")
                if node in nodes and pod.get("status", {}).get("phase") not in (
                    "Succeeded",
                    "Failed",
                ):
                    for r, n in mig_requests(pod).items():
                        nodes[node][r] = nodes[node].get(r, 0) - n
            for pod in pods:
                wants = mig_requests(pod)
                if pod["spec"].get("nodeName") or not wants:
                    continue
                fits = [
                    n
                    for n, free in nodes.items()
                    if all(free.get(r, 0) >= c for r, c in wants.items())
                ]
                if not fits:
                    continue
                for r, c in wants.items():
                    nodes[fits[0]][r] -= c
                fake.update(
                    "pods",
                    pod["metadata"]["name"],
                    lambda o, node=fits[0]: _bound(o, node),
                    namespace=pod["metadata"]["namespace"],
                )
                bound += 1
        return bound

    def start(self) -> Binder:
        self._thread = threading.Thread(target=self._run, name="binder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.bind_pending()


def _bound(pod: dict[str, Any], node: str) -> dict[str, Any]:
    pod["spec"]["nodeName"] = node
    pod["status"] = {**(pod.get("status") or {}), "phase": "Running"}
    return pod


def slow_start(count: int, create: Callable[[], object]) -> list[int]:
    """Call `create` `count` times as the ReplicaSet and Job controllers do (slowStartBatch):
    batches of 1, 2, 4, 8, ... each created concurrently, the next when the last is done.
    Returns the batch sizes."""
    batches: list[int] = []
    size, left = 1, count
    with ThreadPoolExecutor(max_workers=count or 1) as pool:
        while left > 0:
            batch = min(size, left)
            for future in [pool.submit(create) for _ in range(batch)]:
                future.result()
            batches.append(batch)
            left -= batch
            size *= 2
    return batches
