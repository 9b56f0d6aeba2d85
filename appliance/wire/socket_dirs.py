"""Where the daemon's two sockets are, found by the daemon, nvsharectl and the hook alike.

- The hooks' directory (`NVSHARE_SOCKET_DIR`, default `/var/run/nvshare`): `scheduler.sock` and
  the limits published for hooks that cannot register. Pods get it mounted (the directory,
  never the socket file, so a daemon restart is survived).
- The control directory (`NVSHARE_CONTROL_DIR`, default the hooks' directory's sibling
  `/var/run/nvshare-control`): nvsharectl's `control.sock`, never mounted into pods, so a pod
  cannot even ask for a state change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "scheduler.sock"
CONTROL_SOCKET_NAME = "control.sock"
DEFAULT_SOCKET_DIR = Path("/var/run/nvshare")


def socket_dir_from_env(environ: Mapping[str, str] | None = None) -> Path:
    """`NVSHARE_SOCKET_DIR`, else the default: the same rule as the hook's."""
    env = os.environ if environ is None else environ
    return Path(env.get("NVSHARE_SOCKET_DIR") or DEFAULT_SOCKET_DIR)


def control_dir_for(socket_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """`NVSHARE_CONTROL_DIR`, else the socket directory's sibling `<name>-control`: beside,
    never inside, what pods mount."""
    given = (os.environ if environ is None else environ).get("NVSHARE_CONTROL_DIR")
    return Path(given) if given else socket_dir.with_name(socket_dir.name + "-control")
