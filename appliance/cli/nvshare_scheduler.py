"""`nvshare-scheduler`: the node daemon, and the cluster's webhook and extender servers.

Each is started from here and built elsewhere: the daemon by `appliance.daemon.daemon`, the MIG
fallback webhook by `appliance.cluster.webhook`, the scheduler extender by
`appliance.cluster.extender`. Every way one cannot start is one line on stderr and exit status 1.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import click

from appliance.cli.common import (
    configure_logging,
    control_dir_option,
    kube_api_option,
    policy_dir_option,
    program,
    socket_dir_option,
)
from appliance.wire import socket_dirs


@program("nvshare-scheduler")
@policy_dir_option("Directory of policy files (a mounted ConfigMap)")
@socket_dir_option
@control_dir_option
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
@kube_api_option
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
    "--open-files",
    type=click.IntRange(256, 1 << 20),
    envvar="NVSHARE_OPEN_FILES",
    default=65536,
    show_default=True,
    help="Raise the soft limit of open files to this (at most the hard limit); every "
    "connection takes one [env NVSHARE_OPEN_FILES].",
)
@click.option(
    "--nice",
    type=click.IntRange(-20, 19),
    envvar="NVSHARE_NICE",
    default=-10,
    show_default=True,
    help="Run at this nice value, set before any thread starts (below the one it has takes "
    "root or CAP_SYS_NICE): on a node whose CPUs are all busy every grant waits for the "
    "daemon to get one [env NVSHARE_NICE].",
)
@click.option(
    "--proc-root",
    type=click.Path(path_type=Path, file_okay=False),
    envvar="NVSHARE_PROC_ROOT",
    default=Path("/proc"),
    show_default=True,
    help="Where clients' /proc/<pid> entries are read (tests give a tree whose cgroup files "
    "place processes in pods) [env NVSHARE_PROC_ROOT].",
)
@click.option(
    "--probe-address",
    envvar="NVSHARE_PROBE_ADDRESS",
    default=None,
    metavar="HOST:PORT",
    help="Also serve /healthz and /readyz here, whether or not metrics are enabled "
    "([::]:9403 in deploy/) [env NVSHARE_PROBE_ADDRESS]; without it, only with the metrics.",
)
@click.option(
    "--debug", is_flag=True, envvar="NVSHARE_DEBUG", help="Debug logging [env NVSHARE_DEBUG]."
)
@click.pass_context
def scheduler_main(
    ctx: click.Context,
    policy_dir: Path,
    socket_dir: Path | None,
    control_dir: Path | None,
    admin_group: str | None,
    node_name: str | None,
    kube_api: str | None,
    device_plugin: bool,
    hook_host_path: str,
    open_files: int,
    nice: int,
    proc_root: Path,
    probe_address: str | None,
    debug: bool,
) -> None:
    """The nvshare node daemon: lock scheduler, policy, pod annotations, metrics."""
    configure_logging(debug=debug or os.environ.get("NVSHARE_DEBUG", "") not in ("", "0"))
    if ctx.invoked_subcommand is not None:
        return
    from appliance.daemon.cpu import set_nice

    set_nice(nice)  # before any thread starts: they all inherit it
    from appliance.daemon.daemon import DaemonConfig, run_daemon

    config = DaemonConfig(
        policy_dir=policy_dir,
        socket_dir=socket_dir or socket_dirs.socket_dir_from_env(),
        control_dir=control_dir,
        admin_group=admin_group,
        node_name=node_name,
        kube_api=kube_api,
        device_plugin=device_plugin,
        hook_host_path=hook_host_path,
        open_files=open_files,
        proc_root=proc_root,
        probe_address=probe_address,
    )
    tune_collector()
    sys.exit(run_daemon(config))


# Net new container objects between the garbage collector's young passes (CPython's default:
# 700). A status or a scrape at 2000 clients holds a few thousand rows' objects over its
# slices; at 700 they were promoted each time and soon set off a full collection over every
# client's objects (70-180 ms of a stalled event loop, measured); at 10,000 they die young,
# and a young pass over that many takes about a millisecond (bench/results/lock_handoff.md).
YOUNG_OBJECTS = 10_000


def tune_collector() -> None:
    """The daemon's process only, once its modules are loaded: what exists now is kept for
    good (`gc.freeze`: some 37,000 objects no full collection walks again), and young passes
    come less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, middle, old)


