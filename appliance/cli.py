"""Entry points: `nvshare-scheduler` (the node daemon) and `nvsharectl` (talks to it).

nvsharectl keeps nvshare's flags (`-T/--set-tq`, `-S/--anti-thrash`) and adds status, mode,
limit and policy tools. Every command prints what the daemon answered; when no daemon answers
it prints one line saying where it looked and exits 1. No error reaches a user as a traceback:
anything unexpected is one line and exit status 1 (NVSHARE_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from appliance import protocol as p
from appliance.client import ControlClient, DaemonUnavailable
from appliance.core.views import (
    ExplainView,
    OverridesView,
    PolicyStatus,
    PolicyView,
    StatusView,
    from_json,
)
from appliance.policy.model import MAX_DURATION_S, MIN_TIME_QUANTUM_S, Mode
from appliance.policy.quantity import QuantityError, format_bytes, parse_size

DEFAULT_POLICY_DIR = Path("/etc/nvshare/policy.d")
PACKAGE = "nvshare-appliance"
FOLLOW_POLICY = "policy"


def _fail(message: str) -> NoReturn:
    click.echo(f"nvsharectl: {message}", err=True)
    sys.exit(1)


class OneLineErrors(click.Group):
    """A command group whose unexpected errors are one line and exit status 1, not a traceback
    (NVSHARE_DEBUG=1 keeps the traceback, for a bug report)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("NVSHARE_DEBUG", "") not in ("", "0"):
                raise
            click.echo(f"{ctx.command_path.split()[0]}: {exc or type(exc).__name__}", err=True)
            ctx.exit(1)


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
        return ControlClient(ctx.obj["socket_dir"])
    except DaemonUnavailable as exc:
        _fail(str(exc))


def _answer(reply: Any) -> None:
    """Print the daemon's OK/ERROR reply; exit 1 on an error."""
    if isinstance(reply, p.Result):
        if reply.status is p.Status.OK:
            click.echo(reply.message)
            return
        _fail(f"the scheduler refused: {reply.message}")
    _fail(f"unexpected reply from the scheduler: {reply!r}")


def _request(ctx: click.Context, message: Any) -> Any:
    with _connect(ctx) as conn:
        try:
            return conn.request(message)
        except TimeoutError:
            _fail(f"the scheduler at {conn.path} did not answer within {conn.timeout:g} s")
        except (DaemonUnavailable, OSError, p.ProtocolError) as exc:
            _fail(str(exc))


# ------------------------------------------------------------------ nvsharectl


@click.group(
    cls=OneLineErrors,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name=PACKAGE, prog_name="nvsharectl")
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
@click.option(
    "--socket-dir",
    type=click.Path(path_type=Path),
    envvar="NVSHARE_SOCKET_DIR",
    default=None,
    help="Where scheduler.sock lives [env NVSHARE_SOCKET_DIR; default /var/run/nvshare].",
)
@click.pass_context
def nvsharectl(
    ctx: click.Context, set_tq: int | str | None, anti_thrash: str | None, socket_dir: Path | None
) -> None:
    """Control and inspect the nvshare scheduler."""
    ctx.obj = {"socket_dir": socket_dir or p.socket_dir_from_env()}
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


def _print_status(status: StatusView) -> None:
    if status.policy is not None:
        _print_policy_status(status.policy)
    if not status.gpus:
        click.echo(
            f"no GPUs in use yet (default mode {status.default_mode.value}, "
            f"TQ {status.default_time_quantum_s:g} s)"
        )
    for g in status.gpus:
        click.echo(
            f"GPU {g.uuid}  mode {g.mode.value} ({g.mode_source})  "
            f"TQ {g.time_quantum_s:g} s ({g.tq_source})  "
            f"memory {_fmt_mem(g.memory_total)}"
        )
        click.echo(f"  lock holders: {list(g.holders) or '-'}  queue: {list(g.queue) or '-'}")
    if status.clients:
        click.echo(
            f"{'ID':>4} {'PID':>8} {'POD':<28} {'STATE':<9} {'MEM USED':>9} "
            f"{'MEM LIMIT':>9} {'CORE':>5} GPU"
        )
    for c in status.clients:
        click.echo(
            f"{c.id:>4} {c.pid:>8} {c.pod:<28} {c.state.value:<9} "
            f"{_fmt_mem(c.memory_used):>9} {_fmt_mem(c.memory_limit):>9} "
            f"{c.core_limit:>4}% {c.gpu}"
        )


