"""The daemon runs at the nice value `--nice` gives (-10 unless told), every thread of it, so that
on a node whose CPUs are all busy a grant does not wait behind them; without the privilege to
set it, it says so and runs at the one it has; a value out of range is refused at the start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import BIN, start_daemon

CAP_SYS_NICE = 23


def _may_lower_nice() -> bool:
    with open("/proc/self/status") as status:
        caps = next(line for line in status if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> CAP_SYS_NICE & 1)


def _nice_of_every_thread(pid: int) -> set[int]:
    nices = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        nices.add(int(fields[16]))  # field 19 of stat(5); fields[0] is its third, the state
    return nices


@pytest.mark.skipif(
    not _may_lower_nice(), reason="setting a nice value below 0 takes CAP_SYS_NICE, not held here"
)
def test_every_thread_of_the_daemon_runs_at_the_nice_value_it_is_given(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "scheduler: {mode: 'on'}\n", args=["--nice", "-7"])
    try:
        threads = len(list(Path(f"/proc/{d.proc.pid}/task").iterdir()))
        assert threads > 1  # (the policy watcher at least: started after the nice value)
        assert _nice_of_every_thread(d.proc.pid) == {-7}
        assert "CPU priority: nice -7 (was " in d.output()
    finally:
        d.stop()


UNPRIVILEGED = """
import logging, os, resource, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
if os.geteuid() == 0:
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)  # (drops every capability)
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # (nor may the limit allow it)
from appliance.daemon.cpu import set_nice
had = os.getpriority(os.PRIO_PROCESS, 0)
print("had", had, "runs at", set_nice(had - 10), os.getpriority(os.PRIO_PROCESS, 0))
"""


def test_without_the_privilege_it_says_so_and_runs_at_the_nice_value_it_has() -> None:
    out = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED], capture_output=True, text=True, check=True
    ).stdout
    had = int(out.splitlines()[-1].split()[1])
    assert f"cannot set the daemon's CPU priority to nice {had - 10}" in out
    assert f"it runs at nice {had}" in out and f"--nice {had} keeps it" in out
    assert out.splitlines()[-1] == f"had {had} runs at {had} {had}"


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--nice", "-21"], {}, "-21 is not in the range -20<=x<=19"),
        (["--nice", "20"], {}, "20 is not in the range -20<=x<=19"),
        ([], {"NVSHARE_NICE": "high"}, "'high' is not a valid integer"),
    ],
)
def test_a_nice_value_out_of_range_is_refused_before_anything_starts(
    tmp_path: Path, args: list[str], env: dict[str, str], said: str
) -> None:
    run = subprocess.run(
        [str(BIN / "nvshare-scheduler"), "--policy-dir", str(tmp_path), *args],
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path / "run"), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert "--nice" in run.stderr and said in run.stderr
    assert not (tmp_path / "run").exists()
