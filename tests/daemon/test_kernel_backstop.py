"""The kernel-enforced backstop against a pynvml stand-in that implements MPS v3 memory
partitioning as NVIDIA documents it (nvmlDeviceSetMemoryLimits_v1 / GetMemoryLimits_v1 on a
cgroup directory; soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX clear it; root only; no MIG),
on real cgroup and /proc trees in tmp_path: the calls the daemon makes when a pod starts, when
its limit changes, when it ends, for a workstation cgroup, and every way it is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from appliance.cli.client import ControlClient
from appliance.core.views import ExplainQuery, StatusView
from appliance.daemon.daemon import Daemon
from appliance.gpu.backstop import (
    ADOPT_GRACE_S,
    Holder,
    KernelBackstop,
    clear_recorded,
    read_record,
)
from appliance.gpu.nvml import MEMORY_LIMIT_MAX, Nvml
from appliance.policy.model import Mode
from appliance.serve.socket_claim import claim_sockets
from appliance.web.metrics import ApplianceCollector
from appliance.wire import protocol as p

from .inprocess import daemon_config, eventually, run_with

MiB = 1 << 20
GiB = 1 << 30
ALLOWANCE = 768 * MiB
GPU = "GPU-aaaa"
POD_UID = "1b2c3d4e-0000-4000-8000-00000000abcd"


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class PartitioningNvml:
    """pynvml with memory partitioning: limits per (GPU, cgroup directory), as set."""

    NVMLError = NVMLError
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, *, driver_has_it: bool = True, root: bool = True, mig: bool = False):
        self.driver_has_it, self.root, self.mig = driver_has_it, root, mig
        self.limits: dict[tuple[int, str], tuple[int, int]] = {}
        self.calls: list[tuple[str, str, int | None]] = []  # (cgroup, GPU, hard or None)

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # noqa: N802
        if uuid != GPU:
            raise NVMLError(6)
        return 0

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return GPU

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return "NVIDIA H100"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=80 * GiB, used=0, free=80 * GiB)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:  # noqa: N802
        return [1 if self.mig else 0, 0]

    def nvmlEventSetCreate(self) -> str:  # noqa: N802
        raise NVMLError(3)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return []

    # the two calls, with the structures pynvml defines
    c_nvmlSetMemoryLimits_v1_t = SimpleNamespace  # noqa: N815 (pynvml's names)
    c_nvmlGetMemoryLimits_v1_t = SimpleNamespace  # noqa: N815

    def nvmlDeviceSetMemoryLimits_v1(self, handle: int, limits: Any) -> None:  # noqa: N802
        if not self.driver_has_it:
            raise NVMLError(13)  # FUNCTION_NOT_FOUND: a driver before r615
        if not self.root:
            raise NVMLError(4)  # NO_PERMISSION: setting limits is privileged
        if self.mig:
            raise NVMLError(3)  # NOT_SUPPORTED
        cgroup = limits.nameSpace.decode()
        if not Path(cgroup).is_dir():
            raise NVMLError(2)  # INVALID_ARGUMENT: no such cgroup
        clear = limits.softLimit == 0 and limits.hardLimit == MEMORY_LIMIT_MAX
        self.calls.append((cgroup, GPU, None if clear else limits.hardLimit))
        if clear:
            self.limits.pop((handle, cgroup), None)
        else:
            self.limits[(handle, cgroup)] = (limits.softLimit, limits.hardLimit)

    def nvmlDeviceGetMemoryLimits_v1(self, handle: int, limits: Any) -> None:  # noqa: N802
        if not self.driver_has_it:
            raise NVMLError(13)
        soft, hard = self.limits.get((handle, limits.nameSpace.decode()), (0, MEMORY_LIMIT_MAX))
        limits.softLimit, limits.hardLimit, limits.currentUsed = soft, hard, 0


@pytest.fixture
def cgroups(tmp_path: Path) -> Path:
    """A cgroup v2 root with a burstable pod, as kubelet's systemd driver names it."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids dmem\n")
    qos = root / "kubepods.slice" / "kubepods-burstable.slice"
    (qos / f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice").mkdir(parents=True)
    return root


def pod_dir(root: Path) -> str:
    name = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
    return str(root / "kubepods.slice" / "kubepods-burstable.slice" / name)


def proc_tree(tmp_path: Path, cgroups: Path, pids: dict[int, str]) -> Path:
    proc = tmp_path / "proc"
    for pid, path in pids.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{path}\n")
        (cgroups / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return proc


def backstop(library: PartitioningNvml, cgroups: Path, proc: Path | None = None) -> KernelBackstop:
    return KernelBackstop(
        Nvml(library=library), cgroup_root=cgroups, proc_root=proc or cgroups / "no-proc"
    )


def pod_client(pid: int, limit: int | None) -> Holder:
    return Holder(gpu=GPU, pid=pid, pod_uid=POD_UID, memory_limit=limit)


def test_a_pods_hard_limit_follows_its_limit_from_start_to_end(cgroups: Path) -> None:
    nvml = PartitioningNvml()
    b = backstop(nvml, cgroups)
    pod = pod_dir(cgroups)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, 4 * GiB)])
    assert nvml.calls == [(pod, GPU, 4 * GiB + ALLOWANCE)]  # the pod started
    assert Nvml(library=nvml).memory_limit(GPU, pod) == (4 * GiB + ALLOWANCE, 0)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, 4 * GiB)])
    assert len(nvml.calls) == 1  # unchanged: not set again
    both = [pod_client(10, 4 * GiB), pod_client(11, 4 * GiB)]
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=both)  # a second process
    assert nvml.calls[-1] == (pod, GPU, 4 * GiB + 2 * ALLOWANCE)
    lowered = [pod_client(10, 2 * GiB), pod_client(11, 2 * GiB)]  # the annotation changed
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=lowered)
    assert nvml.calls[-1] == (pod, GPU, 2 * GiB + 2 * ALLOWANCE)
    assert (
        b.explain(GPU, 11)
        == f"{(2 * GiB + 2 * ALLOWANCE) >> 20} MiB hard limit on {pod} (kernel-enforced)"
    )
    (view,) = b.views()
    assert view.active and view.code == "active" and view.limits == {pod: 2 * GiB + 2 * ALLOWANCE}
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[])  # the pod ended
    assert nvml.calls[-1] == (pod, GPU, None)
    assert nvml.limits == {}
    assert Nvml(library=nvml).memory_limit(GPU, pod) == (None, 0)


