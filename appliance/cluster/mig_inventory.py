"""Free MIG devices per node, kept in memory by informers, so admission decides without a call.

Two informers (`cluster_cache.NodesAndBoundPods`): every node's allocatable MIG resources, and
every unfinished pod that asks for MIG devices, bound or not. Lists are paged (bounded memory
in a large cluster), then watched.

Why pending pods and the webhook's own admissions count: the pods of one ReplicaSet batch, a Job
burst or a `kubectl apply` of many pods are all admitted before the scheduler binds any of them.
Counting only bound pods, every one of them sees the same free devices and keeps its profile;
the surplus then pends on an exhausted profile while a fallback is free, which is what the
fallback exists to prevent. So a decision counts three kinds of claim:

* bound pods hold devices on their node;
* pending pods (seen by the informer, no node yet) will hold devices somewhere: they are placed
  on the nodes as a scheduler could place them (best fit, largest requests first), and a pod
  that fits nowhere holds nothing;
* pods this webhook admitted that the informer has not shown yet are claims too, from the
  admission on. The informer's first sight of a pod with the same origin (namespace, and its
  generateName or name) and the same devices takes that claim over; one whose pod never appears
  (a later webhook refused it, a quota) expires after `admission_ttl_s`.

A deleted pod frees what it held at once; a pod bound to a node moves its claim there.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.cluster.cluster_cache import NodesAndBoundPods
from appliance.cluster.webhook import MIG_RESOURCE_PREFIX, NotSynced, requested_mig_resources
from appliance.placement.resources import pod_request
from appliance.placement.resources import resource_count as _count

_TERMINATED_PHASES = frozenset({"Succeeded", "Failed"})
ADMISSION_TTL_S = 30.0  # far above the milliseconds from admission to the pod's watch event

Devices = tuple[tuple[str, int], ...]  # (resource name, count), sorted
Origin = tuple[str, str]  # (namespace, generateName or name)


@dataclass(frozen=True, slots=True)
class MigPod:
    """What the webhook keeps of an unfinished pod that asks for MIG devices."""

    node: str  # "" while the pod waits for the scheduler
    devices: Devices
    origin: Origin = ("", "")


@dataclass(frozen=True, slots=True)
class Admission:
    """A pod admitted by this webhook and not yet seen by its informer."""

    origin: Origin
    devices: Devices
    expires: float  # on the inventory's clock


def pod_origin(pod: Mapping[str, Any], namespace: str = "") -> Origin:
    """What an admitted pod and the pod the informer shows later have in common: the API
    server names a pod only after admission, so a generateName is all a ReplicaSet's or a
    Job's pod carries when it is admitted."""
    metadata = pod.get("metadata") or {}
    namespace = metadata.get("namespace") or namespace or "default"
    return (namespace, str(metadata.get("generateName") or metadata.get("name") or ""))


def pod_devices(pod: Mapping[str, Any]) -> Devices:
    return tuple(
        sorted((r, n) for r in requested_mig_resources(pod) if (n := pod_request(pod, r)) > 0)
    )


def mig_pod(pod: Mapping[str, Any]) -> MigPod | None:
    """The pod's MIG claim, or None for a finished pod or one that asks for none (most)."""
    if (pod.get("status") or {}).get("phase") in _TERMINATED_PHASES:
        return None
    devices = pod_devices(pod)
    if not devices:
        return None
    node = (pod.get("spec") or {}).get("nodeName") or ""
    return MigPod(node=node, devices=devices, origin=pod_origin(pod))


def node_mig_allocatable(node: Mapping[str, Any]) -> Devices:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return tuple(
        sorted(
            (name, _count(value))
            for name, value in allocatable.items()
            if name.startswith(MIG_RESOURCE_PREFIX)
        )
    )


