"""`nvsharectl top`: the scheduler's status as a live terminal view, or one frame for scripts.

It asks the daemon for the same typed `StatusView` as `nvsharectl status`, once a refresh, and
shows what each GPU and each of its clients is doing now: who holds the lock and who waits,
memory as the hook counts it beside what NVML shows the process holding (the difference is the
CUDA context and the driver's own memory), the share of wall time each client held the lock
over the last seconds (the lock's exact accounting, two snapshots apart: what a user calls its
GPU time) and where each compute quota's window stands.

The terminal handling is plain on purpose: cbreak mode through termios and a few VT100 escapes
(alternate screen, cursor home, clear to end of line). No terminfo lookup, so it works in
`kubectl exec -it`, where TERM is often unset, as over SSH. `q`, Ctrl-C and the end of input
quit, and the terminal is restored whatever happens.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from appliance import framing
from appliance import protocol as p
from appliance.client import ControlClient, DaemonUnavailable
from appliance.core.gputime import QuotaUse
from appliance.core.views import ClientView, GpuView, StatusView, from_json

Fetch = Callable[[], StatusView]
UNREACHABLE = (DaemonUnavailable, OSError, framing.ProtocolError)  # timeouts included

QUIT_KEYS = frozenset(b"qQ")
SHARE_WINDOW_S = 2.0  # the seed's compute window: share over the last one
ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, cursor hidden
LEAVE = "\x1b[?25h\x1b[?1049l"
HOME = "\x1b[H"
CLEAR_LINE = "\x1b[K"
CLEAR_BELOW = "\x1b[J"


@dataclass(frozen=True, slots=True)
class Sample:
    """Lock time held per client at one moment of the daemon's clock."""

    time: float
    held_s: Mapping[int, float]


class ShareHistory:
    """Recent samples, enough to tell each client's share of the last `window_s` seconds."""

    def __init__(self, window_s: float = SHARE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[Sample] = deque()

    def add(self, status: StatusView) -> None:
        self._samples.append(Sample(status.time, {c.id: c.lock.held_s for c in status.clients}))
        # keep the newest sample at least a window old, the base of the next share
        while len(self._samples) > 2 and status.time - self._samples[1].time >= self.window_s:
            self._samples.popleft()

    def shares(self) -> tuple[float, dict[int, float]]:
        """The span covered (s), and each client's lock time over it as a fraction; a client
        the oldest sample does not know yet has no share."""
        if len(self._samples) < 2:
            return 0.0, {}
        base, now = self._samples[0], self._samples[-1]
        span = now.time - base.time
        if span <= 0:
            return 0.0, {}
        return span, {
            cid: max(0.0, min(1.0, (held - base.held_s[cid]) / span))
            for cid, held in now.held_s.items()
            if cid in base.held_s
        }


# ------------------------------------------------------------------ the frame


def size(n: int | None) -> str:
    """Bytes in at most six characters: 512Ki, 700Mi, 12.5Gi; "-" when unknown."""
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for suffix, unit in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= unit:
            value = n / unit
            return f"{sign}{value:.1f}{suffix}" if value < 100 else f"{sign}{value:.0f}{suffix}"
    return f"{sign}{n}B" if n else "0"


def _quota(q: QuotaUse | None) -> str:
    if q is None:
        return "-"
    return f"{q.used_s * 1000:.0f}/{q.budget_s * 1000:.0f}ms"


# What changes from second to second first, so that an 80-column terminal shows it; memory after.
CLIENT_HEADER = (
    f"  {'ID':>4} {'PID':>7} {'POD':<24} {'STATE':<8} {'GPU%':>4} {'CORE':>4} {'QUOTA':>11} "
    f"{'USED':>6} {'LIMIT':>6} {'NVML':>6} {'CTX':>6}"
)


def overhead(c: ClientView) -> int | None:
    """What NVML shows the process holding beyond what its hook counts: the CUDA context, the
    driver's own allocations, module code and globals."""
    return None if c.memory_observed is None else c.memory_observed - c.memory_used


def _client_row(c: ClientView, share: float | None) -> str:
    shown = "-" if share is None else f"{share * 100:.0f}"
    return (
        f"  {c.id:>4} {c.pid:>7} {c.pod[:24]:<24} {c.state.value:<8} {shown:>4} "
        f"{c.core_limit:>3}% {_quota(c.quota):>11} {size(c.memory_used):>6} "
        f"{size(c.memory_limit):>6} {size(c.memory_observed):>6} {size(overhead(c)):>6}"
    )


def _gpu_lines(status: StatusView, g: GpuView, clients: list[ClientView]) -> Iterator[str]:
    use = next((u for u in status.use if u.uuid == g.uuid), None)
    util = "-" if use is None or use.utilization_percent is None else f"{use.utilization_percent}%"
    used = None if use is None else use.memory_used
    name = f"GPU {g.index}" if g.index is not None else "GPU"
    yield (
        f"{name} {g.uuid} {g.model or ''}  mode {g.mode.value}  TQ {g.time_quantum_s:g}s  "
        f"util {util}  memory {size(used)}/{size(g.memory_total)}"
    )
    pid_of = {c.id: c.pid for c in clients}
    holders = ", ".join(f"{h} (pid {pid_of.get(h, '?')})" for h in g.holders) or "-"
    yield f"  holder: {holders}   queue: {', '.join(map(str, g.queue)) or '-'}"


def frame(status: StatusView, history: ShareHistory) -> list[str]:
    """One screen of text: a summary line, then each GPU with its clients, then processes
    running on a GPU without the hook."""
    span, shares = history.shares()
    share_note = f"GPU% over the last {span:.1f}s" if span else "GPU% after the next refresh"
    policy = ""
    if status.policy is not None:
        policy = "  policy " + ("valid" if status.policy.valid else "INVALID (last good kept)")
    lines = [
        f"nvshare: {len(status.clients)} client(s) on {len(status.gpus)} GPU(s), default mode "
        f"{status.default_mode.value}, TQ {status.default_time_quantum_s:g}s{policy}  "
        f"({share_note}; CTX = NVML - USED: context and driver memory)",
    ]
    if not status.gpus:
        lines.append("no GPUs in use yet")
    for g in status.gpus:
        mine = [c for c in status.clients if c.gpu == g.uuid]
        lines += ["", *_gpu_lines(status, g, mine)]
        if mine:
            lines.append(CLIENT_HEADER)
            lines += [_client_row(c, shares.get(c.id)) for c in mine]
    for u in status.unhooked:
        lines.append(
            f"  unhooked pid {u.pid} {u.pod} {u.executable or ''} on {','.join(u.gpus)}: "
            f"{size(u.memory_used)} (unshared, unlimited)"
        )
    return lines


# ------------------------------------------------------------------ the terminal


def once(fetch: Fetch, interval_s: float, out: TextIO) -> None:
    """One frame, for scripts: two samples `interval_s` apart, so GPU% has a span."""
    history = ShareHistory()
    history.add(fetch())
    time.sleep(interval_s)
    status = fetch()
    history.add(status)
    out.write("\n".join(frame(status, history)) + "\n")


@contextmanager
def _screen(fd_in: int, out: TextIO) -> Iterator[None]:
    saved = termios.tcgetattr(fd_in)
    tty.setcbreak(fd_in)
    out.write(ENTER)
    try:
        yield
    finally:
        out.write(LEAVE)
        out.flush()
        termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)


