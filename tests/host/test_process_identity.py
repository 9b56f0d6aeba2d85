"""Who a process NVML lists is: its owner and pod from /proc, read once per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from appliance.host.process import ProcessIdentities, identify_process, start_time

POD = "8d3f1c2a-5b6e-4f7a-9c0d-1e2f3a4b5c6d"
CGROUP = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
    f"{POD.replace('-', '_')}.slice/cri-containerd-{'a' * 64}.scope\n"
)


def fake_process(proc: Path, pid: int, *, uid: int, started: int, cgroup: str = CGROUP) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "status").write_text(
        f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t7\t7\t7\t7\n"
    )
    # The command name may hold spaces and parentheses; the fields after it are what count.
    rest = " ".join(["S"] + ["0"] * 18 + [str(started)] + ["0"] * 30)
    (d / "stat").write_text(f"{pid} (my (odd) name) {rest}\n")
    (d / "cgroup").write_text(cgroup)
    (d / "comm").write_text("my (odd) name\n")


def test_a_pod_process_is_known_by_its_pod_container_and_owner(tmp_path: Path) -> None:
    fake_process(tmp_path, 4242, uid=1001, started=555)
    ident = identify_process(4242, proc_root=tmp_path)
    assert ident is not None
    assert (ident.pid, ident.uid, ident.gid) == (4242, 1001, 7)
    assert (ident.pod_uid, ident.container_id) == (POD, "a" * 64)
    assert ident.command == "my (odd) name"  # /proc/<pid>/comm: what status shows
    assert start_time(4242, proc_root=tmp_path) == 555


def test_a_process_that_is_gone_has_no_identity(tmp_path: Path) -> None:
    assert identify_process(99, proc_root=tmp_path) is None
    assert ProcessIdentities(proc_root=tmp_path)([99]) == {}


def test_identities_are_read_once_per_process_and_again_for_a_reused_pid(tmp_path: Path) -> None:
    identities = ProcessIdentities(proc_root=tmp_path)
    fake_process(tmp_path, 10, uid=1001, started=100)
    assert identities([10])[10].pod_uid == POD
    fake_process(tmp_path, 10, uid=1001, started=100, cgroup="0::/user.slice/x.scope\n")
    assert identities([10])[10].pod_uid == POD  # the same process: not read again
    fake_process(tmp_path, 10, uid=2002, started=900, cgroup="0::/user.slice/x.scope\n")
    reused = identities([10])[10]  # another process got the pid
    assert (reused.uid, reused.pod_uid, reused.systemd_unit) == (2002, None, "x.scope")


def test_this_test_process_on_the_real_proc() -> None:
    ident = identify_process(os.getpid())
    assert ident is not None and ident.uid == os.getuid()
    assert ident.executable == os.path.realpath(sys.executable)
    assert ident.command == Path("/proc/self/comm").read_text().strip()
