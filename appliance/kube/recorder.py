"""Warnings shown on pods (`kubectl describe pod`) as core/v1 Events.

When an annotation is refused, the user looking at their pod should see why, not only the
node's log. This is a sink: `warn()` never blocks the scheduler and never raises into it; a
background thread talks to the API server and logs what it could not send.

Repeats are deduplicated like kubelet's event correlator: the same pod, reason and message
within `window_s` bumps `count` and `lastTimestamp` on the existing Event instead of creating
a new one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kubernetes import client

from appliance.core.annotations import PodRef
from appliance.kube.access import Permission, Permissions, is_forbidden

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Sent:
    name: str
    count: int
    first_sent: float  # monotonic


@dataclass(frozen=True, slots=True)
class _Warning:
    pod: PodRef
    reason: str
    message: str


def _timestamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Creates Warning Events on pods from a background thread, deduplicated."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        node_name: str,
        component: str = "nvshare-scheduler",
        window_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        request_timeout_s: float = 10.0,
        max_queued: int = 1000,
        permissions: Permissions | None = None,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self._permissions = permissions
        self._node = node_name
        self._component = component
        self._window_s = window_s
        self._clock = clock
        self._timeout = request_timeout_s
        self._max_queued = max_queued
        self._sent: dict[tuple[str, str, str], _Sent] = {}
        self._queue: deque[_Warning] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.dropped = 0  # warnings not queued because the queue was full

    def warn(self, pod: PodRef, reason: str, message: str) -> None:
        """Queue a Warning Event on `pod`; returns at once and never raises."""
        try:
            with self._cond:
                if self._closed:
                    return
                if len(self._queue) >= self._max_queued:
                    self.dropped += 1
                    log.warning("event queue full; not reporting on pod %s: %s", pod, message)
                    return
                self._queue.append(_Warning(pod, reason, message))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="nvshare-events", daemon=True
                    )
                    self._thread.start()
                self._cond.notify_all()
        except Exception:
            log.exception("could not queue an event for pod %s", pod)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued warning was sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to `timeout`), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._send(item)
            except Exception as e:
                if is_forbidden(e) and self._permissions is not None:
                    continue  # said by `permissions`, once
                log.warning(
                    "could not record event %s on pod %s (%s): %s",
                    item.reason,
                    item.pod,
                    e,
                    item.message,
                )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, w: _Warning) -> None:
        key = (w.pod.uid, w.reason, w.message)
        now = self._clock()
        self._expire(now)
        sent = self._sent.get(key)
        if sent is not None:
            count = sent.count + 1
            try:
                with self._asking(Permission("patch", "events", w.pod.namespace)):
                    self._api.patch_namespaced_event(
                        sent.name,
                        w.pod.namespace,
                        {"count": count, "lastTimestamp": _timestamp()},
                        _request_timeout=self._timeout,
                    )
                self._sent[key] = _Sent(sent.name, count, sent.first_sent)
                return
            except client.ApiException as e:
                if e.status != 404:  # deleted meanwhile (TTL): create a fresh one
                    raise
        name = f"{w.pod.name}.{time.time_ns():x}"
        stamp = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=name, namespace=w.pod.namespace),
            involved_object=client.V1ObjectReference(
                kind="Pod",
                api_version="v1",
                namespace=w.pod.namespace,
                name=w.pod.name,
                uid=w.pod.uid,
            ),
            reason=w.reason,
            message=w.message,
            type="Warning",
            count=1,
            first_timestamp=stamp,
            last_timestamp=stamp,
            source=client.V1EventSource(component=self._component, host=self._node),
            reporting_component=self._component,
            reporting_instance=self._node,
        )
        with self._asking(Permission("create", "events", w.pod.namespace)):
            self._api.create_namespaced_event(
                w.pod.namespace, event, _request_timeout=self._timeout
            )
        self._sent[key] = _Sent(name, 1, now)

    @contextlib.contextmanager
    def _asking(self, permission: Permission) -> Iterator[None]:
        """Tell `permissions` whether RBAC let a request through."""
        try:
            yield
        except client.ApiException as e:
            if is_forbidden(e) and self._permissions is not None:
                self._permissions.refused(permission, e, who="events on pods")
            raise
        if self._permissions is not None:
            self._permissions.granted(permission)

    def _expire(self, now: float) -> None:
        old = [k for k, s in self._sent.items() if now - s.first_sent >= self._window_s]
        for k in old:
            del self._sent[k]
