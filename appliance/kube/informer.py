"""A cache of one Kubernetes collection, kept current by list-then-watch.

The node's pod watcher and the webhook's view of nodes and MIG pods need the same thing: a
local copy of some objects that follows the API server within a second, at the cost of one
watch, never a poll. It is written against the client's low-level calls (raw JSON lines)
rather than `kubernetes.watch.Watch`, because it must track the resourceVersion itself (from
the list, from every event and from every bookmark) and tell a 410 Gone from other failures:

* list, in pages of `page_size` (a read from etcd, bounded in memory whatever the cluster's
  size) or whole from the API server's watch cache (`resourceVersion=0`, cheap, for small
  selections such as one node's pods);
* watch from the list's version with bookmarks; every event and bookmark advances it;
* 410 Gone (an ERROR event or a 410 status): list again and diff against the cache, so an
  object deleted while nobody watched is still reported deleted;
* 403 Forbidden: the role lacks `list` or `watch`; reported to `permissions` (readiness fails,
  one log line names the verb) and retried with backoff, so a fixed role is picked up;
* any other failure: reconnect from the last version after exponential backoff with jitter;
* a watch that stays silent for `inactivity_timeout_s` is dropped and reopened. Where the
  server has sent bookmarks (about one a minute), that silence means a dead connection and is
  logged as a warning; where it never has (bookmarks are optional), a quiet collection looks
  the same, so the reopen is logged only at debug level.

Each object is reduced by `convert` as it arrives (None: not of interest, treated as absent),
so the cache holds only what its user needs. `on_set` fires when an object appears or its
converted value changes, `on_delete` when it goes; both run on the informer's thread, in API
order. A callback that raises is logged; the watch goes on.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

import urllib3
from kubernetes import client

from appliance.kube.access import Permission, Permissions, is_forbidden

log = logging.getLogger(__name__)

Obj = dict[str, Any]
T = TypeVar("T")


class _Gone(Exception):
    """The API server no longer has the history we asked for (HTTP 410)."""


class _Silent(Exception):
    """The watch sent nothing for longer than the inactivity timeout."""


class _Forbidden(Exception):
    """RBAC refused a list or a watch (HTTP 403)."""

    def __init__(self, permission: Permission, cause: client.ApiException) -> None:
        super().__init__(str(permission))
        self.permission, self.cause = permission, cause


def object_uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))


class Informer(Generic[T]):
    """Lists then watches one collection (`list_call`: a CoreV1Api list method)."""

    def __init__(
        self,
        *,
        name: str,
        list_call: Callable[..., Any],
        convert: Callable[[Obj], T | None],
        on_set: Callable[[str, T], None] = lambda key, value: None,
        on_delete: Callable[[str, T], None] = lambda key, value: None,
        on_listed: Callable[[frozenset[str]], None] = lambda keys: None,
        key: Callable[[Obj], str] = object_uid,
        describe: Callable[[str, T], str] = lambda key, value: key,
        resource: str = "",  # what RBAC calls the collection: "pods", "nodes"
        permissions: Permissions | None = None,
        field_selector: str | None = None,
        page_size: int | None = None,
        bookmarks: bool = True,
        watch_timeout_s: int = 300,  # the server ends each watch after 1-2x this
        inactivity_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        backoff: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self.name = name
        self._list_call = list_call
        self._convert = convert
        self._on_set = on_set
        self._on_delete = on_delete
        self._on_listed = on_listed
        self._key = key
        self._describe = describe
        self._resource = resource
        self._permissions = permissions
        self._selector = {"field_selector": field_selector} if field_selector else {}
        self._page_size = page_size
        self._bookmarks = bookmarks
        self._watch_timeout_s = watch_timeout_s
        self._timeouts = (connect_timeout_s, inactivity_timeout_s)
        self._backoff = backoff
        self._known: dict[str, T] = {}
        self._rv = ""
        self._bookmarks_seen = False
        self._stop = threading.Event()
        self._response: urllib3.HTTPResponse | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()
        self.relists = 0  # how many times it had to list (first list, 410s)

    @property
    def resource_version(self) -> str:
        """The last resourceVersion seen (list, event or bookmark)."""
        return self._rv

    @property
    def alive(self) -> bool:
        """True while the informer's thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        """True once started and until stopped: its thread should be alive."""
        return self._thread is not None and not self._stop.is_set()

    def items(self) -> dict[str, T]:
        """A snapshot of the cache, by key."""
        with self._lock:
            return dict(self._known)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop: cuts the open watch so the thread ends promptly."""
        self._stop.set()
        with self._lock:
            resp = self._response
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:
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
                log.info("%s: history expired (410); listing again", self.name)
                need_list = True
                failures = 0
            except _Forbidden as refusal:
                failures += 1
                self._refused(refusal, self._delay(failures))
            except _Silent:
                failures = 0
                self._silent()
            except Exception as e:
                if self._stop.is_set():
                    break
                failures += 1
                delay = self._delay(failures)
                log.warning(
                    "%s failed (%s); retrying in %.2fs from resourceVersion %s",
                    self.name,
                    _describe(e),
                    delay,
                    self._rv or "(list)",
                )
                self._stop.wait(delay)

    def _silent(self) -> None:
        if self._bookmarks_seen:
            log.warning(
                "%s: the watch was silent for %gs although the server sends bookmarks; "
                "reconnecting from resourceVersion %s",
                self.name,
                self._timeouts[1],
                self._rv,
            )
        else:  # a server without bookmarks over a quiet collection looks the same
            log.debug("%s: a quiet watch (no bookmarks); reopening", self.name)

    def _refused(self, refusal: _Forbidden, delay: float) -> None:
        if self._permissions is not None:
            self._permissions.refused(refusal.permission, refusal.cause, who=self.name)
        else:
            log.warning("%s: RBAC forbids %s; retrying in %.2fs", self.name, refusal, delay)
        self._stop.wait(delay)

    def _failure(self, e: client.ApiException, verb: str) -> Exception:
        """What a failed list or watch means to the loop: a 410, a 403, or a failure."""
        if e.status == 410:
            return _Gone(str(e.reason))
        if is_forbidden(e):
            return _Forbidden(Permission(verb, self._resource), e)
        return e

    def _allowed(self, verb: str) -> None:
        if self._permissions is not None:
            self._permissions.granted(Permission(verb, self._resource))

    def _delay(self, failures: int) -> float:
        """Exponential backoff with full jitter, never below half the base."""
        base, cap = self._backoff
        ceiling = min(cap, base * (2 ** (failures - 1)))
        return random.uniform(min(base / 2, ceiling), ceiling)

    def _pages(self) -> Iterator[Obj]:
        """The list's pages: one from the watch cache, or `page_size` objects at a time."""
        token = ""
        while True:
            if self._page_size is None:
                paging: dict[str, Any] = {"resource_version": "0"}
            else:
                paging = {"limit": self._page_size}
                if token:
                    paging["_continue"] = token
            resp = cast(
                urllib3.HTTPResponse,
                self._list_call(
                    **self._selector,
                    **paging,
                    _preload_content=False,
                    _request_timeout=self._timeouts,
                ),
            )
            try:
                page = json.loads(resp.data)
            finally:
                resp.release_conn()
            yield page
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return

    def _relist(self) -> None:
        current: dict[str, T] = {}
        rv = ""
        try:
            for page in self._pages():
                rv = str((page.get("metadata") or {}).get("resourceVersion") or "")
                for item in page.get("items") or []:
                    value = self._convert(item)
                    if value is not None:
                        current[self._key(item)] = value
        except client.ApiException as e:  # a 410: a continue token outlived the history
            raise self._failure(e, "list") from None
        self._allowed("list")
        with self._lock:
            before = dict(self._known)
        for key, value in current.items():
            if before.get(key) != value:
                self._set(key, value)
        for key, old in before.items():
            if key not in current:
                self._delete(key)
                self._emit(self._on_delete, key, old)
        self._rv = rv
        self.relists += 1
        self.synced.set()
        self._listed(frozenset(current))

    def _listed(self, keys: frozenset[str]) -> None:
        """After the diff's own callbacks: the whole collection, as of this list."""
        try:
            self._on_listed(keys)
        except Exception:
            log.exception("%s: the callback after a list failed; watching on", self.name)

    def _watch_once(self) -> bool:
        """One watch request until it ends; True if it delivered anything."""
        try:
            resp = cast(
                urllib3.HTTPResponse,
                self._list_call(
                    **self._selector,
                    watch=True,
                    resource_version=self._rv,
                    allow_watch_bookmarks=self._bookmarks,
                    # spread reconnects after an API server restart, as client-go does
                    timeout_seconds=int(self._watch_timeout_s * random.uniform(1.0, 2.0)),
                    _preload_content=False,
                    _request_timeout=self._timeouts,
                ),
            )
        except client.ApiException as e:
            raise self._failure(e, "watch") from None
        self._allowed("watch")
        with self._lock:
            self._response = resp
        delivered = False
        try:
            if self._stop.is_set():
                return False
            for line in _lines(resp):
                self._handle(json.loads(line))
                delivered = True
        except urllib3.exceptions.ReadTimeoutError:
            if self._stop.is_set():
                return delivered
            raise _Silent() from None
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
        if kind == "BOOKMARK":
            self._bookmarks_seen = True
        elif kind in ("ADDED", "MODIFIED"):
            self._changed(obj)
        elif kind == "DELETED":
            key = self._key(obj)
            with self._lock:
                old = self._known.pop(key, None)
            if old is not None:
                self._emit(self._on_delete, key, old)
        if rv:
            self._rv = str(rv)

    def _changed(self, obj: Obj) -> None:
        """An object appeared or changed; one its converter drops now counts as deleted."""
        key, value = self._key(obj), self._convert(obj)
        with self._lock:
            old = self._known.get(key)
        if value is None:
            if old is not None:
                self._delete(key)
                self._emit(self._on_delete, key, old)
        elif old != value:
            self._set(key, value)

    def _set(self, key: str, value: T) -> None:
        with self._lock:
            self._known[key] = value
        self._emit(self._on_set, key, value)

    def _delete(self, key: str) -> None:
        with self._lock:
            self._known.pop(key, None)

    def _emit(self, callback: Callable[[str, T], None], key: str, value: T) -> None:
        try:
            callback(key, value)
        except Exception:
            log.exception("%s: a callback failed for %s", self.name, self._describe(key, value))


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
    """A failure in one short line (urllib3 puts an object's repr and the whole URL in its)."""
    if isinstance(e, client.ApiException):
        return f"HTTP {e.status} {e.reason}"
    if isinstance(e, urllib3.exceptions.HTTPError):
        text = str(getattr(e, "reason", None) or e)
        if text.startswith("<") and ">: " in text:  # "<...Connection object at 0x..>: why"
            text = text.split(">: ", 1)[1]
        return f"cannot reach the API server: {text[:160]}"
    return f"{type(e).__name__}: {str(e)[:200]}"
