"""`nvsharectl status` as text: the daemon's `StatusView`, read like `nvidia-smi`.

The default fits 80 columns: what the scheduler runs with (and whether nvsharectl or the policy
set it), a line per GPU (its index, the start of its UUID, mode, quantum, who holds the lock and
who waits, by PID), then a process table: GPU, PID, process name (the daemon reads
/proc/<pid>/comm of the PID the kernel gave it, not a name the client sent), state, memory, core
cap and pod. `--wide` shows everything else: whole UUIDs, client ids, NVML's view of each
process and the context it implies, guaranteed shares, priorities, gangs.

A client of a GPU in mode off is not gated: it never asks for the lock, so it is `ungated`, not
`idle`, whatever it is computing.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator

import click

from appliance.cli import top_view
from appliance.core.views import (
    ClientView,
    GpuView,
    PolicyStatus,
    PolicyView,
    StatusView,
    UnhookedView,
)
from appliance.policy.model import priority_name
from appliance.policy.quantity import format_bytes

WIDTH = 80


def _index(index: int | None) -> str:
    return "-" if index is None else str(index)


def short_uuid(uuid: str) -> str:
    """The first 8 hex digits after `GPU-` (or `MIG-`): what tells a node's GPUs apart."""
    kind, _, rest = uuid.partition("-")
    return rest[:8] if rest else kind[:8]


def scheduler_lines(status: StatusView) -> list[str]:
    """What every GPU runs with unless a `gpus` rule or a per-GPU mode says otherwise, and the
    overrides policy reloads replaced."""
    return [f"default: {top_view.defaults(status)}", *top_view.dropped_lines(status, WIDTH)]


def policy_lines(policy: PolicyStatus) -> list[str]:
    state = "valid" if policy.valid else "INVALID (last good kept)"
    lines = [
        f"policy: {policy.dir} hash {policy.hash[:12]} {state}; "
        f"files: {', '.join(policy.files) or '(none: defaults)'}"
    ]
    if policy.last_error:
        lines.append(f"  last error: {policy.last_error}")
    for name, source in sorted(policy.env_overrides.items()):
        lines.append(f"  override from environment: {name} ({source})")
    return lines


def _mem(n: int | None) -> str:
    return "-" if not n else format_bytes(n) if n % (1 << 20) == 0 else f"{n / (1 << 20):.1f}Mi"


def _pids(ids: tuple[int, ...], pid_of: dict[int, int], room: int) -> str:
    """Client ids as PIDs, as many as fit in `room` characters."""
    shown: list[str] = []
    for n, cid in enumerate(ids):
        more = f" (+{len(ids) - n} more)"
        word = str(pid_of.get(cid, f"client {cid}"))
        if len(", ".join([*shown, word])) + (len(more) if n + 1 < len(ids) else 0) > room:
            return ", ".join(shown) + more
        shown.append(word)
    return ", ".join(shown) or "-"


def gpu_lines(g: GpuView, pid_of: dict[int, int]) -> Iterator[str]:
    yield (
        f"GPU {_index(g.index)} {short_uuid(g.uuid)}  mode {g.mode.value} ({g.mode_source})  "
        f"TQ {g.time_quantum_s:g} s ({g.tq_source})  memory {_mem(g.memory_total)}"
    )
    holders = _pids(g.holders, pid_of, 24)
    yield f"  holding: {holders}  waiting: {_pids(g.queue, pid_of, WIDTH - 22 - len(holders))}"
    if note := top_view.scaled_requests(g):
        yield f"  {note}"


TABLE = "{:>3} {:<8} {:>7} {:<15} {:<8} {:>6} {:>6} {:>4} {}"


def _client_row(g: GpuView, c: ClientView, pod_width: int) -> str:
    return TABLE.format(
        _index(g.index),
        short_uuid(g.uuid),
        c.pid,
        (c.command or "?")[:15],
        top_view.state(c),
        top_view.size(c.memory_used),
        top_view.size(c.memory_limit),
        f"{c.core_limit}%",
        top_view.cut_middle(c.pod, pod_width),
    ).rstrip()


def _unhooked_row(index: int | None, uuid: str, u: UnhookedView, pod_width: int) -> str:
    name = u.command or (u.executable or "?").rsplit("/", 1)[-1]
    return TABLE.format(
        _index(index),
        short_uuid(uuid),
        u.pid,
        name[:15],
        "unhooked",
        top_view.size(u.gpu_memory.get(uuid, u.memory_used if len(u.gpus) == 1 else None)),
        "-",
        "-",
        top_view.cut_middle(u.pod, pod_width),
    ).rstrip()


def process_table(status: StatusView, width: int) -> list[str]:
    """A row per client and per process running without the hook, GPU by GPU (a GPU no hook
    uses yet, only NVML, last)."""
    pod_width = max(len("POD"), width - len(TABLE.format(*[""] * 9)))
    index = {use.uuid: use.index for use in status.use}
    hooked = {g.uuid for g in status.gpus}
    unhooked_gpus = sorted({uuid for u in status.unhooked for uuid in u.gpus} - hooked)
    clients: dict[str, list[ClientView]] = {}
    for c in status.clients:
        clients.setdefault(c.gpu, []).append(c)
    rows = []
    for g in status.gpus:
        rows += [_client_row(g, c, pod_width) for c in clients.get(g.uuid, ())]
        rows += [
            _unhooked_row(g.index, g.uuid, u, pod_width)
            for u in status.unhooked
            if g.uuid in u.gpus
        ]
    for uuid in unhooked_gpus:
        rows += [
            _unhooked_row(index.get(uuid), uuid, u, pod_width)
            for u in status.unhooked
            if uuid in u.gpus
        ]
    if not rows:
        return []
    head = TABLE.format("GPU", "UUID", "PID", "PROCESS", "STATE", "USED", "LIMIT", "CORE", "POD")
    return [head, *rows]