def place_unbound(free: dict[str, dict[str, int]], demand: Mapping[str, Counter[int]]) -> None:
    """Take from `free` (node -> resource -> devices) what the unbound claims will hold.

    Per resource, the largest requests first, each on the node with the fewest free devices
    that still fit it (best fit keeps the large holes for later requests). Claims of one size
    are placed a node at a time, so the cost does not grow with the number of claims.
    """
    for resource, sizes in demand.items():
        for size in sorted(sizes, reverse=True):
            left = sizes[size]
            holders = sorted(
                (n for n in free if free[n].get(resource, 0) >= size),
                key=lambda n: free[n][resource],
            )
            for node in holders:
                if left <= 0:
                    break
                taken = min(left, free[node][resource] // size)
                free[node][resource] -= taken * size
                left -= taken


class MigInventory(NodesAndBoundPods[Devices, MigPod]):
    """Free MIG devices per node, after every claim, from two informers and the admissions.

    A resource counts as available when one node has `count` free (a pod cannot straddle
    nodes). Node selectors, affinities and taints are not considered: a fallback may still
    pend, as the original request would have.
    """

    # Pending pods too: they are claims on the devices of some node.
    POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"

    def __init__(
        self,
        *,
        api_client: Any,
        page_size: int = 500,
        clock: Callable[[], float] = time.monotonic,
        admission_ttl_s: float = ADMISSION_TTL_S,
        **informer_options: Any,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._ttl = admission_ttl_s
        self._allocatable: dict[str, dict[str, int]] = {}
        self._used: dict[str, dict[str, int]] = {}  # node -> resource -> held by bound pods
        self._pods: dict[str, MigPod] = {}  # pod uid -> its claim, bound or not
        self._admitted: dict[str, Admission] = {}  # admission uid -> claim, oldest first
        self._unbound: dict[str, Counter[int]] = {}  # resource -> request size -> claims
        super().__init__(
            api_client=api_client, name="webhook", page_size=page_size, **informer_options
        )

    def convert_node(self, node: Mapping[str, Any]) -> Devices:
        return node_mig_allocatable(node)

    def convert_pod(self, pod: Mapping[str, Any]) -> MigPod | None:
        return mig_pod(pod)

    def __call__(self, resource: str, count: int) -> bool:
        if not self.synced:
            raise NotSynced("the node and pod caches are still being listed")
        return any(free.get(resource, 0) >= count for free in self.free_per_node().values())

    def reserve(self, *, admission: str, pod: Mapping[str, Any], namespace: str = "") -> None:
        """Count `pod` (as admitted, after any rewrite) until the informer shows it."""
        devices = pod_devices(pod)
        if not devices:
            return
        claim = Admission(pod_origin(pod, namespace), devices, self._clock() + self._ttl)
        with self._lock:
            self._expire()
            if admission in self._admitted:  # the API server retried the same review
                self._claim(self._admitted.pop(admission).devices, -1)
            self._admitted[admission] = claim
            self._claim(devices, +1)

    def free_per_node(self) -> dict[str, dict[str, int]]:
        """Devices free per node once every bound, pending and just-admitted pod has its own."""
        with self._lock:
            self._expire()
            free = {
                node: {r: n - self._used.get(node, {}).get(r, 0) for r, n in allocatable.items()}
                for node, allocatable in self._allocatable.items()
            }
            place_unbound(free, self._unbound)
        return free

    def admissions_pending(self) -> int:
        """Admitted pods the informer has not shown yet (and whose claim has not expired)."""
        with self._lock:
            self._expire()
            return len(self._admitted)

    def node_set(self, name: str, allocatable: Devices) -> None:
        with self._lock:
            if allocatable:
                self._allocatable[name] = dict(allocatable)
            else:
                self._allocatable.pop(name, None)

    def node_gone(self, name: str, allocatable: Devices) -> None:
        self.node_set(name, ())

    def pod_set(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            old = self._pods.get(uid)
            if old is None:
                self._take_over_admission(pod)
            else:
                self._forget(old)
            self._pods[uid] = pod
            self._count(pod)

    def pod_gone(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            old = self._pods.pop(uid, None)
            if old is not None:
                self._forget(old)

    # ---- under the lock

    def _take_over_admission(self, pod: MigPod) -> None:
        for key, claim in self._admitted.items():
            if claim.origin == pod.origin and claim.devices == pod.devices:
                del self._admitted[key]
                self._claim(claim.devices, -1)
                return

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, c in self._admitted.items() if c.expires <= now]:
            self._claim(self._admitted.pop(key).devices, -1)

    def _count(self, pod: MigPod) -> None:
        if pod.node:
            self._hold(pod, +1)
        else:
            self._claim(pod.devices, +1)

    def _forget(self, pod: MigPod) -> None:
        if pod.node:
            self._hold(pod, -1)
        else:
            self._claim(pod.devices, -1)

    def _claim(self, devices: Devices, sign: int) -> None:
        for resource, count in devices:
            sizes = self._unbound.setdefault(resource, Counter())
            sizes[count] += sign
            if sizes[count] <= 0:
                del sizes[count]
            if not sizes:
                del self._unbound[resource]

    def _hold(self, pod: MigPod, sign: int) -> None:
        used = self._used.setdefault(pod.node, {})
        for resource, count in pod.devices:
            used[resource] = used.get(resource, 0) + sign * count
            if used[resource] == 0:
                del used[resource]
        if not used:
            del self._used[pod.node]
