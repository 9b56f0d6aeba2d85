"""What the two programs share: one-line errors instead of tracebacks, names, defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

DEFAULT_POLICY_DIR = Path("/etc/nvshare/policy.d")
PACKAGE = "nvshare-appliance"


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
