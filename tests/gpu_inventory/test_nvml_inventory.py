"""NVML inventory, sampling and health against a scripted NVML module and the real pynvml."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.gpu.nvml import Nvml
from appliance.gpu.sampler import processes_seen

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class ScriptedNvml:
    """A stand-in for the pynvml module: GPUs are dicts, failures are scripted per call."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_DEVICE_MIG_ENABLE = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: list[dict[str, Any]], *, init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.fail: dict[tuple[str, int], int] = {}  # (function, gpu index) -> error code
        self.events: list[SimpleNamespace] = []
        self.shutdowns = 0

    def _check(self, function: str, index: int) -> None:
        if (function, index) in self.fail:
            raise FakeNVMLError(self.fail[(function, index)])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("handle", index)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index, gpu in enumerate(self.gpus):
            if gpu["uuid"] == uuid:
                return index
        raise FakeNVMLError(6)  # NOT_FOUND

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return str(self.gpus[handle]["uuid"]).encode()

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(self.gpus[handle]["name"])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check("memory", handle)
        gpu = self.gpus[handle]
        return SimpleNamespace(
            total=gpu["total"], used=gpu["used"], free=gpu["total"] - gpu["used"]
        )

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check("utilization", handle)
        return SimpleNamespace(gpu=self.gpus[handle]["util"], memory=0)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        self._check("mig", handle)
        return [1 if self.gpus[handle].get("mig") else 0, 0]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        self._check("processes", handle)
        held = self.gpus[handle].get("processes", {})
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in held.items()]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


