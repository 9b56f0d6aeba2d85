"""A daemon a user without root starts for themselves, as the README's set-up tells them to.

The README once said `NVSHARE_SOCKET_DIR=$XDG_RUNTIME_DIR/nvshare`: under su, sudo, cron and in
containers that variable is empty and the path became `/nvshare`, refused. And the daemon the
user did start answered its owner's `nvsharectl -T 45` with "only root may set the time
quantum". Both are run here as the README writes them, as user 65534 with no XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import ROOT

USER = 65534
OTHER = 65533
# The venv's interpreter may sit under root's home, out of other users' reach: they run the
# system's python3 of the same version on the venv's packages and this checkout.
OTHER_PYTHON = "/usr/bin/python3"
SITE = sysconfig.get_paths()["purelib"]


def _other_python_fits() -> bool:
    try:
        version = subprocess.run(
            [OTHER_PYTHON, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30,
        ).stdout.split()  # fmt: skip
    except OSError:
        return False
    return version == [str(n) for n in sys.version_info[:2]]


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not _other_python_fits(),
    reason="acting as other users needs root and a system-wide python3 of the venv's version",
)


def program(name: str) -> list[str]:
    module, function = {
        "nvshare-scheduler": ("appliance.cli.nvshare_scheduler", "scheduler_main"),
        "nvsharectl": ("appliance.cli.nvsharectl", "nvsharectl"),
    }[name]
    return [OTHER_PYTHON, "-c", f"from {module} import {function}; {function}(prog_name={name!r})"]


def readme_socket_dir() -> str:
    """The value the README's non-root set-up gives NVSHARE_SOCKET_DIR for `make run`."""
    readme = (ROOT / "README.md").read_text()
    [value] = re.findall(r"`NVSHARE_SOCKET_DIR=(\S+) make run`", readme)
    return value


def as_user(uid: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, user=uid, group=uid, extra_groups=[], capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip


def test_the_readmes_non_root_daemon_starts_and_obeys_its_user() -> None:
    home = Path(tempfile.mkdtemp(prefix="nvs-home-"))  # pytest's tmp_path is root's alone
    home.chmod(0o755)
    os.chown(home, USER, USER)
    # As su, sudo or cron leave it: no XDG_RUNTIME_DIR.
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{SITE}"}
    expanded = as_user(USER, ["bash", "-c", f'printf %s "{readme_socket_dir()}"'], env).stdout
    socket_dir = Path(expanded)
    assert socket_dir.parent == home, expanded
    policy = home / "policy"
    policy.mkdir()
    (policy / "p.yaml").write_text("metrics: {enabled: false}\n")
    env["NVSHARE_SOCKET_DIR"] = str(socket_dir)
    log = home / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(
            [*program("nvshare-scheduler"), "--policy-dir", str(policy)],
            env=env, user=USER, group=USER, extra_groups=[], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        control = Path(f"{socket_dir}-control") / "control.sock"
        deadline = time.monotonic() + 30
        while not control.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        ctl = [*program("nvsharectl"), "-T", "45"]
        owner = as_user(USER, ctl, env)
        assert owner.returncode == 0, owner.stderr
        assert "45" in owner.stdout
        stranger = as_user(OTHER, [*ctl[:-1], "46"], env)
        assert stranger.returncode == 1
        assert "only root or the daemon's own user (uid 65534) may set" in stranger.stderr
        status = as_user(USER, [*program("nvsharectl"), "status", "--json"], env)
        assert '"default_time_quantum_s": 45' in status.stdout
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(home, ignore_errors=True)
