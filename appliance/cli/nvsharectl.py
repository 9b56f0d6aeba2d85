"""`nvsharectl`: talks to the running daemon over its socket.

It keeps nvshare's flags (`-T/--set-tq`, `-S/--anti-thrash`) and adds status, mode, limit and
policy tools. Every command prints what the daemon answered; when no daemon answers it prints
one line saying where it looked and exits 1. No error reaches a user as a traceback: anything
unexpected is one line and exit status 1 (NVSHARE_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from appliance.cli import status_view, top_view
from appliance.cli.client import ControlClient, DaemonUnavailable
from appliance.cli.common import control_dir_option, program, socket_dir_option
from appliance.core.names import pod_name_problem
from appliance.core.views import (
    ExplainView,
    OverridesView,
    PolicyView,
    StatusView,
    from_json,
)
from appliance.policy.model import MAX_DURATION_S, MIN_TIME_QUANTUM_S, Mode
from appliance.policy.quantity import QuantityError, format_bytes, parse_size
from appliance.wire import framing, socket_dirs
from appliance.wire import protocol as p
from appliance.wire.messages import Decoded, Message

FOLLOW_POLICY = "policy"
V = TypeVar("V")
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: no process id is larger
PID = click.IntRange(1, PID_MAX)


def _fail(message: str) -> NoReturn:
    click.echo(f"nvsharectl: {message}", err=True)
    sys.exit(1)


def _time_quantum(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """-T's value: whole seconds within the policy's bounds, or `policy`."""
    if value is None or value == FOLLOW_POLICY:
        return value
    low, high = int(MIN_TIME_QUANTUM_S), int(MAX_DURATION_S)
    try:
        seconds = int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a whole number of seconds, or 'policy'"
        ) from None
    if not low <= seconds <= high:
        raise click.BadParameter(f"{seconds} is not from {low} to {high} seconds (24h)")
    return seconds


def _connect(ctx: click.Context) -> ControlClient:
    try:
        return ControlClient(control_dir=ctx.obj["control_dir"])
    except DaemonUnavailable as exc:
        _fail(str(exc))


def _answer(reply: Decoded) -> None:
    """Print the daemon's OK/ERROR reply; exit 1 on an error."""
    if isinstance(reply, p.Result):
        if reply.status is p.Status.OK:
            click.echo(reply.message)
            return
        _fail(f"the scheduler refused: {reply.message}")
    _fail(f"unexpected reply from the scheduler: {reply!r}")


def _request(ctx: click.Context, message: Message) -> Decoded:
    with _connect(ctx) as conn:
        try:
            return conn.request(message)
        except TimeoutError:
            _fail(f"the scheduler at {conn.path} did not answer within {conn.timeout:g} s")
        except (DaemonUnavailable, OSError, framing.ProtocolError) as exc:
            _fail(str(exc))


@program("nvsharectl")
@click.option(
    "-T",
    "--set-tq",
    "set_tq",
    metavar="N|policy",
    callback=_time_quantum,
    help="Set the time quantum to N seconds (1-86400; nvshare's flag), or 'policy' to "
    "follow the policy's again.",
)
@click.option(
    "-S",
    "--anti-thrash",
    "anti_thrash",
    type=click.Choice(["on", "off", FOLLOW_POLICY]),
    help="Turn anti-thrashing (strict serialisation) on or off on every GPU (nvshare's flag), "
    "or 'policy' to follow the policy's mode again.",
)
@socket_dir_option
@control_dir_option
@click.pass_context
def nvsharectl(
    ctx: click.Context,
    set_tq: int | str | None,
    anti_thrash: str | None,
    socket_dir: Path | None,
    control_dir: Path | None,
) -> None:
    """Control and inspect the nvshare scheduler."""
    socket_dir = socket_dir or socket_dirs.socket_dir_from_env()
    ctx.obj = {"control_dir": control_dir or socket_dirs.control_dir_for(socket_dir, {})}
    if set_tq == FOLLOW_POLICY:
        _answer(_request(ctx, p.SetTq(0, flags=p.SET_FOLLOW_POLICY)))
    elif isinstance(set_tq, int):
        _answer(_request(ctx, p.SetTq(set_tq)))
        if set_tq < 10:
            click.echo(
                "note: quanta under 10 s can cost throughput when jobs thrash "
                "(nvshare's measurements)",
                err=True,
            )
    if anti_thrash is not None:
        _answer(_request(ctx, _set_mode(anti_thrash, "")))
    if ctx.invoked_subcommand is None and set_tq is None and anti_thrash is None:
        ctx.invoke(status)


