"""The pods bound to this node, kept current by list-then-watch against the API server.

Annotation changes must reach the hooks in well under a second, so this is a watch, not a
poll. It is written against the client's low-level calls (raw JSON lines) rather than
`kubernetes.watch.Watch` because it must track the resourceVersion itself (from the list, from
every event and from every bookmark) and tell a 410 Gone apart from other failures:

* list (`fieldSelector=spec.nodeName=<node>`), remember each pod and the list's version;
* watch from that version with bookmarks; every event and bookmark advances the version;
* 410 Gone (an ERROR event or a 410 status): relist and diff against what was known, so a pod
  deleted while we were not watching is still reported deleted;
* any other failure: reconnect from the last version after exponential backoff with jitter;
* a watch that sends nothing for `inactivity_timeout_s` (a dead peer, a hung load balancer) is
  dropped and reopened; the API server sends bookmarks about once a minute, so silence longer
  than that means the connection is gone.

Callbacks run on the watcher's thread, in API order. `on_pod` fires when a pod appears or when
what `PodInfo` carries (node, labels, annotations) changes; status-only updates are not passed on.
A callback that raises is logged; the watch goes on.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import urllib3
from kubernetes import client, config

from appliance.core.pods import PodInfo, PodRef

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class _Gone(Exception):
    """The API server no longer has the history we asked for (HTTP 410)."""


def api_client_from_env(api_url: str | None = None) -> client.ApiClient:
    """An ApiClient for `api_url` if given, else in-cluster config, else the kubeconfig."""
    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return client.ApiClient(cfg)


def pod_info(obj: Mapping[str, Any]) -> PodInfo:
    """A PodInfo from a pod as the API serves it (JSON, camelCase)."""
    meta = obj.get("metadata") or {}
    return PodInfo(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=str((obj.get("spec") or {}).get("nodeName") or ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
    )


class PodWatcher:
    """Watches the pods on `node_name` and calls back on every relevant change."""

    def __init__(
        self,
        *,
        api_client: client.ApiClient,
        node_name: str,
        on_pod: Callable[[PodInfo], None],
        on_pod_deleted: Callable[[PodRef], None],
        bookmark: bool = True,
        watch_timeout_s: int = 300,  # the server ends each watch after 1-2x this
        inactivity_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        backoff: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._node = node_name
        self._on_pod = on_pod
        self._on_pod_deleted = on_pod_deleted
        self._bookmark = bookmark
        self._watch_timeout_s = watch_timeout_s
        self._timeouts = (connect_timeout_s, inactivity_timeout_s)
        self._backoff = backoff
        self._known: dict[str, PodInfo] = {}
        self._rv = ""
        self._stop = threading.Event()
        self._response: urllib3.HTTPResponse | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()
        self.relists = 0  # how many times it had to list again (first list, 410s, failures)

    @property
    def resource_version(self) -> str:
        """The last resourceVersion seen (list, event or bookmark)."""
        return self._rv

    @property
    def alive(self) -> bool:
        """True while the watcher thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def pods(self) -> dict[str, PodInfo]:
        """A snapshot of the pods known now, by UID."""
        with self._lock:
            return dict(self._known)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvshare-pod-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching: cuts the open watch so the thread ends promptly."""
        self._stop.set()
        with self._lock:
            resp = self._response
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - already closed or never connected
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop

    def _run(self) -> None:
        failures = 0
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._relist()
                    need_list = False
                opened = time.monotonic()
                if self._watch_once():
                    failures = 0
                elif time.monotonic() - opened < 1.0:  # empty and instant: do not spin
                    failures += 1
                    self._stop.wait(self._delay(failures))
            except _Gone:
                log.info("pod watch on node %s: history expired (410); listing again", self._node)
                need_list = True
                failures = 0
                continue
            except Exception as e:  # noqa: BLE001 - any failure means: back off, reconnect
                if self._stop.is_set():
                    break
                failures += 1
                delay = self._delay(failures)
                log.warning(
                    "pod watch on node %s failed (%s); retrying in %.2fs from resourceVersion %s",
                    self._node,
                    _describe(e),
                    delay,
                    self._rv or "(list)",
                )
                self._stop.wait(delay)

    def _delay(self, failures: int) -> float:
        """Exponential backoff with full jitter, never below half the base."""
        base, cap = self._backoff
        ceiling = min(cap, base * (2 ** (failures - 1)))
        return random.uniform(min(base / 2, ceiling), ceiling)

    def _relist(self) -> None:
        resp = cast(
            urllib3.HTTPResponse,
            self._api.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self._node}",
                _preload_content=False,
                _request_timeout=self._timeouts,
            ),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        current = {}
        for item in body.get("items") or []:
            info = pod_info(item)
            current[info.uid] = info
        with self._lock:
            before = dict(self._known)
        for uid, info in current.items():
            if before.get(uid) != info:
                self._remember(info)
                self._emit(info)
        for uid, old in before.items():
            if uid not in current:
                self._forget(uid)
                self._emit_deleted(old.ref)
        self._rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self.relists += 1
        self.synced.set()

    def _watch_once(self) -> bool:
        """One watch request until it ends; True if it delivered anything."""
        try:
            resp = cast(
                urllib3.HTTPResponse,
                self._api.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={self._node}",
                    watch=True,
                    resource_version=self._rv,
                    allow_watch_bookmarks=self._bookmark,
                    # spread reconnects after an API server restart, as client-go does
                    timeout_seconds=int(self._watch_timeout_s * random.uniform(1.0, 2.0)),
                    _preload_content=False,
                    _request_timeout=self._timeouts,
                ),
            )
        except client.ApiException as e:
            if e.status == 410:
                raise _Gone(str(e.reason)) from None
            raise
        with self._lock:
            self._response = resp
        delivered = False
        try:
            if self._stop.is_set():
                return False
            for line in _lines(resp):
                self._handle(json.loads(line))
                delivered = True
        finally:
            with self._lock:
                self._response = None
            resp.release_conn()
        return delivered

    def _handle(self, event: Obj) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone(obj.get("message", ""))
            raise RuntimeError(f"watch error from API server: {obj.get('message', obj)}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            info = pod_info(obj)
            with self._lock:
                changed = self._known.get(info.uid) != info
            if changed:
                self._remember(info)
                self._emit(info)
        elif kind == "DELETED":
            info = pod_info(obj)
            if self._forget(info.uid):
                self._emit_deleted(info.ref)
        if rv:  # BOOKMARK carries only this
            self._rv = str(rv)

    def _emit(self, info: PodInfo) -> None:
        try:
            self._on_pod(info)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the watch
            log.exception("on_pod callback failed for pod %s/%s", info.namespace, info.name)

    def _emit_deleted(self, ref: PodRef) -> None:
        try:
            self._on_pod_deleted(ref)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the watch
            log.exception("on_pod_deleted callback failed for pod %s", ref)

    def _remember(self, info: PodInfo) -> None:
        with self._lock:
            self._known[info.uid] = info

    def _forget(self, uid: str) -> bool:
        with self._lock:
            return self._known.pop(uid, None) is not None


def _lines(resp: urllib3.HTTPResponse) -> Iterator[bytes]:
    """Complete JSON lines from a chunked watch response, as soon as each arrives."""
    pending = b""
    for chunk in resp.stream(None, decode_content=False):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def _describe(e: BaseException) -> str:
    if isinstance(e, client.ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"
