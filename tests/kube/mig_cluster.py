"""Seed 004's two-node MIG cluster on the fake API server, and the parts of Kubernetes that make
and place its pods: the Deployment, ReplicaSet and Job controllers (`Controllers`, creating pods
through the API, so admission runs, in the slow-start batches the real ones use), a binder
(kube-scheduler's binding, reduced to counting MIG devices) and a kubelet that runs nothing
(a Job's pod succeeds a moment after it is bound).

Nodes look the way fake-gpu-operator makes them look: labels naming the simulated GPU and node
pool, and MIG devices as extended resources in capacity and allocatable (mixed strategy).
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fakeapi import FakeApiServer
from kubernetes import client

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


def _owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    uid = owner["metadata"]["uid"]
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def _owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _template_hash(template: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
    return digest[:10]


class Controllers:
    """The Deployment, ReplicaSet and Job controllers, reduced to creating pods, and a kubelet.

    A Deployment gets one ReplicaSet (`<name>-<template hash>`); a ReplicaSet, and a Job up to
    its parallelism, get their missing pods in slow-start batches (1, 2, 4, ... each batch
    concurrent), created through the API server as the real controllers do, so every pod
    passes mutating admission. A Job's pod succeeds `job_run_s` after it is bound, and the Job
    completes when `completions` pods have. Scaling down, rollouts and pod deletion are not
    simulated.
    """

    def __init__(
        self, fake_api: FakeApiServer, *, interval_s: float = 0.05, job_run_s: float = 1.0
    ) -> None:
        self.fake_api = fake_api
        self.interval_s = interval_s
        self.job_run_s = job_run_s
        cfg = client.Configuration(host=fake_api.url)
        cfg.connection_pool_maxsize = 32
        self._api = client.ApiClient(cfg)
        self._core = client.CoreV1Api(self._api)
        self._running_since: dict[str, float] = {}  # job pod uid -> when first seen bound
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches: dict[str, list[int]] = {}  # owner name -> slow-start batch sizes

    def start(self) -> Controllers:
        self._thread = threading.Thread(target=self._run, name="controllers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._api.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile()
            except Exception as exc:  # a controller retries, as the real ones do
                print(f"controllers: {type(exc).__name__}: {exc}; retrying", flush=True)

    def _objects(self, plural: str) -> list[dict[str, Any]]:
        store = self.fake_api.store
        with store.cond:
            return [copy.deepcopy(o) for k, o in store.objects.items() if k[0] == plural]

    def reconcile(self) -> None:
        for deployment in self._objects("deployments"):
            self._deployment(deployment)
        pods = self._objects("pods")
        for replicaset in self._objects("replicasets"):
            mine = [p for p in pods if _owned_by(p, replicaset)]
            self._create(replicaset, replicaset["spec"]["replicas"] - len(mine))
        for job in self._objects("jobs"):
            self._job(job, [p for p in pods if _owned_by(p, job)])

    def _deployment(self, deployment: dict[str, Any]) -> None:
        spec = deployment["spec"]
        pod_hash = _template_hash(spec["template"])
        name = f"{deployment['metadata']['name']}-{pod_hash}"
        namespace = deployment["metadata"]["namespace"]
        if not any(
            r["metadata"]["name"] == name and r["metadata"]["namespace"] == namespace
            for r in self._objects("replicasets")
        ):
            template = copy.deepcopy(spec["template"])
            template["metadata"].setdefault("labels", {})["pod-template-hash"] = pod_hash
            self.fake_api.store.create(
                "replicasets",
                namespace,
                {
                    "metadata": {
                        "name": name,
                        "labels": dict(template["metadata"]["labels"]),
                        "ownerReferences": [_owner_reference(deployment)],
                    },
                    "spec": {
                        "replicas": spec.get("replicas", 1),
                        "selector": spec["selector"],
                        "template": template,
                    },
                },
            )
        owned = [
            p
            for p in self._objects("pods")
            if (p["metadata"].get("labels") or {}).get("pod-template-hash") == pod_hash
        ]
        ready = sum(1 for p in owned if p["status"].get("phase") == "Running")
        status = {"replicas": len(owned), "readyReplicas": ready, "availableReplicas": ready}
        if deployment.get("status") != status:
            self.fake_api.update(
                "deployments",
                deployment["metadata"]["name"],
                lambda o: {**o, "status": status},
                namespace=namespace,
            )

    def _job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        spec = job["spec"]
        parallelism = spec.get("parallelism", 1)
        completions = spec.get("completions", parallelism)
        now = time.monotonic()
        for pod in pods:  # the kubelet: a bound pod of a Job runs a moment, then succeeds
            if pod["spec"].get("nodeName") and pod["status"].get("phase") == "Running":
                since = self._running_since.setdefault(pod["metadata"]["uid"], now)
                if now - since >= self.job_run_s:
                    self.fake_api.update(
                        "pods",
                        pod["metadata"]["name"],
                        lambda o: {**o, "status": {**o["status"], "phase": "Succeeded"}},
                        namespace=pod["metadata"]["namespace"],
                    )
                    pod["status"]["phase"] = "Succeeded"
        succeeded = sum(1 for p in pods if p["status"].get("phase") == "Succeeded")
        active = sum(1 for p in pods if p["status"].get("phase") in ("Pending", "Running"))
        if succeeded < completions:
            self._create(job, min(parallelism, completions - succeeded) - active)
        status: dict[str, Any] = {"active": active, "succeeded": succeeded}
        if succeeded >= completions:
            status["conditions"] = [{"type": "Complete", "status": "True"}]
        if job.get("status") != status:
            self.fake_api.update(
                "jobs",
                job["metadata"]["name"],
                lambda o: {**o, "status": status},
                namespace=job["metadata"]["namespace"],
            )

    def _create(self, owner: dict[str, Any], missing: int) -> None:
        if missing <= 0:
            return
        template = owner["spec"]["template"]
        labels = dict(template["metadata"].get("labels") or {})
        if owner["kind"] == "Job":
            labels.update({"job-name": owner["metadata"]["name"]})
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{owner['metadata']['name']}-",
                "labels": labels,
                "ownerReferences": [_owner_reference(owner)],
            },
            "spec": copy.deepcopy(template["spec"]),
        }
        namespace = owner["metadata"]["namespace"]
        sizes = slow_start(
            missing, lambda: self._core.create_namespaced_pod(namespace, copy.deepcopy(body))
        )
        self.batches.setdefault(owner["metadata"]["name"], []).extend(sizes)
