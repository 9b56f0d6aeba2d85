"""Kernel identity: the pod, container or systemd unit that /proc/<pid>/cgroup names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.host.cgroup import CgroupIdentity, cgroup_identity

FIXTURES = Path(__file__).parent / "fixtures"

POD1 = "8d3f1c2a-5b6e-4f7a-9c0d-1e2f3a4b5c6d"
POD2 = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
POD3 = "f0e1d2c3-b4a5-4968-8776-655443322110"
CTR1 = "3f9a1b2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8"
CTR2 = "aa11bb22cc33dd44ee55ff6600778899aabbccddeeff00112233445566778899"
CTR3 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

CASES = [
    # (fixture tree, pid, pod uid, container id, systemd unit)
    ("v2-systemd-containerd-burstable", 4242, POD1, CTR1, None),
    ("v2-systemd-crio-besteffort", 77, POD2, CTR2, None),
    ("v2-systemd-docker-guaranteed", 901, POD3, CTR3, None),
    ("v1-cgroupfs-containerd", 1234, POD1, CTR1, None),
    ("v1-systemd-crio", 555, POD2, CTR2, None),
    ("kind-nested-kubelet-slice", 31, POD3, CTR3, None),
    ("baremetal-system-service", 2001, None, None, "train-llm.service"),
    ("baremetal-user-scope", 3003, None, None, "app-jupyter-1234.scope"),
    ("v1-hybrid-baremetal-service", 808, None, None, "inference.service"),
    ("container-cgroupns-root", 1, None, None, None),
]


@pytest.mark.parametrize(("tree", "pid", "pod_uid", "container_id", "unit"), CASES)
def test_identity_from_fake_proc_tree(
    tree: str, pid: int, pod_uid: str | None, container_id: str | None, unit: str | None
) -> None:
    proc = FIXTURES / tree / "proc"
    ident = cgroup_identity(pid, proc_root=proc)
    assert (ident.pod_uid, ident.container_id, ident.systemd_unit) == (pod_uid, container_id, unit)


def test_systemd_slice_uid_underscores_become_dashes() -> None:
    ident = cgroup_identity(4242, proc_root=FIXTURES / "v2-systemd-containerd-burstable" / "proc")
    assert "_" not in (ident.pod_uid or "_")
    assert ident.pod_uid == POD1


def test_vanished_process_is_a_process_lookup_error(tmp_path: Path) -> None:
    with pytest.raises(ProcessLookupError, match="no process 99"):
        cgroup_identity(99, proc_root=tmp_path)


def test_sanity_on_the_real_proc_for_this_test_process() -> None:
    ident = cgroup_identity(os.getpid())
    assert isinstance(ident, CgroupIdentity)