def test_a_client_without_a_memory_limit_gets_no_backstop(cgroups: Path) -> None:
    nvml = PartitioningNvml()
    b = backstop(nvml, cgroups)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, None)])
    assert nvml.calls == []
    assert b.explain(GPU, 10) == f"none on {pod_dir(cgroups)} (no memory limit applies)"


def test_a_workstation_cgroup_gets_the_sum_of_its_processes_limits(
    tmp_path: Path, cgroups: Path
) -> None:
    scope = "/user.slice/user-1000.slice/run-u7.scope"
    proc = proc_tree(tmp_path, cgroups, {20: scope, 21: scope, 30: "/"})
    nvml = PartitioningNvml()
    b = backstop(nvml, cgroups, proc)
    clients = [
        Holder(gpu=GPU, pid=20, pod_uid="", memory_limit=GiB),
        Holder(gpu=GPU, pid=21, pod_uid="", memory_limit=2 * GiB),
        Holder(gpu=GPU, pid=30, pod_uid="", memory_limit=GiB),  # in the root cgroup
    ]
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=clients)
    assert nvml.calls == [(str(cgroups / scope.lstrip("/")), GPU, 3 * GiB + 2 * ALLOWANCE)]
    assert b.explain(GPU, 30) == "none: its cgroup is not known (or is the root cgroup)"


@pytest.mark.parametrize(
    ("library", "code", "says"),
    [
        (PartitioningNvml(driver_has_it=False), "driver", "driver r615 / CUDA 13.4"),
        (PartitioningNvml(root=False), "permission", "must run as root"),
        (PartitioningNvml(mig=True), "mig", "MIG is enabled"),
    ],
)
def test_a_refused_backstop_says_why_and_sets_nothing(
    cgroups: Path, library: PartitioningNvml, code: str, says: str
) -> None:
    b = backstop(library, cgroups)
    for _ in range(2):  # a refusal for the whole GPU is not retried every round
        b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    (view,) = b.views()
    assert (view.active, view.code, view.limits) == (False, code, {})
    assert says in view.reason
    assert says in b.explain(GPU, 10)
    assert library.limits == {}


def test_without_cgroup_v2_nothing_is_tried(tmp_path: Path) -> None:
    v1 = tmp_path / "cgroup"
    (v1 / "memory").mkdir(parents=True)  # a v1 hierarchy: no cgroup.controllers at the root
    nvml = PartitioningNvml()
    b = backstop(nvml, v1)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    (view,) = b.views()
    assert (view.active, view.code) == (False, "cgroup")
    assert f"no cgroup v2 at {v1}" in view.reason
    assert nvml.calls == []