def _print_policy_status(policy: PolicyStatus) -> None:
    state = "valid" if policy.valid else "INVALID (last good kept)"
    click.echo(
        f"policy: {policy.dir} hash {policy.hash[:12]} {state}; "
        f"files: {', '.join(policy.files) or '(none: defaults)'}"
    )
    if policy.last_error:
        click.echo(f"  last error: {policy.last_error}")
    for name, source in sorted(policy.env_overrides.items()):
        click.echo(f"  override from environment: {name} ({source})")


@nvsharectl.command()
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status document.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show GPUs, modes, time quanta, clients, lock holders and queues."""
    doc = _request(ctx, p.StatusRequest())
    if not isinstance(doc, p.JsonBody):
        _answer(doc)
        return
    if as_json:
        click.echo(json.dumps(doc.doc, indent=2, sort_keys=True))
    else:
        _print_status(from_json(StatusView, doc.doc))


def _set_mode(mode: str, gpu: str) -> p.SetMode:
    if mode == FOLLOW_POLICY:
        return p.SetMode(p.WireMode.ON, gpu, flags=p.SET_FOLLOW_POLICY)
    return p.SetMode(p.wire_mode(Mode(mode)), gpu)


@nvsharectl.command()
@click.argument("mode", type=click.Choice(["on", "off", "auto", FOLLOW_POLICY]))
@click.option("--gpu", default="", help="Only this GPU (UUID); default every GPU.")
@click.pass_context
def mode(ctx: click.Context, mode: str, gpu: str) -> None:
    """Set the scheduling mode of every GPU, or of one.

    on serialises, off lets everyone run, auto runs together while memory fits. `policy`
    drops what nvsharectl set (on that GPU, or on all): the policy's mode applies again.
    """
    _answer(_request(ctx, _set_mode(mode, gpu)))


def _target(pid: int | None, pod: str | None) -> tuple[int, str, str]:
    if (pid is None) == (pod is None):
        raise click.UsageError("name exactly one of --pid N or --pod NAMESPACE/NAME")
    if pod is not None:
        ns, _, name = pod.partition("/")
        if not ns or not name or "/" in name:
            raise click.BadParameter(
                f"{pod!r} is not NAMESPACE/NAME (say default/{pod} for the default namespace)",
                param_hint="--pod",
            )
        return 0, ns, name
    assert pid is not None
    return pid, "", ""


@nvsharectl.group()
def limit() -> None:
    """Change, clear or list live limit overrides.

    Changing them needs root or the daemon's --admin-group; listing them does not.
    """


@limit.command("set")
@click.option("--pid", type=click.IntRange(min=1), help="A process connected to the scheduler.")
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
@click.option("--pid", type=click.IntRange(min=1), help="A process connected to the scheduler.")
@click.option("--pod", help="A pod, as NAMESPACE/NAME.")
@click.option("--memory/--no-memory", "clear_mem", default=True, help="Clear the memory limit.")
@click.option("--core/--no-core", "clear_core", default=True, help="Clear the core limit.")
@click.pass_context
def limit_clear(
    ctx: click.Context, pid: int | None, pod: str | None, clear_mem: bool, clear_core: bool
) -> None:
    """Remove an override: the policy or annotation value applies again."""
    target_pid, ns, name = _target(pid, pod)
    flags = (p.LIMIT_SET_CLEAR_MEM if clear_mem else 0) | (
        p.LIMIT_SET_CLEAR_CORE if clear_core else 0
    )
    _answer(_request(ctx, p.LimitSet(target_pid, flags, 0, 0, ns, name)))


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's answer as JSON.")
@click.pass_context
def limit_list(ctx: click.Context, as_json: bool) -> None:
    """List what nvsharectl set: limits, time quantum, modes."""
    doc = _query(ctx, "overrides")
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    view = from_json(OverridesView, doc)
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
    """Check policy files, directories or ConfigMaps offline."""
    from appliance.policy.load import validate_paths

    errors = validate_paths(list(paths))
    for err in errors:
        click.echo(str(err), err=True)
    if errors:
        click.echo(f"{len(errors)} error(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: {', '.join(str(x) for x in paths)}")


def _query(ctx: click.Context, name: str, **args: Any) -> Any:
    reply = _request(ctx, p.JsonBody(p.MsgType.QUERY, {"query": name, **args}))
    if not isinstance(reply, p.JsonBody):
        _answer(reply)
    return reply.doc


@policy.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def policy_show(ctx: click.Context, as_json: bool) -> None:
    """The running daemon's policy, and what set each value."""
    doc = _query(ctx, "policy")
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    view = from_json(PolicyView, doc)
    click.echo(
        f"# policy from {view.dir} (hash {view.hash[:12]}; files: "
        f"{', '.join(view.files) or 'none'})"
    )
    for path, (value, source) in sorted(view.values.items()):
        click.echo(f"{path} = {json.dumps(value)}    # {source}")