def notes(status: StatusView) -> list[str]:
    lines = []
    if any(top_view.state(c) == top_view.UNGATED for c in status.clients):
        lines += textwrap.wrap(top_view.UNGATED_NOTE, WIDTH, subsequent_indent="  ")
    if status.unhooked:
        text = (
            f"{len(status.unhooked)} GPU process(es) run without the hook (unshared, "
            "unlimited); the daemon's log says why each is likely"
        )
        lines += textwrap.wrap(text, WIDTH, subsequent_indent="  ")
    for b in status.backstop:
        state = (
            f"active, {len(b.limits)} cgroup(s) limited" if b.active else f"inactive: {b.reason}"
        )
        text = f"kernel backstop on GPU {short_uuid(b.gpu)}: {state}"
        lines += textwrap.wrap(text, WIDTH, subsequent_indent="  ")
    return lines


def lines(status: StatusView, width: int = WIDTH) -> list[str]:
    """`nvsharectl status`: fits `width` columns but for a long policy path or error."""
    out = policy_lines(status.policy) if status.policy is not None else []
    out += scheduler_lines(status)
    if not status.gpus:
        out.append("no GPU has a client of the scheduler yet")
    pid_of = {c.id: c.pid for c in status.clients}
    for g in status.gpus:
        out += gpu_lines(g, pid_of)
    table = process_table(status, width)
    return out + (["", *table] if table else []) + notes(status)


# ------------------------------------------------------------------ --wide


def wide_lines(status: StatusView) -> list[str]:
    """Everything: whole UUIDs, client ids, NVML's view, context, shares, priorities, gangs."""
    out = policy_lines(status.policy) if status.policy is not None else []
    out += scheduler_lines(status)
    if not status.gpus:
        out.append("no GPU has a client of the scheduler yet")
    pid_of = {c.id: c.pid for c in status.clients}
    for g in status.gpus:
        out.append(
            f"GPU {_index(g.index)} {g.uuid} {g.model or ''}  mode {g.mode.value} "
            f"({g.mode_source})  TQ {g.time_quantum_s:g} s ({g.tq_source})  "
            f"memory {_mem(g.memory_total)}"
        )
        holders = ", ".join(f"{h} (pid {pid_of.get(h, '?')})" for h in g.holders) or "-"
        queue = ", ".join(f"{q} (pid {pid_of.get(q, '?')})" for q in g.queue) or "-"
        out.append(f"  lock holders: {holders}  queue: {queue}")
        if note := top_view.scaled_requests(g):
            out.append(f"  {note}")
    if status.clients or status.unhooked:
        out.append(
            f"{'ID':>4} {'PID':>8} {'PROCESS':<15} {'POD':<28} {'STATE':<9} {'MEM USED':>9} "
            f"{'MEM LIMIT':>9} {'NVML':>9} {'CONTEXT':>9} {'CORE':>5} {'REQ':>7} {'PRIO':>6} GPU"
        )
    for c in status.clients:
        out.append(
            f"{c.id:>4} {c.pid:>8} {c.command or '?':<15} {c.pod:<28} {top_view.state(c):<9} "
            f"{_mem(c.memory_used):>9} {_mem(c.memory_limit):>9} "
            f"{_mem(c.memory_observed):>9} {_mem(top_view.overhead(c)):>9} "
            f"{c.core_limit:>4}% {top_view.guaranteed(c):>7} {priority_name(c.priority):>6} {c.gpu}"
            + (f"  gang: {c.gang}" if c.gang else "")
            + (f"  late drops: {c.late_drops}" if c.late_drops else "")
        )
    for u in status.unhooked:
        out.append(
            f"{'-':>4} {u.pid:>8} {u.command or '?':<15} {u.pod:<28} {'UNHOOKED':<9} "
            f"{_mem(u.memory_used):>9} {'-':>9} {_mem(u.memory_used):>9} {'-':>9} {'-':>5} "
            f"{'-':>7} {'-':>6} {','.join(u.gpus)}"
        )
    if any(c.memory_observed is not None for c in status.clients):
        out.append(
            "NVML: what NVML shows the process holding; CONTEXT: NVML minus MEM USED (the "
            "hook's count), the CUDA context and the driver's own memory"
        )
    return out + notes(status)


def echo(status: StatusView, *, wide: bool, width: int) -> None:
    for line in wide_lines(status) if wide else lines(status, width):
        click.echo(line)


# ------------------------------------------------------------------ policy explain


def said_by(view: PolicyView, path: str, source: str) -> str:
    losers = view.overridden.get(path, ())
    return f"{source} (overrides {', '.join(losers)})" if losers else source


def explain_layers(view: PolicyView) -> None:
    """Which file won each field the policy files set, and which files it overrode."""
    click.echo(f"# files in merge order (a later one wins): {', '.join(view.files) or 'none'}")
    set_here = {path: said for path, said in view.values.items() if said[1] != "default"}
    if not set_here:
        click.echo("# no file sets anything: every value is the built-in default")
    for path, (value, source) in sorted(set_here.items()):
        click.echo(f"{path} = {json.dumps(value)}    # {said_by(view, path, source)}")