def test_turning_the_policy_off_clears_what_was_set(cgroups: Path) -> None:
    nvml = PartitioningNvml()
    b = backstop(nvml, cgroups)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    b.reconcile(enabled=False, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    assert nvml.calls[-1] == (pod_dir(cgroups), GPU, None) and nvml.limits == {}
    (view,) = b.views()
    assert (view.active, view.code) == (False, "off")
    assert b.explain(GPU, 10).startswith("none: off in policy")


def test_a_restarted_daemon_takes_its_limits_over_and_clears_those_no_client_wants(
    tmp_path: Path, cgroups: Path
) -> None:
    """Limits stay set while the daemon restarts; a workstation cgroup whose processes ended
    meanwhile used to keep its limit for good, since the next daemon did not know of it."""
    scope = "/user.slice/user-1000.slice/run-u7.scope"
    proc = proc_tree(tmp_path, cgroups, {20: scope})
    workstation, pod = str(cgroups / scope.lstrip("/")), pod_dir(cgroups)
    record, now, nvml = tmp_path / "backstop.json", [0.0], PartitioningNvml()

    def daemon() -> KernelBackstop:
        return KernelBackstop(
            Nvml(library=nvml), cgroup_root=cgroups, proc_root=proc, record=record,
            clock=lambda: now[0],
        )  # fmt: skip

    ws_client = Holder(gpu=GPU, pid=20, pod_uid="", memory_limit=GiB)
    daemon().reconcile(enabled=True, allowance=ALLOWANCE, clients=[ws_client, pod_client(10, GiB)])
    assert set(nvml.limits) == {(0, workstation), (0, pod)}
    now[0] = 100.0  # stopped; the next daemon starts, and no client has reconnected yet
    second = daemon()
    second.reconcile(enabled=True, allowance=ALLOWANCE, clients=[])
    assert set(nvml.limits) == {(0, workstation), (0, pod)}  # still protecting
    second.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    now[0] += ADOPT_GRACE_S  # the workstation's process never came back
    second.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    assert nvml.calls[-1] == (workstation, GPU, None)
    assert set(nvml.limits) == {(0, pod)}
    assert read_record(record) == {(GPU, pod): GiB + ALLOWANCE}


def test_clear_backstop_after_a_stop_for_good_clears_what_the_record_names(
    tmp_path: Path, cgroups: Path
) -> None:
    record, nvml = tmp_path / "backstop.json", PartitioningNvml()
    b = KernelBackstop(Nvml(library=nvml), cgroup_root=cgroups, record=record)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    assert nvml.limits and record.is_file()
    said = clear_recorded(
        Nvml(library=nvml), record
    )  # what `nvshare-scheduler clear-backstop` does
    assert said == [f"{pod_dir(cgroups)} on GPU {GPU}: {(GiB + ALLOWANCE) >> 20} MiB limit cleared"]
    assert nvml.limits == {} and not record.exists()


def test_clear_backstop_refuses_while_a_daemon_serves(tmp_path: Path) -> None:
    claim = claim_sockets(tmp_path / "s", tmp_path / "s")  # as a running daemon holds them
    try:
        r = subprocess.run(
            [sys.executable, "-m", "appliance", "--socket-dir", str(tmp_path / "s"),
             "clear-backstop"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        claim.hook.sock.close()
        claim.control.sock.close()
        claim.release()
    assert r.returncode == 1
    assert "would set the limits again; stop it first" in r.stderr, r.stderr


def test_status_metrics_show_per_gpu_whether_it_is_active_and_why_not(cgroups: Path) -> None:
    b = backstop(PartitioningNvml(driver_has_it=False), cgroups)
    b.reconcile(enabled=True, allowance=ALLOWANCE, clients=[pod_client(10, GiB)])
    status = StatusView(
        gpus=(),
        clients=(),
        counters={},
        default_mode=Mode.ON,
        default_time_quantum_s=30.0,
        backstop=b.views(),
    )
    registry = CollectorRegistry()
    registry.register(ApplianceCollector(lambda: status))
    text = generate_latest(registry).decode()
    assert f'nvshare_gpu_kernel_backstop_active{{gpu_uuid="{GPU}",reason="driver"}} 0.0' in text
    assert f'nvshare_gpu_kernel_backstop_cgroups{{gpu_uuid="{GPU}"}} 0.0' in text


def test_the_daemon_limits_a_registered_clients_cgroup_and_clears_it_when_it_goes(
    tmp_path: Path, cgroups: Path
) -> None:
    scope = "/system.slice/train.service"
    proc = proc_tree(tmp_path, cgroups, {os.getpid(): scope})  # the client is this process
    library = PartitioningNvml()
    config = daemon_config(
        tmp_path,
        "defaults: {memoryLimit: 1Gi}\nmemory: {kernelBackstop: 'on'}\nmetrics: {enabled: false}\n",
        proc_root=proc,
        cgroup_root=cgroups,
    )
    daemon = Daemon(config, nvml=Nvml(library=library))
    cgroup = str(cgroups / scope.lstrip("/"))

    def body(d: Daemon) -> None:
        eventually(lambda: d._ready, "the daemon serving")
        wiring = d.serving.result(timeout=5)
        engine, answers = wiring.engine, wiring.answers
        hook = ControlClient.as_hook(config.socket_dir, timeout=5)
        hook.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 * GiB))
        eventually(lambda: library.limits, "the client's cgroup limited")
        assert library.calls == [(cgroup, GPU, GiB + ALLOWANCE)]
        status = engine.read(answers.status)
        assert [(b.gpu, b.active, dict(b.limits)) for b in status.backstop] == [
            (GPU, True, {cgroup: GiB + ALLOWANCE})
        ]
        (row,) = engine.read(lambda: answers.explain(ExplainQuery(pid=os.getpid()))).clients
        assert (
            row.backstop
            == f"{(GiB + ALLOWANCE) >> 20} MiB hard limit on {cgroup} (kernel-enforced)"
        )
        hook.close()  # the client goes: its cgroup's limit is cleared
        eventually(lambda: not library.limits, "the limit cleared")
        assert library.calls[-1] == (cgroup, GPU, None)

    assert run_with(daemon, body) == 0
