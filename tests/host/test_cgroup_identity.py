"""Kernel identity: the pod, container or systemd unit that /proc/<pid>/cgroup names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.host.cgroup import CgroupIdentity, cgroup_identity, parse_cgroup

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
    # a local user copying the kubelet's names inside the subtree systemd delegates to it
    ("attack-user-delegated-pod-slice", 4100, None, None, "user@1001.service"),
    ("attack-user-delegated-kubepods-tree", 4101, None, None, f"cri-containerd-{CTR2}.scope"),
    ("attack-user-delegated-cgroupfs", 4102, None, None, "user@1001.service"),
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


SLICE3 = POD3.replace("-", "_")

NOT_PODS = [
    # systemd names out of order, or under a unit that is not the kubelet's
    f"/kubepods-pod{SLICE3}.slice/docker-{CTR3}.scope",
    f"/kubepods.slice/kubepods-besteffort-pod{SLICE3}.slice/docker-{CTR3}.scope",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{SLICE3}.slice",
    f"/system.slice/kubepods.slice/kubepods-pod{SLICE3}.slice/docker-{CTR3}.scope",
    f"/user.slice/user-kubepods.slice/user-kubepods-pod{SLICE3}.slice",
    f"/kubepods.slice/x.service/kubepods-pod{SLICE3}.slice",
    f"/system.slice/foo-pod{SLICE3}.slice",
    # cgroupfs names under a unit, or a pod directory not under kubepods
    f"/system.slice/kubepods/pod{POD3}/{CTR3}",
    f"/kubepods/guaranteed/pod{POD3}/{CTR3}",
    f"/mine/pod{POD3}/{CTR3}",
    # a cgroup namespace's view must not climb back down
    f"/../../user.slice/user-1001.slice/user@1001.service/kubepods-pod{SLICE3}.slice",
    f"/../kubepods.slice/../kubepods-pod{SLICE3}.slice",
]
PODS = [
    f"/kubepods.slice/kubepods-pod{SLICE3}.slice/docker-{CTR3}.scope",
    f"/kubepods/pod{POD3}/{CTR3}",
    f"/kubelet/kubepods/besteffort/pod{POD3}/{CTR3}",  # --cgroup-root=/kubelet, cgroupfs
    # the daemon in its own cgroup namespace sees other pods from one of its ancestors
    f"/../../kubepods-besteffort-pod{SLICE3}.slice/crio-{CTR3}.scope",
    f"/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{SLICE3}.slice/crio-{CTR3}.scope",
    f"/../../pod{POD3}/{CTR3}",
]


@pytest.mark.parametrize("path", NOT_PODS)
def test_a_pod_name_outside_the_kubelets_layout_names_no_pod(path: str) -> None:
    assert parse_cgroup(f"0::{path}\n").pod_uid is None


@pytest.mark.parametrize("path", PODS)
def test_the_kubelets_layouts_name_the_pod(path: str) -> None:
    ident = parse_cgroup(f"0::{path}\n")
    assert (ident.pod_uid, ident.container_id) == (POD3, CTR3)
