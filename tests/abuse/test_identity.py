"""Identity from the kernel only: a claimed pod name is not a pod, and after a DaemonSet restart
no pod borrows another's budget while the API server is slow to list them.

The pods live in the fake API server (tests/kube/fakeapi.py), read by the daemon as the
DaemonSet's service account under the rendered RBAC; their processes are placed in them through
the fake /proc, as the kernel would show them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kube import manifests
from kube.fakeapi import FakeApiServer

from appliance.wire import protocol as p

from .conftest import GiB, MiB, Stage, eventually, wait_listed

KEY = "nvshare.com/gpu-memory-limit"
OOM = "err 2"


@pytest.fixture
def cluster(stage: Stage) -> Iterator[tuple[FakeApiServer, dict[str, str]]]:
    api = FakeApiServer().start()
    api.add_node("node-1")
    pods = {
        name: api.add_pod(name, namespace="team", node="node-1", annotations={KEY: size})
        for name, size in (("big", "40Gi"), ("small", "1Gi"), ("other", "4Gi"))
    }
    api.load_rbac(list(manifests.rendered()))
    kubeconfig = api.write_kubeconfig(
        stage.base / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
    )
    stage.policy = "memory: {chunk: 2Mi}\ndefaults: {memoryLimit: 8Gi}\n"
    stage.args = ["--node-name", "node-1"]
    stage.env = {"KUBECONFIG": kubeconfig}
    try:
        yield api, {name: pod["metadata"]["uid"] for name, pod in pods.items()}
    finally:
        api.release_lists()
        stage.stop()
        api.stop()


def limit_of(stage: Stage, pid: int) -> int | None:
    for c in stage.status()["clients"]:
        if c["pid"] == pid:
            return c["memory_limit"]  # type: ignore[no-any-return]
    return None


def test_a_host_process_naming_a_pod_is_not_that_pod(
    stage: Stage, cluster: tuple[FakeApiServer, dict[str, str]], hooked: Any
) -> None:
    stage.start()
    claimer = hooked(
        NVSHARE_POD_NAMESPACE="team", NVSHARE_POD_NAME="big", NVSHARE_FAKE_GPU_MEM=str(64 * GiB)
    )
    claimer.ok("init")
    assert claimer.do(f"alloc mem {30 * GiB}") == OOM  # team/big has 40Gi; this process, 8Gi
    claimer.ok(f"alloc mem {512 * MiB}")
    assert limit_of(stage, claimer.proc.pid) == 8 * GiB
    assert "is not in the policy's trust.podClaimUids" in stage.output()


def test_naming_the_victims_pod_takes_nothing_from_it(
    stage: Stage, cluster: tuple[FakeApiServer, dict[str, str]], hooked: Any
) -> None:
    _, uids = cluster
    stage.start()
    victim = hooked(pod=uids["small"])
    victim.ok("init")
    wait_listed(stage, victim, GiB)  # (before the pod list arrives it has its uid's 8Gi)
    attacker = hooked(NVSHARE_POD_NAMESPACE="team", NVSHARE_POD_NAME="small")
    attacker.ok("init")
    attacker.ok(f"alloc mem {900 * MiB}")  # on its own ledger, not team/small's
    liar = stage.registered(pod_namespace="team", pod_name="small")
    answer = liar.request(p.MemReturn(0, 1 << 62))  # a usage no GPU has: it is closed, alone
    assert isinstance(answer, p.Result) and "beyond any GPU" in answer.message
    victim.ok(f"alloc mem {900 * MiB}")
    assert victim.do(f"alloc mem {200 * MiB}") == OOM  # its own 1Gi still holds it


def test_after_a_restart_no_pod_borrows_anothers_budget(
    stage: Stage, cluster: tuple[FakeApiServer, dict[str, str]], hooked: Any
) -> None:
    api, uids = cluster
    stage.start()
    small = hooked(pod=uids["small"], NVSHARE_DAEMON_TIMEOUT_MS="1000")
    other = hooked(pod=uids["other"], NVSHARE_DAEMON_TIMEOUT_MS="1000")
    for proc in (small, other):
        proc.ok("init")
        proc.ok("info")  # its first use of the GPU registers it
    eventually(lambda: limit_of(stage, small.proc.pid) == GiB, "small's annotation")
    eventually(lambda: limit_of(stage, other.proc.pid) == 4 * GiB, "other's annotation")
    stage.stop()
    api.hold_lists()  # the new daemon's pod watch gets no list until released
    stage.start()
    restarted = time.monotonic()
    eventually(lambda: limit_of(stage, small.proc.pid) == GiB, "small re-registered")
    eventually(lambda: limit_of(stage, other.proc.pid) == 4 * GiB, "other re-registered")
    # its own 1Gi: not the policy's 8Gi for unknown pods, nor its neighbour's 4Gi
    assert small.do(f"alloc mem {2 * GiB}") == OOM
    other.ok(f"alloc mem {3 * GiB}")
    listed = [c for c in stage.status()["clients"] if c["pid"] == small.proc.pid]
    assert "last published" in listed[0]["limits_from"]["memory"]
    assert time.monotonic() - restarted < 30  # all of it while the API server held its lists
    api.release_lists()
    eventually(
        lambda: (
            "annotation"
            in next(
                c["limits_from"]["memory"]
                for c in stage.status()["clients"]
                if c["pid"] == small.proc.pid
            )
        ),
        "the listed pod's annotation",
    )


def test_a_local_user_making_a_pod_slice_of_its_own_is_not_that_pod(
    stage: Stage, cluster: tuple[FakeApiServer, dict[str, str]], hooked: Any
) -> None:
    # Every logged-in user may create cgroups under its own user@UID.service; pod UIDs are
    # readable in others' /proc/<pid>/cgroup. Named like the kubelet's, in there, it is no pod.
    _, uids = cluster
    stage.policy += (
        f"rules:\n- name: per-user\n  match: {{uid: {os.getuid()}}}\n  memoryLimit: 1Gi\n"
    )
    stage.start()
    big = uids["big"].replace("-", "_")  # team/big: 40Gi
    attacker = hooked(NVSHARE_FAKE_GPU_MEM=str(64 * GiB))
    stage.proc.place(
        attacker.proc.pid,
        "0::/user.slice/user-1001.slice/user@1001.service/kubepods.slice/"
        f"kubepods-besteffort.slice/kubepods-besteffort-pod{big}.slice/"
        f"cri-containerd-{'cd' * 32}.scope\n",
    )
    attacker.ok("init")
    assert attacker.do(f"alloc mem {2 * GiB}") == OOM  # team/big's 40Gi is not its
    attacker.ok(f"alloc mem {512 * MiB}")
    assert limit_of(stage, attacker.proc.pid) == GiB  # its uid's rule
    victim = hooked(pod=uids["small"])  # a pod's own process, as the kubelet placed it
    victim.ok("init")
    thief = hooked()
    stage.proc.place(
        thief.proc.pid,
        "0::/user.slice/user-1001.slice/user@1001.service/"
        f"kubepods-pod{uids['small'].replace('-', '_')}.slice\n",
    )
    thief.ok("init")
    thief.ok(f"alloc mem {900 * MiB}")  # its own 1Gi, not team/small's ledger
    victim.ok(f"alloc mem {900 * MiB}")
    assert limit_of(stage, victim.proc.pid) == GiB


def test_a_pod_the_watch_has_not_shown_gets_no_more_than_its_uid(
    stage: Stage, cluster: tuple[FakeApiServer, dict[str, str]], hooked: Any
) -> None:
    # After a restart, before the API server lists the node's pods, a cgroup naming team/big
    # (40Gi, last published) is only a cgroup: its uid's 1Gi holds, not the pod's 40Gi; once
    # the watch shows the pod on this node, the process is the pod.
    api, uids = cluster
    stage.policy += (
        f"rules:\n- name: per-user\n  match: {{uid: {os.getuid()}}}\n  memoryLimit: 1Gi\n"
    )
    stage.start()
    first = hooked(pod=uids["big"], NVSHARE_DAEMON_TIMEOUT_MS="1000")
    first.ok("init")
    first.ok("info")
    eventually(lambda: limit_of(stage, first.proc.pid) == 40 * GiB, "big's annotation")
    stage.stop()
    api.hold_lists()  # the new daemon's pod watch gets no list until released
    stage.start()
    named = hooked(pod=uids["big"], NVSHARE_FAKE_GPU_MEM=str(64 * GiB))
    named.ok("init")
    assert named.do(f"alloc mem {2 * GiB}") == OOM  # before: 40Gi, the last published
    assert limit_of(stage, named.proc.pid) == GiB
    api.release_lists()
    eventually(lambda: limit_of(stage, named.proc.pid) == 40 * GiB, "listed: the pod's 40Gi")
    named.ok(f"alloc mem {2 * GiB}")