def two_gpus() -> list[dict[str, Any]]:
    return [
        {
            "uuid": "GPU-aaaa",
            "name": "NVIDIA H200",
            "total": 141 * GiB,
            "used": GiB,
            "util": 7,
            "processes": {101: GiB // 2, 102: GiB // 2},
        },
        {
            "uuid": "GPU-bbbb",
            "name": "NVIDIA A100",
            "total": 80 * GiB,
            "used": 0,
            "util": 0,
            "mig": True,
        },
    ]


def test_inventory_lists_every_gpu_with_mig_mode() -> None:
    nvml = Nvml(library=ScriptedNvml(two_gpus()))
    assert nvml.available
    assert nvml.inventory() == [
        GpuFacts("GPU-aaaa", index=0, model="NVIDIA H200", memory_total=141 * GiB),
        GpuFacts("GPU-bbbb", index=1, model="NVIDIA A100", memory_total=80 * GiB, mig_enabled=True),
    ]


def test_sample_reports_memory_and_utilization_with_the_injected_clock() -> None:
    nvml = Nvml(library=ScriptedNvml(two_gpus()), clock=lambda: 1234.5)
    first = nvml.sample()[0]
    assert (first.uuid, first.memory_used, first.memory_free) == ("GPU-aaaa", GiB, 140 * GiB)
    assert first.utilization_percent == 7 and first.healthy and first.time == 1234.5
    assert first.compute_processes == 2


def test_sample_reports_what_each_process_holds_where_nvml_can_say() -> None:
    gpus = two_gpus()
    gpus[0]["processes"] = {4242: 3 * GiB, 4343: None}  # None: NVML_VALUE_NOT_AVAILABLE
    library = ScriptedNvml(gpus)
    library.fail[("processes", 1)] = library.NVML_ERROR_NOT_SUPPORTED
    first, second = Nvml(library=library).sample()
    assert first.processes == {4242: 3 * GiB}
    assert first.compute_processes == 2  # counted even where its memory is not reported
    assert first.pids == (4242, 4343)  # and listed: a process without the hook is found by pid
    assert second.processes == {} and second.healthy  # unknown, not an unhealthy GPU
    assert second.compute_processes is None and second.pids is None  # unknown, not none


def test_the_core_hears_every_listed_process_with_its_identity_and_nothing_of_unlisted_gpus() -> (
    None
):
    gpus = two_gpus()
    gpus[0]["processes"] = {4242: 3 * GiB, 4343: None, 4444: GiB}
    library = ScriptedNvml(gpus)
    library.fail[("processes", 1)] = library.NVML_ERROR_NOT_SUPPORTED
    asked: list[set[int]] = []

    def identify(pids: Collection[int]) -> dict[int, ClientIdentity]:
        asked.append(set(pids))
        return {pid: ClientIdentity(pid, 0, 0) for pid in pids if pid != 4444}  # 4444 exited

    seen = processes_seen(Nvml(library=library).sample(), identify)
    assert asked == [{4242, 4343, 4444}]
    assert seen.gpus == {"GPU-aaaa"}  # GPU-bbbb's processes could not be listed
    assert [(p.gpu_uuid, p.ident.pid, p.memory_bytes) for p in seen.processes] == [
        ("GPU-aaaa", 4242, 3 * GiB),
        ("GPU-aaaa", 4343, None),
    ]


def test_sample_keeps_going_when_one_gpu_fails_and_logs_each_error_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    library = ScriptedNvml(two_gpus())
    library.fail[("memory", 0)] = library.NVML_ERROR_GPU_IS_LOST
    library.fail[("utilization", 1)] = library.NVML_ERROR_NOT_SUPPORTED  # MIG boards do this
    nvml = Nvml(library=library)
    with caplog.at_level(logging.WARNING, logger="appliance.gpu.nvml"):
        for _ in range(3):
            lost, mig = nvml.sample()
    assert not lost.healthy and lost.memory_total == 0
    assert mig.healthy and mig.utilization_percent is None and mig.memory_total == 80 * GiB
    lost_lines = [r for r in caplog.records if "GPU-aaaa" in r.getMessage()]
    assert len(lost_lines) == 1  # three failing samples, one log line
    assert not any("utilization" in r.getMessage() for r in caplog.records)  # expected, silent


def test_a_gpu_whose_handle_fails_is_left_out_of_the_inventory() -> None:
    library = ScriptedNvml(two_gpus())
    library.fail[("handle", 0)] = 999
    assert [gpu.uuid for gpu in Nvml(library=library).inventory()] == ["GPU-bbbb"]


def test_health_follows_queries_and_critical_xids_but_not_application_xids() -> None:
    library = ScriptedNvml(two_gpus())
    nvml = Nvml(library=library)
    assert nvml.healthy("GPU-aaaa") and nvml.healthy("GPU-bbbb")
    assert not nvml.healthy("GPU-gone")
    library.events.append(SimpleNamespace(eventData=31, device=0))  # MMU fault: the app's fault
    assert nvml.healthy("GPU-aaaa")
    library.events.append(SimpleNamespace(eventData=79, device=1))  # fell off the bus
    assert not nvml.healthy("GPU-bbbb")
    assert nvml.healthy("GPU-aaaa")
    assert [s.healthy for s in nvml.sample()] == [True, False]
    library.fail[("memory", 0)] = library.NVML_ERROR_GPU_IS_LOST
    assert not nvml.healthy("GPU-aaaa")


def test_init_failure_leaves_nvml_unavailable_with_one_clear_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.gpu.nvml"):
        nvml = Nvml(library=ScriptedNvml(two_gpus(), init_error=9))  # DRIVER_NOT_LOADED
    assert not nvml.available
    assert nvml.inventory() == [] and nvml.sample() == [] and not nvml.healthy("GPU-aaaa")
    assert len(caplog.records) == 1
    assert "hooks report" in caplog.records[0].getMessage()


def test_real_pynvml_without_a_driver_says_so_instead_of_crashing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.gpu.nvml"):
        nvml = Nvml()
    if nvml.available:
        pytest.skip("this machine has an NVIDIA driver; the absent-driver path is not reachable")
    assert nvml.inventory() == [] and nvml.sample() == []
    message = caplog.records[0].getMessage()
    assert "NVML is not available" in message and "NVML Shared Library Not Found" in message
    nvml.close()


def test_close_shuts_nvml_down_once() -> None:
    library = ScriptedNvml(two_gpus())
    nvml = Nvml(library=library)
    nvml.close()
    nvml.close()
    assert library.shutdowns == 1 and not nvml.available


FAKE_NVML_CHECK = """
import json, sys
from appliance.gpu.nvml import Nvml
nvml = Nvml()
gpus = nvml.inventory()
print(json.dumps({"available": nvml.available,
                  "inventory": [[g.index, g.uuid, g.model, g.memory_total] for g in gpus],
                  "samples": [[s.uuid, s.memory_used, s.memory_free, s.utilization_percent,
                               s.compute_processes, s.healthy, sorted(s.processes.items())]
                              for s in nvml.sample()],
                  "healthy": [nvml.healthy(g.uuid) for g in gpus]}))
"""


def test_the_real_pynvml_reads_the_fake_nvml_library(tmp_path: Path) -> None:
    """What the node daemon sees on a CPU-only machine with ld_hook's fake libnvidia-ml.so.1.

    pynvml opens "libnvidia-ml.so.1" by name, so the library is chosen by LD_LIBRARY_PATH in a
    fresh process; the fake's devices take their use from a state file a test can rewrite,
    naming real PIDs where a test needs NVML to list its own processes.
    """
    subprocess.run(["make", "-s", "-C", str(ROOT / "ld_hook")], check=True)
    state = tmp_path / "nvml-state"
    state.write_text(
        "# index used processes utilization [pid[:bytes]...]\n1 3221225472 3 64 4242:1048576 77\n"
    )
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(ROOT / "ld_hook" / "build" / "fake"),
        "NVSHARE_FAKE_GPU_COUNT": "2",
        "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
        "NVSHARE_FAKE_NVML_STATE": str(state),
    }
    done = subprocess.run(
        [sys.executable, "-c", FAKE_NVML_CHECK], env=env, capture_output=True, text=True, check=True
    )
    seen = json.loads(done.stdout)
    assert seen["available"]
    assert [g[0] for g in seen["inventory"]] == [0, 1]
    assert all(g[2] == "NVIDIA Fake GPU" and g[3] == 16 * GiB for g in seen["inventory"])
    idle, busy = seen["samples"]
    assert idle[1:] == [0, 16 * GiB, 0, 0, True, []]
    assert busy[1:-1] == [3 * GiB, 13 * GiB, 64, 3, True]
    # The named PIDs first (one with its own size, one with an equal share), then a made-up one.
    assert busy[-1] == [[77, GiB], [4242, 1 << 20], [40102, GiB]]
    assert seen["healthy"] == [True, True]
    assert "NVML error" not in done.stderr  # every call the daemon makes is implemented
