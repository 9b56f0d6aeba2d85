"""`nvsharectl top`: the scheduler's status as a live terminal view, or one frame for scripts.

It asks the daemon for the same typed `StatusView` as `nvsharectl status`, once a refresh, and
shows what each GPU and each of its clients is doing now: who holds the lock and who waits,
memory as the hook counts it beside what NVML shows the process holding (the difference is the
CUDA context and the driver's own memory), the share of wall time each client held the lock
over the last seconds (the lock's exact accounting, two snapshots apart: what a user calls its
GPU time), where each compute quota's window stands, and what the lock goes by: priority,
guaranteed share (scaled down where a GPU's requests sum past 100) and gang, formatted as
status formats them.

A frame fits the terminal's width: where the whole row does not, the least useful columns give
way first (`DROPPED_FIRST`) and POD and the gang key narrow (a key loses its middle: its kind
and its end tell gangs apart). `--once` prints every column whole, for scripts.

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
import textwrap
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from appliance.cli.client import ControlClient, DaemonUnavailable
from appliance.core.gputime import QuotaUse
from appliance.core.state import Phase
from appliance.core.views import ClientView, GpuView, StatusView, from_json
from appliance.policy.model import priority_name
from appliance.wire import framing
from appliance.wire import protocol as p

Fetch = Callable[[], StatusView]
UNREACHABLE = (DaemonUnavailable, OSError, framing.ProtocolError)  # timeouts included

UNGATED = "ungated"
UNGATED_NOTE = (
    "ungated: runs without the lock (mode off, or a rule exempts it): no GPU% of its own; "
    "the GPU's util is NVML's"
)
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


def overhead(c: ClientView) -> int | None:
    """What NVML shows the process holding beyond what its hook counts: the CUDA context, the
    driver's own allocations, module code and globals."""
    return None if c.memory_observed is None else c.memory_observed - c.memory_used


def guaranteed(c: ClientView) -> str:
    """A client's guaranteed share (coreRequest), as status and top show it: "30%", or
    "60>50%" where its GPU's requests summed over 100 and scaled it down."""
    effective = round(c.core_guaranteed)
    return f"{c.core_request}%" if effective >= c.core_request else f"{c.core_request}>{effective}%"


def scaled_requests(g: GpuView) -> str | None:
    """The line status and top show under a GPU whose requests were scaled down."""
    if g.core_requested <= 100:
        return None
    return (
        f"guaranteed shares (coreRequest) sum to {g.core_requested}%: "
        f"each scaled by 100/{g.core_requested}"
    )


def state(c: ClientView) -> str:
    """What a client is doing as far as the scheduler knows: its lock phase, or `ungated` for
    one that never asks for the lock (mode off, or a rule exempts it), busy or not."""
    return UNGATED if not c.gated and c.state is Phase.IDLE else c.state.value


def defaults(status: StatusView) -> str:
    """The mode and quantum every GPU runs with unless a `gpus` rule or a per-GPU mode says
    otherwise, and whether nvsharectl set them over the policy."""

    def said(value: str, by_nvsharectl: bool, policy: str) -> str:
        return f"{value} (nvsharectl; policy {policy})" if by_nvsharectl else f"{value} (policy)"

    mode = (status.mode_set or status.default_mode).value
    tq = f"{status.default_time_quantum_s:g} s"
    policy_tq = f"{status.policy_time_quantum_s:g} s"
    return (
        f"mode {said(mode, status.mode_set is not None, status.default_mode.value)}  "
        f"TQ {said(tq, status.time_quantum_set_s is not None, policy_tq)}"
    )


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def dropped_lines(status: StatusView, width: int | None) -> list[str]:
    """The nvsharectl settings policy reloads replaced, and why, wrapped to `width` (None:
    a line each): otherwise only the daemon's log would say the operator's setting is gone."""
    lines = []
    for d in status.dropped:
        text = f"nvsharectl's {d.what} was dropped {_ago(status.time - d.time)} ago: {d.why}"
        if width is None:
            lines.append("  " + text)
        else:
            lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ")
    return lines


def _gang(key: str) -> str:
    return key or "-"  # a lone client's is ""


def _cut_end(text: str, width: int) -> str:
    return text[:width]


def cut_middle(text: str, width: int) -> str:
    """`text` in `width` characters, its middle given way: the kind in front of a gang key
    (pod:, uid:) and its end (a pod UID's last digits, a rendezvous port) tell gangs apart."""
    if len(text) <= width:
        return text
    tail = (width - 2) // 2
    return text[: width - 2 - tail] + ".." + text[len(text) - tail :]


@dataclass(frozen=True, slots=True)
class Column:
    """A column of the client table: what a client shows in it (given its GPU% share)."""

    title: str
    width: int
    cell: Callable[[ClientView, float | None], str]
    text: bool = False  # left-aligned and cut to fit; numbers are right-aligned
    cut: Callable[[str, int], str] = _cut_end

    def show(self, value: str) -> str:
        if self.text:
            return f"{self.cut(value, self.width):<{self.width}}"
        return f"{value:>{self.width}}"


def _share(c: ClientView, share: float | None) -> str:
    """Its share of lock time; none for a client that runs without the lock."""
    return "-" if share is None or state(c) == UNGATED else f"{share * 100:.0f}"