def _draw(lines: list[str], out: TextIO) -> None:
    width, height = shutil.get_terminal_size()
    shown = [line[:width] + CLEAR_LINE for line in lines[:height]]
    out.write(HOME + "\r\n".join(shown) + CLEAR_BELOW)
    out.flush()


def _wait_for_key(fd_in: int, timeout_s: float) -> bool:
    """True when a quit key (or the end of input) arrived within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd_in], [], [], left)
        if not ready:
            return False
        data = os.read(fd_in, 64)
        if not data or QUIT_KEYS.intersection(data):
            return True
    return False


def live(fetch: Fetch, interval_s: float, *, fd_in: int, out: TextIO) -> None:
    """Redraw every `interval_s` until `q`; a daemon that goes away is shown, and retried.
    A resized terminal is redrawn to its new size at the next refresh."""
    history = ShareHistory()
    try:
        with _screen(fd_in, out):
            while True:
                try:
                    status = fetch()
                except UNREACHABLE as exc:
                    history = ShareHistory()  # a restarted daemon numbers its clients anew
                    lines = [f"nvshare: {exc}", "", "retrying every refresh"]
                else:
                    history.add(status)
                    lines = frame(status, history)
                _draw([*lines, "", "q quits"], out)
                if _wait_for_key(fd_in, interval_s):
                    return
    except KeyboardInterrupt:
        return


def is_terminal(fd_in: int, out: TextIO) -> bool:
    return os.isatty(fd_in) and out.isatty()


def run(fetch: Fetch, *, interval_s: float, single: bool) -> None:
    if single:
        once(fetch, interval_s, sys.stdout)
    else:
        live(fetch, interval_s, fd_in=sys.stdin.fileno(), out=sys.stdout)


class StatusFeed:
    """The daemon's status over one connection, reopened after the daemon went away."""

    def __init__(self, control_dir: Path) -> None:
        self._control_dir = control_dir
        self._conn: ControlClient | None = None

    def __call__(self) -> StatusView:
        if self._conn is None:
            self._conn = ControlClient(control_dir=self._control_dir, timeout=5.0)
        try:
            reply = self._conn.request(p.StatusRequest())
        except UNREACHABLE:
            self.close()
            raise
        if not isinstance(reply, p.JsonBody):
            raise DaemonUnavailable(f"the scheduler at {self._conn.path} answered {reply!r:.200}")
        return from_json(StatusView, reply.doc)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
