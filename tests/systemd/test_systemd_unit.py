"""The shipped systemd unit: systemd accepts it, and it says what the daemon relies on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "nvshare-scheduler.service"
EXEC = "/opt/nvshare/venv/bin/nvshare-scheduler"


def directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # The daemon is not installed here: point ExecStart at an executable that exists.
    stub = tmp_path / "nvshare-scheduler"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(EXEC, str(stub)))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert UNIT.name not in result.stderr, result.stderr


def test_unit_is_a_notify_service_with_watchdog_reload_and_socket_dir() -> None:
    d = directives()
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] == ["30"]
    assert d["ExecStart"] == [f"{EXEC} --policy-dir /etc/nvshare/policy.d"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["RuntimeDirectory"] == ["nvshare nvshare-control"]  # hooks', nvsharectl's
    assert d["RuntimeDirectoryMode"] == ["0755"]
    assert d["LimitNOFILE"] == ["65536"]  # a file per connection; the default 1024 is few
    assert d["ConfigurationDirectory"] == ["nvshare"]
    assert d["Restart"] == ["on-failure"]


def test_hardening_still_lets_the_daemon_see_clients_and_gpus() -> None:
    d = directives()
    assert d["ProtectSystem"] == ["strict"]
    assert d["NoNewPrivileges"] == ["yes"]
    assert d["PrivateTmp"] == ["yes"]
    assert set(d["RestrictAddressFamilies"][0].split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }
    # /proc of other processes (identity) and /dev/nvidia* (NVML) must stay reachable.
    for forbidden in ("PrivateDevices", "ProcSubset", "DevicePolicy", "DynamicUser", "User"):
        assert forbidden not in d, forbidden
    assert d.get("ProtectProc", ["default"]) == ["default"]
