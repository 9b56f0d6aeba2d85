"""Free MIG devices per node, kept in memory by informers, so admission decides without a call.

Two informers (`informer.NodesAndBoundPods`): every node's allocatable MIG resources, and the
bound, unfinished pods that hold MIG devices. Lists are paged (bounded memory in a large
cluster), then watched.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.kube.cluster_cache import NodesAndBoundPods
from appliance.kube.resources import pod_request
from appliance.kube.resources import resource_count as _count
from appliance.kube.webhook import MIG_RESOURCE_PREFIX, NotSynced, requested_mig_resources

_TERMINATED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class MigPod:
    """What the webhook keeps of a bound, unfinished pod that holds MIG devices."""

    node: str
    devices: tuple[tuple[str, int], ...]  # (resource name, count)


def mig_pod(pod: Mapping[str, Any]) -> MigPod | None:
    """The pod's MIG holdings, or None for a pod that holds none (most pods)."""
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if not node or (pod.get("status") or {}).get("phase") in _TERMINATED_PHASES:
        return None
    devices = tuple((r, pod_request(pod, r)) for r in requested_mig_resources(pod))
    return MigPod(node=node, devices=devices) if devices else None


def node_mig_allocatable(node: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return tuple(
        sorted(
            (name, _count(value))
            for name, value in allocatable.items()
            if name.startswith(MIG_RESOURCE_PREFIX)
        )
    )


class MigInventory(NodesAndBoundPods[tuple[tuple[str, int], ...], MigPod]):
    """Free MIG devices per node, from two informers, so admission decides from memory.

    Nodes: every node's allocatable MIG resources. Pods: only bound, unfinished pods, and of
    those only the ones holding MIG devices are kept. A resource counts as available when one
    node has `count` free (a pod cannot straddle nodes). Node selectors, affinities and taints
    are not considered: a fallback may still pend, as the original request would have.
    """

    def __init__(self, *, api_client: Any, page_size: int = 500, **informer_options: Any) -> None:
        self._lock = threading.Lock()
        self._allocatable: dict[str, dict[str, int]] = {}
        self._used: dict[str, dict[str, int]] = {}  # node -> resource -> held by pods
        self._held: dict[str, MigPod] = {}  # pod uid -> what it holds
        super().__init__(
            api_client=api_client, name="webhook", page_size=page_size, **informer_options
        )

    def convert_node(self, node: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        return node_mig_allocatable(node)

    def convert_pod(self, pod: Mapping[str, Any]) -> MigPod | None:
        return mig_pod(pod)

    def __call__(self, resource: str, count: int) -> bool:
        if not self.synced:
            raise NotSynced("the node and pod caches are still being listed")
        with self._lock:
            return any(
                allocatable.get(resource, 0) - self._used.get(node, {}).get(resource, 0) >= count
                for node, allocatable in self._allocatable.items()
            )

    def free_per_node(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                node: {r: n - self._used.get(node, {}).get(r, 0) for r, n in allocatable.items()}
                for node, allocatable in self._allocatable.items()
            }

    def node_set(self, name: str, allocatable: tuple[tuple[str, int], ...]) -> None:
        with self._lock:
            if allocatable:
                self._allocatable[name] = dict(allocatable)
            else:
                self._allocatable.pop(name, None)

    def node_gone(self, name: str, allocatable: tuple[tuple[str, int], ...]) -> None:
        self.node_set(name, ())

    def pod_set(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            old = self._held.get(uid)
            if old is not None:
                self._hold(old, -1)
            self._held[uid] = pod
            self._hold(pod, +1)

    def pod_gone(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            if self._held.pop(uid, None) is not None:
                self._hold(pod, -1)

    def _hold(self, pod: MigPod, sign: int) -> None:
        used = self._used.setdefault(pod.node, {})
        for resource, count in pod.devices:
            used[resource] = used.get(resource, 0) + sign * count
            if used[resource] == 0:
                del used[resource]
        if not used:
            del self._used[pod.node]