def _fmt_mem(n: int | None) -> str:
    return "-" if not n else format_bytes(n) if n % (1 << 20) == 0 else f"{n / (1 << 20):.1f}Mi"


@nvsharectl.command()
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status document.")
@click.option(
    "-w",
    "--wide",
    is_flag=True,
    help="Everything: whole GPU UUIDs, client ids, NVML's memory, priorities, gangs.",
)
@click.pass_context
def status(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """Show GPUs, modes, lock holders, queues and processes."""
    doc = _request(ctx, p.StatusRequest())
    if not isinstance(doc, p.JsonBody):
        _answer(doc)
        return
    if as_json:
        click.echo(json.dumps(doc.doc, indent=2, sort_keys=True))
    else:
        width = shutil.get_terminal_size((status_view.WIDTH, 24)).columns
        status_view.echo(from_json(StatusView, doc.doc), wide=wide, width=width)


@nvsharectl.command()
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "-d",
    "--delay",
    type=click.FloatRange(min=0.2, max=60),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes (with --once: between the two samples GPU% compares).",
)
@click.pass_context
def top(ctx: click.Context, once: bool, delay: float) -> None:
    """A live view of GPUs, lock holders, queues and clients; q quits.

    Per GPU its mode, TQ, utilisation, lock holder and queue; per client its pod, state, share
    of GPU time over the last 2 s, core limit, guaranteed share (REQ), priority, quota window,
    memory (the hook's count, NVML's, and the difference: the context) and gang. A terminal
    narrower than the row drops CTX, NVML, LIMIT, QUOTA, USED in that order, as needed.
    """
    if not once and not top_view.is_terminal(sys.stdin.fileno(), sys.stdout):
        _fail("top needs a terminal (ssh -t, kubectl exec -it); --once prints one frame")
    feed = top_view.StatusFeed(ctx.obj["control_dir"])
    try:
        top_view.run(feed, interval_s=delay, single=once)
    except top_view.UNREACHABLE as exc:
        _fail(str(exc))
    finally:
        feed.close()


def _set_mode(mode: str, gpu: str) -> p.SetMode:
    if mode == FOLLOW_POLICY:
        return p.SetMode(p.WireMode.ON, gpu, flags=p.SET_FOLLOW_POLICY)
    return p.SetMode(p.wire_mode(Mode(mode)), gpu)


@nvsharectl.command()
@click.argument("mode", type=click.Choice(["on", "off", "auto", FOLLOW_POLICY]))
@click.option(
    "--gpu",
    default="",
    metavar="GPU",
    help="Only this GPU: its index (as nvidia-smi numbers it), UUID or a unique start of its "
    "UUID; default every GPU.",
)
@click.pass_context
def mode(ctx: click.Context, mode: str, gpu: str) -> None:
    """Set the scheduling mode of every GPU, or of one.

    on serialises, off lets everyone run, auto runs together while memory fits. `policy`
    drops what nvsharectl set (on that GPU, or on all): the policy's mode applies again.
    """
    _answer(_request(ctx, _set_mode(mode, gpu)))


def _target(pid: int | None, pod: str | None) -> tuple[int, str, str]:
    """(pid, namespace, name) of --pid or --pod; any name Kubernetes accepts fits the wire."""
    if (pid is None) == (pod is None):
        raise click.UsageError("name exactly one of --pid N or --pod NAMESPACE/NAME")
    if pod is not None:
        ns, _, name = pod.partition("/")
        if not ns or not name or "/" in name:
            raise click.BadParameter(
                f"{pod!r} is not NAMESPACE/NAME (say default/{pod} for the default namespace)",
                param_hint="--pod",
            )
        if (problem := pod_name_problem(ns, name)) is not None:
            raise click.BadParameter(problem, param_hint="--pod")
        return 0, ns, name
    assert pid is not None
    return pid, "", ""


