"""Nodes and the pods bound to them, cached by two informers: what the cluster-side servers (the
MIG-fallback webhook, the scheduler extender) decide from, without a call per request."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from kubernetes import client

from appliance.kube.access import Permissions
from appliance.kube.informer import Informer, Obj

N = TypeVar("N")
P = TypeVar("P")


class NodesAndBoundPods(Generic[N, P]):
    """Every Node (by name) and every bound, unfinished Pod (by UID), each in an Informer.

    What the cluster-side services decide from (the webhook: MIG devices; the extender: GPU
    status and what pods need). Both are listed in pages (memory stays bounded in a large
    cluster), then watched; the pods are selected by the API server
    (`spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed`). Subclasses reduce the
    objects with `convert_node` / `convert_pod` and follow changes in the `*_set` / `*_gone`
    hooks, which run on the informers' threads.
    """

    POD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"

    def __init__(
        self,
        *,
        api_client: Any,
        name: str,
        page_size: int = 500,
        permissions: Permissions | None = None,
        **informer_options: Any,
    ) -> None:
        core = client.CoreV1Api(api_client)
        self.permissions = permissions or Permissions(api_client)
        self.nodes: Informer[N] = Informer(
            name=f"{name} node cache",
            list_call=core.list_node,
            convert=self.convert_node,
            key=lambda obj: str((obj.get("metadata") or {}).get("name", "")),
            on_set=self.node_set,
            on_delete=self.node_gone,
            page_size=page_size,
            resource="nodes",
            permissions=self.permissions,
            **informer_options,
        )
        self.pods: Informer[P] = Informer(
            name=f"{name} pod cache",
            list_call=core.list_pod_for_all_namespaces,
            convert=self.convert_pod,
            on_set=self.pod_set,
            on_delete=self.pod_gone,
            field_selector=self.POD_SELECTOR,
            page_size=page_size,
            resource="pods",
            permissions=self.permissions,
            **informer_options,
        )

    def convert_node(self, node: Obj) -> N | None:
        raise NotImplementedError

    def convert_pod(self, pod: Obj) -> P | None:
        raise NotImplementedError

    def node_set(self, name: str, value: N) -> None:
        pass

    def node_gone(self, name: str, value: N) -> None:
        pass

    def pod_set(self, uid: str, value: P) -> None:
        pass

    def pod_gone(self, uid: str, value: P) -> None:
        pass

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()
        self.permissions.stop()

    @property
    def synced(self) -> bool:
        """True once both have delivered their first list."""
        return self.nodes.synced.is_set() and self.pods.synced.is_set()

    def not_ready(self) -> list[str]:
        """Why decisions cannot be made from the caches yet, for /readyz."""
        reasons = [f"RBAC forbids {p}" for p in self.permissions.missing()]
        for informer in (self.nodes, self.pods):
            if not informer.synced.is_set():
                reasons.append(f"the {informer.name} has not listed yet")
        return reasons

    def unhealthy(self) -> list[str]:
        """What only a restart mends, for /healthz: a cache whose thread has died."""
        return [
            f"the {informer.name} stopped following the API server (its thread died)"
            for informer in (self.nodes, self.pods)
            if informer.started and not informer.alive
        ]