# What changes from second to second first, memory after; POD and GANG as wide as what they
# show (up to POD_WIDTH), GANG last.
COLUMNS = (
    Column("ID", 4, lambda c, _: str(c.id)),
    Column("PID", 7, lambda c, _: str(c.pid)),
    Column("POD", 3, lambda c, _: c.pod, text=True),
    Column("STATE", 8, lambda c, _: state(c), text=True),
    Column("GPU%", 4, _share),
    Column("CORE", 4, lambda c, _: f"{c.core_limit}%"),
    Column("REQ", 7, lambda c, _: guaranteed(c)),
    Column("PRIO", 6, lambda c, _: priority_name(c.priority)),
    Column("QUOTA", 11, lambda c, _: _quota(c.quota)),
    Column("USED", 6, lambda c, _: size(c.memory_used)),
    Column("LIMIT", 6, lambda c, _: size(c.memory_limit)),
    Column("NVML", 6, lambda c, _: size(c.memory_observed)),
    Column("CTX", 6, lambda c, _: size(overhead(c))),
    Column("GANG", 4, lambda c, _: _gang(c.gang), text=True, cut=cut_middle),
)
POD_WIDTH = 24
# Where the row is wider than the terminal: whole columns give way, the least useful first,
# until it fits with POD and GANG at least ROOMY wide (or none is left to drop); then POD and
# GANG narrow, the wider first, to fit, down to NARROWEST.
DROPPED_FIRST = ("CTX", "NVML", "LIMIT", "QUOTA", "USED")
NARROWED = ("POD", "GANG")
ROOMY, NARROWEST = 16, 12


def _span(columns: list[Column]) -> int:
    return 2 + sum(c.width + 1 for c in columns) - 1


def _narrow(columns: list[Column], width: int, floor: int) -> list[Column]:
    """POD and GANG narrowed, the wider first, until the row fits or they are `floor` wide."""
    while _span(columns) > width:
        i = max(
            (i for i, c in enumerate(columns) if c.title in NARROWED),
            key=lambda i: columns[i].width,
        )
        if columns[i].width <= floor:
            break
        columns = [*columns[:i], replace(columns[i], width=columns[i].width - 1), *columns[i + 1 :]]
    return columns


def table_columns(clients: tuple[ClientView, ...], width: int | None) -> list[Column]:
    """The columns of every GPU's client table; `width` None: all, each value whole (scripts)."""
    widest = {
        "POD": min(POD_WIDTH, max((len(c.pod) for c in clients), default=0)),
        "GANG": max((len(_gang(c.gang)) for c in clients), default=0),
    }
    columns = [replace(c, width=max(c.width, widest.get(c.title, 0))) for c in COLUMNS]
    if width is None:
        return columns
    for title in DROPPED_FIRST:
        if _span(_narrow(columns, width, ROOMY)) <= width:
            break
        columns = [c for c in columns if c.title != title]
    return _narrow(columns, width, NARROWEST)


def client_table(
    columns: list[Column], clients: list[ClientView], shares: Mapping[int, float]
) -> list[str]:
    """The header and a row per client."""
    rows = [[col.show(col.title) for col in columns]]
    rows += [[col.show(col.cell(c, shares.get(c.id))) for col in columns] for c in clients]
    return ["  " + " ".join(row).rstrip() for row in rows]


def _gpu_lines(status: StatusView, g: GpuView, clients: list[ClientView]) -> Iterator[str]:
    use = next((u for u in status.use if u.uuid == g.uuid), None)
    util = "-" if use is None or use.utilization_percent is None else f"{use.utilization_percent}%"
    used = None if use is None else use.memory_used
    name = f"GPU {g.index}" if g.index is not None else "GPU"
    mode = g.mode.value + (" (nvsharectl)" if g.mode_source == "nvsharectl" else "")
    tq = f"{g.time_quantum_s:g}s" + (" (nvsharectl)" if g.tq_source == "nvsharectl" else "")
    yield (
        f"{name} {g.uuid} {g.model or ''}  mode {mode}  TQ {tq}  "
        f"util {util}  memory {size(used)}/{size(g.memory_total)}"
    )
    pid_of = {c.id: c.pid for c in clients}
    holders = ", ".join(f"{h} (pid {pid_of.get(h, '?')})" for h in g.holders) or "-"
    yield f"  holder: {holders}   queue: {', '.join(map(str, g.queue)) or '-'}"
    if note := scaled_requests(g):
        yield f"  {note}"


def frame(status: StatusView, history: ShareHistory, width: int | None = None) -> list[str]:
    """One screen of text: a summary line, then each GPU with its clients, then processes
    running on a GPU without the hook; the client table fits `width` (None: whole)."""
    span, shares = history.shares()
    share_note = f"GPU% over the last {span:.1f}s" if span else "GPU% after the next refresh"
    policy = ""
    if status.policy is not None:
        policy = "  policy " + ("valid" if status.policy.valid else "INVALID (last good kept)")
    lines = [
        f"nvshare: {len(status.clients)} client(s) on {len(status.gpus)} GPU(s){policy}  "
        f"({share_note}; CTX = NVML - USED: context and driver memory)",
        f"default: {defaults(status)}",
        *dropped_lines(status, width),
    ]
    if any(state(c) == UNGATED for c in status.clients):
        lines.append(UNGATED_NOTE)
    if not status.gpus:
        lines.append("no GPUs in use yet")
    columns = table_columns(status.clients, width)
    for g in status.gpus:
        mine = [c for c in status.clients if c.gpu == g.uuid]
        lines += ["", *_gpu_lines(status, g, mine)]
        if mine:
            lines += client_table(columns, mine, shares)
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


def _draw(lines: list[str], out: TextIO, screen: os.terminal_size) -> None:
    width, height = screen
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
                screen = shutil.get_terminal_size()
                try:
                    status = fetch()
                except UNREACHABLE as exc:
                    history = ShareHistory()  # a restarted daemon numbers its clients anew
                    lines = [f"nvshare: {exc}", "", "retrying every refresh"]
                else:
                    history.add(status)
                    lines = frame(status, history, screen.columns)
                _draw([*lines, "", "q quits"], out, screen)
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