@nvsharectl.group()
def limit() -> None:
    """Change, clear or list live limit overrides.

    Changing them needs root or the daemon's --admin-group; listing them does not.
    """


class SignedSizes(click.Command):
    """A command with a MEMORY argument that a user may give a sign: `-5Gi` is a size refused
    as such, not an option nobody has (`No such option '-5'`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes its list
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            signed = [a for a in given if a.startswith(exc.option_name) and a[1:2].isdigit()]
            if not signed:
                raise
            raise click.BadParameter(
                _NEGATIVE.format(signed[0]), ctx, param_hint="MEMORY"
            ) from None


_NEGATIVE = "{}: a memory limit must be positive (`limit clear` removes one)"


@limit.command("set", cls=SignedSizes)
@click.option("--pid", type=PID, help="A process connected to the scheduler.")
@click.option("--pod", help="A pod, as NAMESPACE/NAME.")
@click.option("--core", type=click.IntRange(1, 100), help="Compute share in percent.")
@click.argument("memory", required=False)
@click.pass_context
def limit_set(
    ctx: click.Context, pid: int | None, pod: str | None, core: int | None, memory: str | None
) -> None:
    """Override the memory and/or core limit of a process or pod.

    MEMORY is a size as in policy files: 4Gi, 1.5G, 512Mi; a bare number is MiB. A pid must be
    connected, and its override ends when it exits; a pod's waits for the pod if need be.
    """
    target_pid, ns, name = _target(pid, pod)
    flags, mem = 0, 0
    if memory is not None:
        if memory.lstrip().startswith("-"):
            raise click.BadParameter(_NEGATIVE.format(memory), param_hint="MEMORY")
        try:
            mem = parse_size(memory)
        except QuantityError as exc:
            raise click.BadParameter(str(exc), param_hint="MEMORY") from None
        if mem == 0:
            raise click.BadParameter(
                "a memory limit must be greater than 0 (`limit clear` removes one)",
                param_hint="MEMORY",
            )
        flags |= p.LIMIT_SET_HAS_MEM
    if core is not None:
        flags |= p.LIMIT_SET_HAS_CORE
    if not flags:
        raise click.UsageError("give a MEMORY limit, --core, or both")
    _answer(_request(ctx, p.LimitSet(target_pid, flags, mem, core or 0, ns, name)))


@limit.command("clear")
@click.option("--pid", type=PID, help="A process connected to the scheduler.")
@click.option("--pod", help="A pod, as NAMESPACE/NAME.")
@click.option("--memory/--no-memory", "clear_mem", default=True, help="Clear the memory limit.")
@click.option("--core/--no-core", "clear_core", default=True, help="Clear the core limit.")
@click.pass_context
def limit_clear(
    ctx: click.Context, pid: int | None, pod: str | None, clear_mem: bool, clear_core: bool
) -> None:
    """Remove an override: the policy or annotation value applies again."""
    target_pid, ns, name = _target(pid, pod)
    if not clear_mem and not clear_core:
        raise click.UsageError("--no-memory and --no-core together leave nothing to clear")
    flags = (p.LIMIT_SET_CLEAR_MEM if clear_mem else 0) | (
        p.LIMIT_SET_CLEAR_CORE if clear_core else 0
    )
    _answer(_request(ctx, p.LimitSet(target_pid, flags, 0, 0, ns, name)))


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's answer as JSON.")
@click.pass_context
def limit_list(ctx: click.Context, as_json: bool) -> None:
    """List what nvsharectl set: limits, time quantum, modes."""
    view = _view(ctx, "overrides", OverridesView, as_json=as_json)
    if view is None:
        return
    if view.time_quantum_s is not None:
        click.echo(f"time quantum: {view.time_quantum_s:g} s (policy: `nvsharectl -T policy`)")
    for gpu, mode in sorted(view.modes.items()):
        where = "every GPU" if gpu == "*" else gpu
        click.echo(f"mode: {mode.value} on {where} (policy: `nvsharectl mode policy`)")
    if not view.limits:
        click.echo("no limit overrides")
        return
    click.echo(f"{'TARGET':<40} {'MEMORY':>9} {'CORE':>5} CONNECTED PIDS")
    for row in view.limits:
        core = f"{row.core_limit}%" if row.core_limit else "-"
        pids = ", ".join(map(str, row.clients)) or "none yet"
        click.echo(f"{row.target:<40} {_fmt_mem(row.memory_limit):>9} {core:>5} {pids}")


@nvsharectl.group()
def policy() -> None:
    """Validate policy files, or show the running daemon's policy."""