host_option = click.option(
    "--host",
    default="::",
    show_default=True,
    help="Address to listen on; '::' is every address of both IP families (IPv4 only, with a "
    "log line, where the host has no IPv6).",
)


@scheduler_main.command("webhook")
@policy_dir_option("Policy directory holding migFallback chains", envvar=None)
@click.option("--cert-file", type=click.Path(path_type=Path), required=True)
@click.option("--key-file", type=click.Path(path_type=Path), required=True)
@click.option("--port", type=int, default=8443, show_default=True)
@click.option(
    "--namespace",
    envvar="POD_NAMESPACE",
    default="nvshare-system",
    show_default=True,
    help="Namespace of the ConfigMap in which the webhook's replicas share their admissions "
    "(nvshare-mig-admissions); the webhook's own (POD_NAMESPACE) in deploy/.",
)
@host_option
@kube_api_option
def webhook(
    policy_dir: Path,
    cert_file: Path,
    key_file: Path,
    port: int,
    namespace: str,
    host: str,
    kube_api: str | None,
) -> None:
    """Serve the MIG-fallback mutating admission webhook over HTTPS."""
    from appliance.cluster.webhook_server import run_webhook

    for flag, path in (("--cert-file", cert_file), ("--key-file", key_file)):
        if not path.is_file() or not os.access(path, os.R_OK):
            click.echo(
                f"nvshare-scheduler webhook: {flag} {path}: no readable file there", err=True
            )
            sys.exit(1)
    sys.exit(
        run_webhook(
            policy_dir=policy_dir,
            cert_file=cert_file,
            key_file=key_file,
            port=port,
            host=host,
            kube_api=kube_api,
            namespace=namespace,
        )
    )


@scheduler_main.command("extender")
@click.option("--port", type=click.IntRange(1, 65535), default=8888, show_default=True)
@host_option
@kube_api_option
@policy_dir_option("Policy directory: realtimeCheck, annotation caps, rules")
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
    from appliance.cluster.extender_server import run_extender

    sys.exit(
        run_extender(policy_dir=policy_dir, kube_api=kube_api, switch=switch, host=host, port=port)
    )


@scheduler_main.command("clear-backstop")
@click.pass_context
def clear_backstop(ctx: click.Context) -> None:
    """Clear the kernel backstop's limits once the daemon has stopped for good.

    A stopping daemon leaves them set, to keep protecting while it restarts; this clears the
    ones its record (backstop.json in the socket directory) names, one line each. Refused while
    a daemon serves that directory: it would set them again.
    """
    from appliance.gpu.backstop import RECORD_NAME, clear_recorded
    from appliance.gpu.nvml import Nvml
    from appliance.serve.socket_claim import answering_pid

    socket_dir = ctx.parent.params["socket_dir"] if ctx.parent else None
    socket_dir = socket_dir or socket_dirs.socket_dir_from_env()
    record = socket_dir / RECORD_NAME
    pid = answering_pid(socket_dir / socket_dirs.SOCKET_NAME)
    if pid is not None:
        click.echo(
            f"nvshare-scheduler clear-backstop: a daemon (pid {pid or 'unknown'}) serves "
            f"{socket_dir} and would set the limits again; stop it first (systemctl stop "
            "nvshare-scheduler); nothing was cleared",
            err=True,
        )
        sys.exit(1)
    if not record.is_file():
        click.echo(f"no kernel backstop limits recorded in {record}: nothing to clear")
        return
    nvml = Nvml()
    if not nvml.available:
        click.echo(
            f"nvshare-scheduler clear-backstop: {nvml.reason}; the limits in {record} stay set",
            err=True,
        )
        sys.exit(1)
    said = clear_recorded(nvml, record)
    for line in said:
        click.echo(line)
    if any("still limited" in line for line in said):
        sys.exit(1)