@policy.command("explain")
@click.option("--pid", type=click.IntRange(min=1))
@click.option("--pod", help="NAMESPACE/NAME")
@click.pass_context
def policy_explain(ctx: click.Context, pid: int | None, pod: str | None) -> None:
    """The effective limits of a client and what set each of them."""
    _target(pid, pod)
    view = from_json(ExplainView, _query(ctx, "explain", pid=pid, pod=pod))
    if not view.clients:
        _fail(f"no connected client matches {'pid ' + str(pid) if pid else 'pod ' + str(pod)}")
    for row in view.clients:
        click.echo(f"client {row.client} pid {row.pid} pod {row.pod} gpu {row.gpu}")
        for key, said in (("memory", row.memory), ("core", row.core), ("gated", row.gated)):
            click.echo(f"  {key}: {said}")


# ------------------------------------------------------------ nvshare-scheduler


@click.group(
    cls=OneLineErrors,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name=PACKAGE, prog_name="nvshare-scheduler")
@click.option(
    "--policy-dir",
    type=click.Path(path_type=Path),
    envvar="NVSHARE_POLICY_DIR",
    default=DEFAULT_POLICY_DIR,
    show_default=True,
    help="Directory of policy files (a mounted ConfigMap) [env NVSHARE_POLICY_DIR].",
)
@click.option(
    "--socket-dir",
    type=click.Path(path_type=Path),
    envvar="NVSHARE_SOCKET_DIR",
    default=None,
    help="Directory of scheduler.sock [env NVSHARE_SOCKET_DIR; default /var/run/nvshare].",
)
@click.option(
    "--admin-group",
    envvar="NVSHARE_ADMIN_GROUP",
    default=None,
    help="Unix group whose members may change state like root [env NVSHARE_ADMIN_GROUP].",
)
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    default=None,
    help="Watch this node's pods [env NODE_NAME]; without it, no pod watch.",
)
@click.option(
    "--kube-api",
    envvar="NVSHARE_KUBE_API",
    default=None,
    help="API server URL [env NVSHARE_KUBE_API]; default in-cluster or kubeconfig.",
)
@click.option(
    "--device-plugin/--no-device-plugin",
    default=False,
    help="Serve the kubelet device plugin (nvshare.com/gpu).",
)
@click.option(
    "--hook-host-path",
    default="/var/lib/nvshare/lib/libnvshare.so",
    show_default=True,
    help="Where the hook lives on the host, for the device plugin's mounts.",
)
@click.option(
    "--debug", is_flag=True, envvar="NVSHARE_DEBUG", help="Debug logging [env NVSHARE_DEBUG]."
)
@click.pass_context
def scheduler_main(
    ctx: click.Context,
    policy_dir: Path,
    socket_dir: Path | None,
    admin_group: str | None,
    node_name: str | None,
    kube_api: str | None,
    device_plugin: bool,
    hook_host_path: str,
    debug: bool,
) -> None:
    """The nvshare node daemon: lock scheduler, policy, pod annotations, metrics."""
    if ctx.invoked_subcommand is not None:
        return
    from appliance.daemon import DaemonConfig, run_daemon

    config = DaemonConfig(
        policy_dir=policy_dir,
        socket_dir=socket_dir or p.socket_dir_from_env(),
        admin_group=admin_group,
        node_name=node_name,
        kube_api=kube_api,
        device_plugin=device_plugin,
        hook_host_path=hook_host_path,
        debug=debug or os.environ.get("NVSHARE_DEBUG", "") not in ("", "0"),
    )
    sys.exit(run_daemon(config))


