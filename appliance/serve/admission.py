"""Who may hold a connection to the daemon: caps per user, per pod and in all, and one log line
a minute, not a storm, when they bite or the kernel runs out of files.

Every connection costs the daemon a file. Unbounded, 1,100 idle connections from one user took
the whole default limit of 1,024: status timed out, accept failed tens of thousands of times a
second, each failure logged with a traceback, and a new CUDA process ran unregistered. Now:
- the daemon raises its own open-files limit at start (`raise_open_files`) and keeps
  `FILES_IN_RESERVE` of them for its own use (/proc reads, the policy, metrics);
- the processes of one pod may hold `connections.perPod` connections, those of one user outside
  pods `connections.perUid` (policy); a process whose cgroup names a pod the pod watch does not
  know is its user's (whoever can make a cgroup of that name would fill the pod's cap); past a
  cap, or past the daemon's total, a new connection gets an error frame saying which cap and
  is closed;
- whatever its cap, one user or pod holds at most half of the daemon's connections, and the
  last eighth of them go only to users and pods holding fewer than `FEW_CONNECTIONS`: under a
  hard limit of 1,024 files (896 connections) the default perUid cap of 1,024 let one user
  take every connection, and everyone else's next program ran unregistered;
- each user outside pods, and each pod, may open `connections.newPerSecond` new connections a
  second, sustained, and a burst up to its cap at once (a token bucket); past that, a new
  connection is refused on its cgroup alone. One process connecting and closing in a loop
  used to fill the listen backlog, and every CUDA program starting meanwhile ran unshared;
- what is refused, and accept failing for want of files, is logged once a minute per reason.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from appliance.policy.model import ConnectionSettings

log = logging.getLogger("nvshare.server")

FILES_IN_RESERVE = 128
_LOG_EVERY_S = 60.0
_BUCKETS_KEPT = 4096
FEW_CONNECTIONS = 8  # a tenant holding fewer may take the daemon's last eighth


def raise_open_files(wanted: int) -> int:
    """Raise the soft limit of open files toward `wanted` (at most the hard limit); the limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit to %d: %s; %d it is", target, exc, soft)
    if soft < wanted:
        log.warning(
            "open files are limited to %d (wanted %d): raise LimitNOFILE (systemd) or the "
            "container runtime's limit for more connections",
            soft,
            wanted,
        )
    return int(soft)


class EveryMinute:
    """Logs a line per key at most once a minute, saying how many were left unsaid."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}
        self._unsaid: Counter[str] = Counter()

    def warn(self, key: str, message: str, *args: Any) -> None:
        now = self._clock()
        if now - self._last.get(key, -_LOG_EVERY_S) < _LOG_EVERY_S:
            self._unsaid[key] += 1
            return
        self._last[key] = now
        unsaid = self._unsaid.pop(key, 0)
        extra = f" ({unsaid} more like it in the last minute)" if unsaid else ""
        log.warning(message + extra, *args)


def _no_pod(uid: str) -> bool:
    return False


class Admission:
    def __init__(
        self,
        *,
        total: int,
        caps: Callable[[], ConnectionSettings],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self._caps = caps
        # Whether the pod watch knows a pod UID (the daemon sets it): a cgroup naming a pod it
        # does not know counts as its user's, not as that pod's.
        self.pod_known: Callable[[str], bool] = _no_pod
        self._clock = clock
        self._open: Counter[tuple[str, str]] = Counter()
        self._tokens: dict[tuple[str, str], tuple[float, float]] = {}  # key -> (tokens, at)
        self.count = 0
        self.notes = EveryMinute(clock)

    def admit(self, key: tuple[str, str]) -> str | None:
        """Count a new connection of `key` (("pod", uid) or ("uid", n)); or why it may not."""
        caps = self._caps()
        kind, name = key
        cap, setting = (caps.per_pod, "perPod") if kind == "pod" else (caps.per_uid, "perUid")
        who = f"pod {name}" if kind == "pod" else f"uid {name}"
        if not self._take_token(key, cap, caps.new_per_second):
            why = (
                f"{who} opens connections faster than connections.newPerSecond="
                f"{caps.new_per_second} (bursts up to connections.{setting}={cap})"
            )
            self.notes.warn(f"refuse {kind} {name}", "refusing connections: %s", why)
            return why
        held, half, kept_back = self._open[key], max(1, self.total // 2), self.total // 8
        if self.count >= self.total:
            why = f"the daemon holds {self.count} connections, all it can (open-files limit)"
        elif held >= cap:
            why = f"{who} holds {held} connections, its cap (connections.{setting})"
        elif held >= half:
            why = (
                f"{who} holds {held} connections, half of the {self.total} the daemon can hold "
                f"(open-files limit; connections.{setting}={cap} is more)"
            )
        elif self.count >= self.total - kept_back and held >= FEW_CONNECTIONS:
            why = (
                f"{who} holds {held} connections, and the daemon's last {kept_back} are kept "
                f"for users and pods holding fewer than {FEW_CONNECTIONS}"
            )
        else:
            self._open[key] += 1
            self.count += 1
            return None
        self.notes.warn(f"refuse {kind} {name}", "refusing connections: %s", why)
        return why

    def _take_token(self, key: tuple[str, str], burst: int, rate: int) -> bool:
        now = self._clock()
        tokens, at = self._tokens.get(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - at) * rate)
        if tokens < 1.0:
            self._tokens[key] = (tokens, now)
            return False
        self._tokens[key] = (tokens - 1.0, now)
        if len(self._tokens) > _BUCKETS_KEPT:  # forget the full ones: as if never seen
            self._tokens = {
                k: (t, a) for k, (t, a) in self._tokens.items() if t + (now - a) * rate < burst
            }
        return True

    def release(self, key: tuple[str, str]) -> None:
        self.count -= 1
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]
