"""PIDs as a container sees them: what its nvidia-smi lists must be numbers it can name."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.host.pidns import pids_seen_by

HOST_NS = "pid:[4026531836]"


def fake_process(proc: Path, pid: int, nspid: list[int], ns: str) -> None:
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "status").write_text("Name:\tpython\nNSpid:\t" + "\t".join(map(str, nspid)) + "\n")
    os.symlink(ns, d / "ns" / "pid")


def test_a_container_sees_its_own_processes_by_its_own_numbers(tmp_path: Path) -> None:
    fake_process(tmp_path, 5000, [5000, 1], "pid:[1]")  # the container's first process
    fake_process(tmp_path, 5007, [5007, 12], "pid:[1]")  # its neighbour
    fake_process(tmp_path, 6000, [6000, 12], "pid:[2]")  # another container's
    fake_process(tmp_path, 7000, [7000], HOST_NS)  # a host process
    seen = pids_seen_by(5007, [5000, 5007, 6000, 7000, 8000], proc_root=tmp_path)
    assert seen == {5000: 1, 5007: 12}


def test_the_host_sees_every_process_by_its_host_number(tmp_path: Path) -> None:
    fake_process(tmp_path, 7000, [7000], HOST_NS)
    fake_process(tmp_path, 5000, [5000, 1], "pid:[1]")
    assert pids_seen_by(7000, [5000, 7000], proc_root=tmp_path) == {5000: 5000, 7000: 7000}


def test_a_viewer_that_is_gone_sees_nothing(tmp_path: Path) -> None:
    fake_process(tmp_path, 5000, [5000, 1], "pid:[1]")
    assert pids_seen_by(4242, [5000], proc_root=tmp_path) == {}


def test_a_process_sees_itself_by_the_number_it_knows() -> None:
    me = os.getpid()
    assert pids_seen_by(me, [me], proc_root=Path("/proc")) == {me: me}
