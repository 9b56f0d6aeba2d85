"""The pods bound to this node, kept current by list-then-watch against the API server.

Annotation changes must reach the hooks in well under a second, so this is a watch, not a
poll: an `Informer` (see `informer.py`) of the pods with `spec.nodeName=<node>`, whose lists
are read whole from the API server's watch cache (`resourceVersion=0`; one node's pods are few,
and a relist must not cost an etcd read on every node at once after an API server restart).

`on_pod` fires when a pod appears or when what `PodInfo` carries (node, labels, annotations)
changes; status-only updates are not passed on. `on_pod_deleted` fires when it goes, including
a deletion that happened while the watch was down (found by the relist's diff); `on_listed`
after every full list, with the UIDs of all the node's pods. Callbacks run
on the watcher's thread, in API order; a callback that raises is logged and the watch goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kubernetes import client

from appliance.core.annotations import PodInfo, PodRef
from appliance.kube.access import Permissions
from appliance.kube.informer import Informer
from appliance.placement.resources import pod_info


class PodWatcher:
    """Watches the pods on `node_name` and calls back on every relevant change."""

    def __init__(
        self,
        *,
        api_client: client.ApiClient,
        node_name: str,
        on_pod: Callable[[PodInfo], None],
        on_pod_deleted: Callable[[PodRef], None],
        on_listed: Callable[[frozenset[str]], None] = lambda uids: None,
        bookmark: bool = True,
        watch_timeout_s: int = 300,
        inactivity_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        backoff: tuple[float, float] = (0.2, 10.0),
        permissions: Permissions | None = None,
    ) -> None:
        self._informer: Informer[PodInfo] = Informer(
            name=f"pod watch on node {node_name}",
            list_call=client.CoreV1Api(api_client).list_pod_for_all_namespaces,
            convert=pod_info,
            on_set=lambda uid, info: on_pod(info),
            on_delete=lambda uid, info: on_pod_deleted(info.ref),
            on_listed=on_listed,
            describe=lambda uid, info: f"pod {info.namespace}/{info.name}",
            field_selector=f"spec.nodeName={node_name}",
            resource="pods",
            permissions=permissions,
            page_size=None,  # from the watch cache
            bookmarks=bookmark,
            watch_timeout_s=watch_timeout_s,
            inactivity_timeout_s=inactivity_timeout_s,
            connect_timeout_s=connect_timeout_s,
            backoff=backoff,
        )

    @property
    def synced(self) -> threading.Event:
        """Set once the first list has been delivered."""
        return self._informer.synced

    @property
    def relists(self) -> int:
        """How many times it listed (the first list, and after each 410)."""
        return self._informer.relists

    @property
    def resource_version(self) -> str:
        """The last resourceVersion seen (list, event or bookmark)."""
        return self._informer.resource_version

    @property
    def alive(self) -> bool:
        """True while the watcher thread runs."""
        return self._informer.alive

    def pods(self) -> dict[str, PodInfo]:
        """A snapshot of the pods known now, by UID."""
        return self._informer.items()

    def start(self) -> None:
        self._informer.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching: cuts the open watch so the thread ends promptly."""
        self._informer.stop(timeout)
