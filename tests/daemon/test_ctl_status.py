"""`nvsharectl status` and the mode commands as a newcomer meets them: a real daemon on real
sockets, clients registered as hooks do, and the real CLI.

What status shows must be what the scheduler runs with: the mode nvsharectl set, said to be
nvsharectl's; an override a policy reload kept, or the one it dropped and why; each process by
PID and name in 80 columns.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.cli import status_view
from appliance.cli.client import ControlClient
from appliance.core.gpus import GpuUse
from appliance.core.views import StatusView, UnhookedView
from appliance.policy.model import Mode
from appliance.wire import protocol as p

from .conftest import RunningDaemon, start_daemon, track
from .test_mistakes import ctl

GPU = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
POLICY = "scheduler: {mode: 'on', timeQuantum: 30s, idleRelease: 1s}\n"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RunningDaemon]:
    d = start_daemon(tmp_path, POLICY, extra_env={"COLUMNS": "80"})
    yield d
    d.stop()


def status(d: RunningDaemon, *args: str) -> str:
    r = ctl(d, "status", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def hook(d: RunningDaemon) -> ControlClient:
    """A connection that registers on GPU as a hook does: the kernel says it is this pid."""
    c = ControlClient.as_hook(d.socket_dir, timeout=5)
    track(c._sock)
    reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 << 30))
    assert isinstance(reply, p.Registered)
    return c


def policy_hash(d: RunningDaemon) -> str:
    return str(json.loads(status(d, "--json"))["policy"]["hash"])


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_status_says_the_mode_nvsharectl_set_and_the_policys(node: RunningDaemon) -> None:
    assert "default: mode on (policy)  TQ 30 s (policy)" in status(node).splitlines()
    assert (
        ctl(node, "-S", "off").stdout == "mode set to off for every GPU (was on from the policy)\n"
    )
    assert ctl(node, "-T", "45").returncode == 0
    assert "default: mode off (nvsharectl; policy on)  TQ 45 s (nvsharectl; policy 30 s)" in (
        status(node).splitlines()
    )
    # like -T, -S says what it replaced
    assert (
        ctl(node, "-S", "on").stdout == "mode set to on for every GPU (was off from nvsharectl)\n"
    )


def test_a_policy_edit_that_leaves_the_mode_keeps_the_operators(node: RunningDaemon) -> None:
    hook(node)
    assert ctl(node, "-S", "off").returncode == 0
    policy = node.policy_dir / "policy.yaml"
    loaded = policy_hash(node)
    policy.write_text(POLICY.replace("idleRelease: 1s", "idleRelease: 3s"))
    eventually(lambda: policy_hash(node) != loaded, "the idleRelease edit loaded")
    shown = status(node)
    assert "default: mode off (nvsharectl; policy on)" in shown
    assert "dropped" not in shown and "mode off (nvsharectl)" in shown

    # an edit of the policy's own mode is the newer word: the override goes, and status says so
    policy.write_text(POLICY.replace("mode: 'on'", "mode: 'auto'"))
    eventually(lambda: "default: mode auto (policy)" in status(node), "the mode edit loaded")
    dropped = " ".join(status(node).split())
    assert re.search(
        r"nvsharectl's mode off on every GPU was dropped \d+ s ago: a policy reload changed the "
        r"policy's mode \(scheduler\.mode on -> auto\)",
        dropped,
    ), dropped
    assert "replaces what nvsharectl set: mode off on every GPU" in node.output()
    top = " ".join(ctl(node, "top", "--once").stdout.split())  # top says it as status does
    assert re.search(r"nvsharectl's mode off on every GPU was dropped \d+ s ago", top), top


def test_status_fits_80_columns_with_pid_and_process_name(node: RunningDaemon) -> None:
    holder, waiter = hook(node), hook(node)
    holder.send(p.LockRequest())
    eventually(lambda: "holding" in status(node), "the lock granted")
    waiter.send(p.LockRequest())
    eventually(lambda: "waiting" in status(node), "the second in the queue")
    me, name = os.getpid(), Path("/proc/self/comm").read_text().strip()
    lines = status(node).splitlines()
    assert lines[0].startswith("policy: ")  # the directory's path is as long as it is
    assert max(map(len, lines[1:])) <= 80, lines
    assert "GPU - aaaaaaaa  mode on (policy)  TQ 30 s (policy)  memory -" in lines
    assert f"  holding: {me}  waiting: {me}" in lines
    assert lines[lines.index("") + 1].split() == [
        "GPU", "UUID", "PID", "PROCESS", "STATE", "USED", "LIMIT", "CORE", "POD"
    ]  # fmt: skip
    rows = [line.split() for line in lines if line.startswith("  - aaaaaaaa")]
    assert sorted(r[4] for r in rows) == ["holding", "waiting"]
    assert all(r[2:4] == [str(me), name[:15]] for r in rows)

    # --wide: the whole UUID, client ids, and what 80 columns leave out
    wide = status(node, "--wide")
    assert GPU in wide and re.search(r"lock holders: \d+ \(pid \d+\)  queue: \d+ \(pid \d+\)", wide)
    assert re.search(
        rf"^\s+\d+\s+{me}\s+{re.escape(name)}\s+-\s+holding\s.* normal {GPU}$", wide, re.M
    )


def test_a_gpu_is_named_by_a_unique_start_of_its_uuid(node: RunningDaemon) -> None:
    hook(node)
    r = ctl(node, "mode", "auto", "--gpu", "aaaa")
    assert (
        r.returncode == 0 and r.stdout == f"mode set to auto for {GPU} (was on from the policy)\n"
    )
    # no NVML here: no GPU has an index to go by
    r = ctl(node, "mode", "on", "--gpu", "0")
    assert r.returncode == 1
    assert f"no GPU 0 is known here; nothing changed (known: {GPU})" in r.stderr


def test_a_process_without_the_hook_on_a_gpu_no_hook_uses_still_has_its_row() -> None:
    """NVML lists GPU 1 and a process on it that never registered; no hook has used GPU 1."""
    other = "GPU-12345678-0000-0000-0000-000000000000"
    view = StatusView(
        gpus=(),
        clients=(),
        counters={},
        default_mode=Mode.ON,
        default_time_quantum_s=30,
        use=(GpuUse(other, 1, 5 << 30, 90, 0.0),),
        unhooked=(
            UnhookedView(
                pid=4242,
                uid=0,
                pod="a-namespace/a-pod-with-a-name-too-long-for-80-columns-7f9c8d",
                executable="/usr/bin/python3.11",
                gpus=(other,),
                memory_used=2 << 30,
                seen_for_s=12.0,
                command="python3",
                gpu_memory={other: 2 << 30},
            ),
        ),
    )
    shown = status_view.lines(view)
    assert max(map(len, shown)) <= 80, shown
    row = next(line for line in shown if "4242" in line)
    assert row.split()[:6] == ["1", "12345678", "4242", "python3", "unhooked", "2.0Gi"]
    assert ".." in row.split()[-1] and row.split()[-1].endswith("7f9c8d")  # its ends kept
