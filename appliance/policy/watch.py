"""Hot reload of a policy directory: inotify, debounce, validate, swap; never a bad policy.

A mounted ConfigMap changes by kubelet's AtomicWriter: it writes a new `..2026_...` directory,
points a `..data_tmp` symlink at it and renames that over `..data` (so every visible file
changes at once), then removes the old directory. Editors write a temporary file and rename it
over the old one; people add and remove drop-ins, or delete and recreate the whole directory.
All of these show up as events on the directory (or, for the directory itself, on its parent).

Any event starts a short debounce; when it ends the directory is read and hashed. The same
hash as the policy in force is a no-op; anything else is validated as a whole, and only a
valid policy reaches `on_policy`. A half-written or invalid file is a validation error: the
last good policy stays, `on_error` hears about it and the log says once what is wrong, where,
and which policy (by hash prefix) is kept. A slow periodic re-hash and `reload_now()` (SIGHUP)
are the safety nets for anything inotify cannot see (files that are symlinks to elsewhere,
network filesystems, overflowed event queues).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal, TypeVar

from inotify_simple import INotify, flags  # type: ignore[import-untyped]

from appliance.policy.errors import PolicyError, PolicyLoadError
from appliance.policy.files import POLICY_SUFFIXES, PolicySnapshot, read_policy_dir
from appliance.policy.load import build_policy
from appliance.policy.model import Policy

log = logging.getLogger("nvshare.policy")

ReloadResult = Literal["applied", "unchanged", "invalid"]
_T = TypeVar("_T")

_DIR_EVENTS = (
    flags.CREATE
    | flags.CLOSE_WRITE
    | flags.MODIFY
    | flags.MOVED_TO
    | flags.MOVED_FROM
    | flags.DELETE
    | flags.ATTRIB
    | flags.DELETE_SELF
    | flags.MOVE_SELF
    | flags.ONLYDIR
)
_PARENT_EVENTS = flags.CREATE | flags.MOVED_TO | flags.DELETE | flags.MOVED_FROM | flags.ONLYDIR
# A steady stream of events must not postpone a reload forever.
_MAX_DEFER_WINDOWS = 20
# How long a file being written in place (modified, not yet closed) holds a reload back, and
# how long names whose symlinks dangle (kubelet's ..data missing) are waited for before that
# is reported as an error. Either way the policy in force stays.
_WRITER_GRACE_S = 5.0
# After a failure of the watch loop itself, wait this long before going on.
_FAILURE_PAUSE_S = 1.0


class PolicyWatcher:
    """Keeps `last_good` equal to the newest valid policy in `directory`.

    Callbacks run on the watcher's thread (or on the caller of `reload_now`), one at a time
    and in order; they should hand the policy over and return quickly. `on_reload`, if given,
    hears the result of every reload attempt (for metrics).
    """

    def __init__(
        self,
        directory: Path,
        *,
        on_policy: Callable[[Policy], None],
        on_error: Callable[[list[PolicyError]], None],
        environ: Mapping[str, str] | None = None,
        debounce_s: float = 0.05,
        rehash_interval_s: float = 60.0,
        on_reload: Callable[[ReloadResult], None] | None = None,
        flux_grace_s: float = _WRITER_GRACE_S,
    ) -> None:
        self.directory = Path(directory)
        self._on_policy = on_policy
        self._on_error = on_error
        self._on_reload = on_reload
        self._environ = os.environ if environ is None else environ
        self._debounce_s = debounce_s
        self._rehash_interval_s = rehash_interval_s
        self._flux_grace_s = flux_grace_s
        self.last_good: Policy | None = None
        self.last_errors: list[PolicyError] = []
        self.last_reload_time: float | None = None  # time.time() of the last reload attempt
        self.reload_counts: dict[str, int] = {"applied": 0, "unchanged": 0, "invalid": 0}
        self._lock = threading.RLock()
        self._reported: tuple[str, ...] = ()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._inotify: INotify | None = None
        self._dir_wd: int | None = None
        self._parent_wd: int | None = None
        self._wake_r, self._wake_w = -1, -1
        self._writing: dict[str, float] = {}  # name -> when its in-place write began
        self._first_event: float | None = None  # a reload is pending since then
        self._last_event = 0.0
        self._in_flux_since: float | None = None  # when names were first seen dangling
        self._next_rehash = 0.0

    # --- public -----------------------------------------------------------------------------

    def start(self) -> Policy:
        """Load synchronously, then watch on a daemon thread; returns the first policy.

        Raises `PolicyLoadError` (and watches nothing) when the first load is invalid, so a
        daemon never starts without a policy.
        """
        self._open()
        try:
            self._reload("start", first=True)
        except PolicyLoadError:
            self._close()
            raise
        self._start_thread()
        assert self.last_good is not None
        return self.last_good

    def watch(self) -> None:
        """Watch without requiring a valid policy first: one that is invalid (or a directory that
        does not exist yet) is reported, and applied once it is fixed. For servers that must
        answer meanwhile, like the admission webhook, which then changes no pod."""
        self._open()
        self._reload("start")
        self._start_thread()

    def _open(self) -> None:
        if self._thread is not None:
            raise RuntimeError("PolicyWatcher started twice")
        self._inotify = INotify()
        self._wake_r, self._wake_w = os.pipe()
        self._watch_parent()
        self._watch_directory()  # before the first read, so no change slips in between

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="policy-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching and wait for the thread; safe to call twice."""
        self._stopping.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close()

    @property
    def alive(self) -> bool:
        """True while the watch thread runs (status shows it)."""
        return self._thread is not None and self._thread.is_alive()

    def reload_now(self) -> ReloadResult:
        """Re-read the directory now (SIGHUP); errors are reported even if unchanged."""
        result = self._reload("reload requested", force_report=True)
        assert result is not None  # only a `settled` check can postpone
        return result

    def __enter__(self) -> PolicyWatcher:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- reloading --------------------------------------------------------------------------

    def _reload(
        self,
        reason: str,
        *,
        first: bool = False,
        force_report: bool = False,
        settled: Callable[[], bool] | None = None,
    ) -> ReloadResult | None:
        """Read, compare, validate, apply; None if `settled` says the read was mid-change."""
        with self._lock:
            snapshot = read_policy_dir(self.directory)
            if settled is not None and (not settled() or self._waiting_out_flux(snapshot)):
                return None
            self.last_reload_time = time.time()
            good = self.last_good
            if (
                not snapshot.errors
                and good is not None
                and snapshot.content_hash == good.content_hash
            ):
                if self.last_errors:
                    log.info(
                        "policy in %s is valid again; policy %s stays in force",
                        self.directory,
                        good.content_hash[:12],
                    )
                self.last_errors, self._reported = [], ()
                return self._count("unchanged")
            try:
                policy = build_policy(snapshot, environ=self._environ)
            except PolicyLoadError as e:
                if first:
                    raise
                self._report(e.errors, reason=reason, force=force_report)
                return self._count("invalid")
            except Exception as e:  # a loader bug must not end hot reload: report it like an error
                log.exception("loading the policy in %s failed", self.directory)
                failure = PolicyError(str(self.directory), None, "", f"could not be loaded ({e!r})")
                if first:
                    raise PolicyLoadError([failure], where=str(self.directory)) from e
                self._report([failure], reason=reason, force=force_report)
                return self._count("invalid")
            previous = good.content_hash[:12] if good is not None else "none"
            self.last_good, self.last_errors, self._reported = policy, [], ()
            log.info(
                "applied policy %s from %s (%s; previous %s; %s)",
                policy.content_hash[:12],
                self.directory,
                ", ".join(policy.files) or "no files: built-in defaults",
                previous,
                reason,
            )
            self._call(self._on_policy, policy)
            return self._count("applied")

    def _waiting_out_flux(self, snapshot: PolicySnapshot) -> bool:
        """True while names dangle and have not dangled for long: re-read later, say nothing."""
        if not snapshot.dangling:
            self._in_flux_since = None
            return False
        now = time.monotonic()
        if self._in_flux_since is None:
            self._in_flux_since = now
            log.info(
                "%s is being updated (%s point%s at nothing yet); waiting",
                self.directory,
                ", ".join(snapshot.dangling),
                "s" if len(snapshot.dangling) == 1 else "",
            )
        return now - self._in_flux_since < self._flux_grace_s

    def _count(self, result: ReloadResult) -> ReloadResult:
        self.reload_counts[result] += 1
        if self._on_reload is not None:
            self._call(self._on_reload, result)
        return result

    def _report(self, errors: list[PolicyError], *, reason: str, force: bool) -> None:
        self.last_errors = list(errors)
        key = tuple(str(e) for e in errors)
        if key == self._reported and not force:
            return
        self._reported = key
        kept = self.last_good.content_hash[:12] if self.last_good is not None else "none"
        log.error(
            "policy in %s is invalid (%d error%s, %s); keeping the last good policy %s:\n%s",
            self.directory,
            len(errors),
            "" if len(errors) == 1 else "s",
            reason,
            kept,
            "\n".join(f"  {e}" for e in errors),
        )
        self._call(self._on_error, list(errors))

    def _call(self, callback: Callable[[_T], None], argument: _T) -> None:
        try:
            callback(argument)
        except Exception:  # a broken consumer must not stop the watcher
            log.exception("policy callback %r failed", callback)

    # --- inotify ----------------------------------------------------------------------------

    def _watch_parent(self) -> None:
        assert self._inotify is not None
        try:
            self._parent_wd = self._inotify.add_watch(self.directory.parent, _PARENT_EVENTS)
        except OSError as e:
            log.warning(
                "cannot watch %s (%s); relying on the periodic re-hash", self.directory.parent, e
            )

    def _watch_directory(self) -> bool:
        """Watch the directory if it exists and is not watched yet; True if newly watched."""
        assert self._inotify is not None
        if self._dir_wd is not None:
            return False
        try:
            self._dir_wd = self._inotify.add_watch(self.directory, _DIR_EVENTS)
        except OSError:
            return False
        return True

    def _handle(self, event_wd: int, mask: int, name: str) -> bool:
        """Update watches and writers for one event; True if the policy may have changed."""
        if mask & flags.Q_OVERFLOW:
            return True
        if event_wd == self._dir_wd:
            if mask & (flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED):
                self._directory_gone(event_wd, mask)
                return True
            return self._in_directory(mask, name)
        if event_wd == self._parent_wd and name == self.directory.name:
            self._writing.clear()
            self._watch_directory()
            return True
        return False

    def _directory_gone(self, event_wd: int, mask: int) -> None:
        if mask & flags.MOVE_SELF and self._inotify is not None:
            try:  # the watch follows the moved inode; the path is what we care about
                self._inotify.rm_watch(event_wd)
            except OSError:
                pass
        self._dir_wd = None
        self._writing.clear()
        self._watch_directory()  # a replacement may already be there

    def _in_directory(self, mask: int, name: str) -> bool:
        if name == "..data":  # kubelet's swap: every visible file changed at once
            return True
        if name.startswith(".") or not name.endswith(POLICY_SUFFIXES):
            return False  # editors' temporary files, kubelet's timestamped directories
        if mask & flags.MODIFY:
            self._writing.setdefault(name, time.monotonic())
        elif mask & (flags.CLOSE_WRITE | flags.MOVED_TO | flags.MOVED_FROM | flags.DELETE):
            self._writing.pop(name, None)
        return True

    def _drain(self) -> bool:
        """Handle every queued event; True (and the debounce restarted) if any mattered."""
        assert self._inotify is not None
        changed = False
        for event in self._inotify.read(timeout=0):
            changed = self._handle(event.wd, event.mask, event.name) or changed
        if changed:
            self._last_event = time.monotonic()
            if self._first_event is None:
                self._first_event = self._last_event
        return changed

    def _due(self) -> float:
        """When the pending reload should run (monotonic)."""
        assert self._first_event is not None
        due = min(
            self._last_event + self._debounce_s,
            self._first_event + max(1.0, _MAX_DEFER_WINDOWS * self._debounce_s),
        )
        # A file written in place is empty or partial until its writer closes it, and such a
        # prefix can be valid YAML: wait for the close (CLOSE_WRITE), within reason.
        if self._writing:
            due = max(due, max(self._writing.values()) + _WRITER_GRACE_S)
        return due

    def _run(self) -> None:
        assert self._inotify is not None
        poller = select.poll()
        poller.register(self._inotify.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        self._next_rehash = time.monotonic() + self._rehash_interval_s
        while not self._stopping.is_set():
            try:
                self._step(poller)
            except Exception:  # whatever went wrong, later edits must still be applied
                log.exception(
                    "watching %s failed; still watching (SIGHUP re-reads at once)", self.directory
                )
                self._first_event = time.monotonic()  # read again once things settle
                self._stopping.wait(_FAILURE_PAUSE_S)

    def _step(self, poller: select.poll) -> None:
        """Wait for events or a deadline, then reload if one is due."""
        assert self._inotify is not None
        deadline = self._next_rehash
        if self._first_event is not None:
            deadline = min(deadline, self._due())
        ready = poller.poll(max(0.0, deadline - time.monotonic()) * 1000.0)
        if self._stopping.is_set():
            return
        if any(fd == self._inotify.fileno() for fd, _ in ready):
            self._drain()
        now = time.monotonic()
        if self._first_event is not None and now >= self._due():
            # Events that arrive while the directory is read make that read suspect, and so
            # do names that dangle: drop the read and try again after a quiet moment.
            if self._reload("directory changed", settled=lambda: not self._drain()):
                self._first_event = None
            else:
                self._first_event = self._last_event = time.monotonic()
        if now >= self._next_rehash:
            self._next_rehash = now + self._rehash_interval_s
            if self._parent_wd is None:
                self._watch_parent()
            self._watch_directory()
            # A change already pending, or a file still open for writing, is read by the
            # event path once it settles; reading it here could apply half a file.
            if self._first_event is not None or self._writing:
                return
            if self._reload("periodic re-hash", settled=lambda: not self._drain()) is None:
                self._first_event = self._last_event = time.monotonic()

    def _close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r, self._wake_w = -1, -1
