"""What the extender knows of the cluster, kept by informers: each Node's published GPU status
(`nvshare.com/gpu-status`, or why there is none) and the bound pods that hold GPU resources,
slimmed to what their need depends on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.cluster.cluster_cache import NodesAndBoundPods
from appliance.placement.demand import HAMI_GPUS, HAMI_MEMORY, pod_demand
from appliance.placement.fit import NodeView
from appliance.placement.resources import pod_request
from appliance.placement.status import ANNOTATION, NodeGpuStatus, StatusError, decode
from appliance.policy.model import Policy

log = logging.getLogger("nvshare.extender")

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A Node as the extender keeps it: its published status, or why there is none."""

    status: NodeGpuStatus | None
    error: str | None


def node_record(node: Obj) -> NodeRecord:
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(ANNOTATION)
    if text is None:
        return NodeRecord(None, f"no {ANNOTATION} annotation on the node")
    try:
        return NodeRecord(decode(str(text)), None)
    except StatusError as exc:
        return NodeRecord(None, f"{ANNOTATION} is unreadable: {exc}")


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A bound, unfinished pod holding GPU resources, slimmed to what its need depends on."""

    node: str
    pod: Obj


def bound_pod(pod: Obj) -> BoundPod | None:
    node = (pod.get("spec") or {}).get("nodeName") or ""
    wanted = ("nvshare.com/gpu", HAMI_GPUS, HAMI_MEMORY)
    if not node or not any(pod_request(pod, r) for r in wanted):
        return None
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    slim = {
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta
        },
        "spec": {
            kind: [{"resources": c.get("resources") or {}} for c in spec.get(kind) or []]
            for kind in ("containers", "initContainers")
        },
    }
    return BoundPod(node=str(node), pod=slim)


class ClusterView(NodesAndBoundPods[NodeRecord, BoundPod]):
    """Nodes' published GPU status and bound GPU pods, from two informers."""

    def __init__(self, *, api_client: Any, page_size: int = 500, **informer_options: Any) -> None:
        self._lock = threading.Lock()
        self._last_good: dict[str, NodeGpuStatus] = {}
        self._pods_by_node: dict[str, dict[str, Obj]] = {}
        self._where: dict[str, str] = {}  # pod uid -> node
        super().__init__(
            api_client=api_client, name="extender", page_size=page_size, **informer_options
        )

    def convert_node(self, node: Obj) -> NodeRecord:
        return node_record(node)

    def convert_pod(self, pod: Obj) -> BoundPod | None:
        return bound_pod(pod)

    def view(self, name: str, policy: Policy) -> NodeView:
        record = self.nodes.items().get(name)
        with self._lock:
            last_good = self._last_good.get(name)
            pods = list(self._pods_by_node.get(name, {}).values())
        bound = 0
        for pod in pods:
            demand = pod_demand(pod, policy)
            bound += (demand.memory_bytes or 0) * demand.gpus
        if record is None:
            return NodeView(name, None, "the node is not in the extender's cache", last_good, bound)
        return NodeView(name, record.status, record.error, last_good, bound)

    def node_set(self, name: str, record: NodeRecord) -> None:
        if record.status is not None:
            with self._lock:
                self._last_good[name] = record.status

    def node_gone(self, name: str, record: NodeRecord) -> None:
        with self._lock:
            self._last_good.pop(name, None)

    def pod_set(self, uid: str, pod: BoundPod) -> None:
        with self._lock:
            old = self._where.get(uid)
            if old is not None and old != pod.node:
                self._pods_by_node.get(old, {}).pop(uid, None)
            self._where[uid] = pod.node
            self._pods_by_node.setdefault(pod.node, {})[uid] = pod.pod

    def pod_gone(self, uid: str, pod: BoundPod) -> None:
        with self._lock:
            self._where.pop(uid, None)
            on_node = self._pods_by_node.get(pod.node, {})
            on_node.pop(uid, None)
            if not on_node:
                self._pods_by_node.pop(pod.node, None)


# ---------------------------------------------------------------- the extender
