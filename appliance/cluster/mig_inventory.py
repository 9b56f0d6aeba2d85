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

With several replicas (`ledger`), their admissions are shared through
`appliance.cluster.admission_ledger` instead: each decision counts every replica's claims not yet
shown by the informer (the pod carries its admission's uid, `ADMISSION_ANNOTATION`). Where the
ledger cannot be used (RBAC, the API server) a replica decides from its own admissions, as a
single replica does, and says so in its log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.cluster.admission_ledger import AdmissionLedger, LedgerUnavailable, SharedClaim
from appliance.cluster.cluster_cache import NodesAndBoundPods
from appliance.cluster.webhook import (
    ADMISSION_ANNOTATION,
    MIG_RESOURCE_PREFIX,
    Decision,
    NotSynced,
    requested_mig_resources,
)
from appliance.placement.resources import pod_request
from appliance.placement.resources import resource_count as _count

log = logging.getLogger(__name__)

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
    admission: str = ""  # the review that admitted it, where a replica recorded it in the ledger


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
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    admission = str(annotations.get(ADMISSION_ANNOTATION) or "")
    return MigPod(node=node, devices=devices, origin=pod_origin(pod), admission=admission)


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
        ledger: AdmissionLedger | None = None,
        **informer_options: Any,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._ttl = admission_ttl_s
        self._ledger = ledger
        self._shown: Counter[str] = Counter()  # admission uid -> pods shown that carry it
        self._gone: dict[str, float] = {}  # admission uid -> when its pod went (clock)
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

    def admit(self, *, admission: str, namespace: str, decide: Decision) -> Mapping[str, str]:
        """Decide and hold what was admitted: in the shared ledger, else in this replica."""
        if self._ledger is not None:
            try:
                held = self._ledger.admit(
                    lambda claims: self._decide_with(claims, admission, decide),
                    seen=self._seen,
                )
            except LedgerUnavailable as exc:
                log.warning(
                    "MIG fallback: %s; this replica decides from its own admissions only", exc
                )
            else:
                return {ADMISSION_ANNOTATION: admission} if held else {}
        pod = decide(self)
        if pod is not None:
            self.reserve(admission=admission, pod=pod, namespace=namespace)
        return {}

    def _decide_with(
        self, claims: list[SharedClaim], admission: str, decide: Decision
    ) -> SharedClaim | None:
        # a review the API server sends again replaces its own claim
        others = [c.devices for c in claims if c.admission != admission]

        def available(resource: str, count: int) -> bool:
            if not self.synced:
                raise NotSynced("the node and pod caches are still being listed")
            free = self.free_per_node(claims=others).values()
            return any(f.get(resource, 0) >= count for f in free)

        pod = decide(available)
        devices = pod_devices(pod) if pod is not None else ()
        if not devices or self._ledger is None:
            return None
        now = self._ledger.now()
        return SharedClaim(admission, devices, now + self._ttl, admitted=now)

    def _seen(self, admission: str) -> bool:
        """Whether the informer shows (or lately showed) the pod of that admission."""
        with self._lock:
            self._expire()
            return self._shown[admission] > 0 or admission in self._gone

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

    def free_per_node(self, *, claims: Iterable[Devices] = ()) -> dict[str, dict[str, int]]:
        """Devices free per node once every bound, pending and just-admitted pod has its own,
        and `claims` (other replicas' admissions) too."""
        with self._lock:
            self._expire()
            free = {
                node: {r: n - self._used.get(node, {}).get(r, 0) for r, n in allocatable.items()}
                for node, allocatable in self._allocatable.items()
            }
            unbound = {r: Counter(sizes) for r, sizes in self._unbound.items()}
        for devices in claims:
            for resource, count in devices:
                unbound.setdefault(resource, Counter())[count] += 1
        place_unbound(free, unbound)
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
                if pod.admission:
                    self._shown[pod.admission] += 1
            else:
                self._forget(old)
            self._pods[uid] = pod
            self._count(pod)

    def pod_gone(self, uid: str, pod: MigPod) -> None:
        with self._lock:
            old = self._pods.pop(uid, None)
            if old is not None:
                self._forget(old)
                if old.admission:
                    self._shown[old.admission] -= 1
                    if self._shown[old.admission] <= 0:
                        del self._shown[old.admission]
                        self._gone[old.admission] = self._clock()  # its claim may linger

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
        for key in [k for k, t in self._gone.items() if t + self._ttl <= now]:
            del self._gone[key]  # past the ttl its claim has expired everywhere

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
