"""What the two programs share: one-line errors instead of tracebacks, names, defaults, and the
logging every server program of nvshare-scheduler writes (the daemon, webhook, extender)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

DEFAULT_POLICY_DIR = Path("/etc/nvshare/policy.d")
F = TypeVar("F", bound=Callable[..., Any])
PACKAGE = "nvshare-appliance"
# How a shell reports a program killed by SIGPIPE (128 + 13): what `cat` and `grep` give
# under `set -o pipefail` when the reader of their output went away.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def configure_logging(*, debug: bool) -> None:
    """The one logging set-up of the node daemon, the webhook and the extender: a line per
    record on stderr (the journal or the container log adds the host and the unit), INFO and
    up, or DEBUG with --debug or NVSHARE_DEBUG."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class OneLineErrors(click.Group):
    """A command group whose unexpected errors are one line and exit status 1, not a traceback
    (NVSHARE_DEBUG=1 keeps the traceback, for a bug report)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            # The reader of our output went away (`nvsharectl status | head -2`): stop without
            # a word, as Unix tools do; what is still buffered goes nowhere.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_BROKEN_PIPE)
        except Exception as exc:
            if os.environ.get("NVSHARE_DEBUG", "") not in ("", "0"):
                raise
            click.echo(f"{ctx.command_path.split()[0]}: {exc or type(exc).__name__}", err=True)
            ctx.exit(1)


def program(name: str) -> Callable[[Callable[..., Any]], click.Group]:
    """A program's top-level command group: -h/--help, --version, one-line errors."""

    def decorate(main: Callable[..., Any]) -> click.Group:
        main = click.version_option(package_name=PACKAGE, prog_name=name)(main)
        return click.group(
            cls=OneLineErrors,
            invoke_without_command=True,
            context_settings={"help_option_names": ["-h", "--help"]},
        )(main)

    return decorate


def policy_dir_option(
    help_text: str, *, envvar: str | None = "NVSHARE_POLICY_DIR"
) -> Callable[[F], F]:
    return click.option(
        "--policy-dir",
        type=click.Path(path_type=Path),
        envvar=envvar,
        default=DEFAULT_POLICY_DIR,
        show_default=True,
        help=help_text + (f" [env {envvar}]." if envvar else "."),
    )


kube_api_option: Callable[[F], F] = click.option(
    "--kube-api",
    envvar="NVSHARE_KUBE_API",
    default=None,
    help="API server URL [env NVSHARE_KUBE_API]; default in-cluster or kubeconfig.",
)


def _directory_named(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """A directory option's value as a Path; an empty one names nothing (Path("") is ".")."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter(
            "an empty path names no directory; give one, or leave the option out for the default"
        )
    return Path(value)


socket_dir_option: Callable[[F], F] = click.option(
    "--socket-dir",
    type=click.Path(),
    callback=_directory_named,
    envvar="NVSHARE_SOCKET_DIR",
    default=None,
    help="Directory of scheduler.sock [env NVSHARE_SOCKET_DIR; default /var/run/nvshare].",
)

control_dir_option: Callable[[F], F] = click.option(
    "--control-dir",
    type=click.Path(),
    callback=_directory_named,
    envvar="NVSHARE_CONTROL_DIR",
    default=None,
    help="Directory of control.sock, nvsharectl's socket [env NVSHARE_CONTROL_DIR; default the "
    "socket directory's sibling <name>-control, /var/run/nvshare-control].",
)