@scheduler_main.command("webhook")
@click.option(
    "--policy-dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_POLICY_DIR,
    show_default=True,
    help="Policy directory holding migFallback chains.",
)
@click.option("--cert-file", type=click.Path(path_type=Path), required=True)
@click.option("--key-file", type=click.Path(path_type=Path), required=True)
@click.option("--port", type=int, default=8443, show_default=True)
@click.option(
    "--kube-api",
    envvar="NVSHARE_KUBE_API",
    default=None,
    help="API server URL; default in-cluster or kubeconfig.",
)
def webhook(
    policy_dir: Path, cert_file: Path, key_file: Path, port: int, kube_api: str | None
) -> None:
    """Serve the MIG-fallback mutating admission webhook over HTTPS."""
    import logging
    import ssl

    from appliance.kube.pods import KubeConfigError, api_client_from_env
    from appliance.kube.webhook import build_webhook_server, serve_webhook

    def die(message: str) -> NoReturn:
        click.echo(f"nvshare-scheduler webhook: {message}", err=True)
        sys.exit(1)

    for flag, path in (("--cert-file", cert_file), ("--key-file", key_file)):
        if not path.is_file() or not os.access(path, os.R_OK):
            die(f"{flag} {path}: no readable file there")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = build_webhook_server(
            policy_dir=policy_dir,
            cert_file=cert_file,
            key_file=key_file,
            port=port,
            api_client=api_client_from_env(kube_api),
        )
    except KubeConfigError as exc:
        die(str(exc))
    except ssl.SSLError as exc:
        die(f"cannot use {cert_file} with {key_file} for TLS: {exc.reason or exc}")
    except OSError as exc:
        die(f"cannot serve on port {port}: {exc.strerror or exc}")
    logging.getLogger("nvshare.webhook").info("MIG fallback chains from %s", policy_dir)
    serve_webhook(server)


@scheduler_main.command("extender")
@click.option("--port", type=click.IntRange(1, 65535), default=8888, show_default=True)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--kube-api",
    envvar="NVSHARE_KUBE_API",
    default=None,
    help="API server URL [env NVSHARE_KUBE_API]; default in-cluster or kubeconfig.",
)
@click.option(
    "--policy-dir",
    type=click.Path(path_type=Path),
    envvar="NVSHARE_POLICY_DIR",
    default=DEFAULT_POLICY_DIR,
    show_default=True,
    help="Policy directory: realtimeCheck, annotation caps, rules [env NVSHARE_POLICY_DIR].",
)
@click.option(
    "--enable-realtime-check",
    "switch",
    type=click.BOOL,
    envvar="HAMI_ENABLE_REALTIME_CHECK",
    default=None,
    metavar="true|false",
    help="false turns the real-time check off; true turns it on (strict where the policy's "
    "realtimeCheck.mode is disabled) [env HAMI_ENABLE_REALTIME_CHECK]; default: the policy.",
)
def extender(
    port: int, host: str, kube_api: str | None, policy_dir: Path, switch: bool | None
) -> None:
    """Serve the kube-scheduler extender that filters nodes on their GPUs' real free memory."""
    from appliance.kube.extender import run_extender

    sys.exit(
        run_extender(policy_dir=policy_dir, kube_api=kube_api, switch=switch, host=host, port=port)
    )