@policy.command("validate")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
def policy_validate(paths: tuple[Path, ...]) -> None:
    """Check policy files, directories or ConfigMaps offline.

    PATH may be a policy directory or file, a ConfigMap manifest or a directory of them, or -
    for standard input (kubectl kustomize deploy/ | nvsharectl policy validate -).
    """
    from appliance.policy.load import STDIN, check_paths

    given = [str(x) for x in paths]
    stdin = sys.stdin.buffer.read() if STDIN in given else b""
    found = check_paths(given, stdin=stdin)
    for line in found.skipped:
        click.echo(line, err=True)
    for err in found.errors:
        click.echo(str(err), err=True)
    if found.errors:
        click.echo(f"{len(found.errors)} error(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: {', '.join('standard input' if x == STDIN else x for x in given)}")


def _query(ctx: click.Context, name: str, **args: Any) -> Any:
    reply = _request(ctx, p.JsonBody(p.MsgType.QUERY, {"query": name, **args}))
    if isinstance(reply, p.JsonBody):
        return reply.doc
    if isinstance(reply, p.Result) and reply.status is not p.Status.OK:
        _fail(f"the scheduler refused: {reply.message}")
    _fail(f"unexpected reply from the scheduler to a {name} query: {reply!r:.200}")


def _view(ctx: click.Context, name: str, kind: type[V], *, as_json: bool) -> V | None:
    """The daemon's answer to a query as a typed view; None once printed as JSON instead."""
    doc = _query(ctx, name)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return None
    return from_json(kind, doc)


@policy.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def policy_show(ctx: click.Context, as_json: bool) -> None:
    """The running daemon's policy, and what set each value."""
    view = _view(ctx, "policy", PolicyView, as_json=as_json)
    if view is None:
        return
    click.echo(
        f"# policy from {view.dir} (hash {view.hash[:12]}; files: "
        f"{', '.join(view.files) or 'none'})"
    )
    for path, (value, source) in sorted(view.values.items()):
        click.echo(f"{path} = {json.dumps(value)}    # {status_view.said_by(view, path, source)}")


@policy.command("explain")
@click.option("--pid", type=PID)
@click.option("--pod", help="NAMESPACE/NAME")
@click.pass_context
def policy_explain(ctx: click.Context, pid: int | None, pod: str | None) -> None:
    """What set each policy value, or each limit of a client.

    With --pid or --pod: the client's effective limits and what set each of them. Without:
    which file won each field the policy files set, and which files it overrode.
    """
    if pid is None and pod is None:
        status_view.explain_layers(from_json(PolicyView, _query(ctx, "policy")))
        return
    _target(pid, pod)
    view = from_json(ExplainView, _query(ctx, "explain", pid=pid, pod=pod))
    if not view.clients:
        _fail(f"no connected client matches {'pid ' + str(pid) if pid else 'pod ' + str(pod)}")
    for row in view.clients:
        click.echo(f"client {row.client} pid {row.pid} pod {row.pod} gpu {row.gpu}")
        said_by = (
            ("memory", row.memory),
            ("core", row.core),
            ("request", row.request),
            ("priority", row.priority),
            ("gated", row.gated),
            ("kernel backstop", row.backstop),
        )
        for key, said in said_by:
            if not said and key == "kernel backstop":
                continue
            click.echo(f"  {key}: {said}")
