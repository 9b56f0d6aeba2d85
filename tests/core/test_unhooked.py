"""GPU processes without the hook: found from NVML's list, reported once past the grace period."""

from __future__ import annotations

import logging

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import PodInfo
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.core.unhooked import HOOK_MIN_GLIBC, WARNING_REASON
from appliance.policy.model import Policy, UnhookedProcesses

from .conftest import GPU, GiB, Harness, of

GPU2 = "GPU-00000000-0000-0000-0000-000000000002"
GRACE_S = Policy().unhooked_processes.grace_s
SHARED = PodInfo(
    "uid-old", "team", "legacy-train", "node-a", resources=frozenset({"nvshare.com/gpu"})
)
WHOLE = PodInfo("uid-whole", "team", "whole-gpu", "node-a", resources=frozenset({"nvidia.com/gpu"}))


def process(
    pid: int, *, gpu: str = GPU, memory: int | None = GiB, pod_uid: str | None = None, **ident: str
) -> ev.GpuProcess:
    return ev.GpuProcess(
        gpu,
        ClientIdentity(pid=pid, uid=1000, gid=1000, pod_uid=pod_uid, **ident),  # type: ignore[arg-type]
        memory,
    )


def listing(*processes: ev.GpuProcess, gpus: tuple[str, ...] = (GPU,)) -> ev.GpuProcessesSeen:
    return ev.GpuProcessesSeen(frozenset(gpus), processes)


def every_second(
    h: Harness, seconds: float, *processes: ev.GpuProcess, gpus: tuple[str, ...] = (GPU,)
) -> list[act.Action]:
    """NVML's listing of `gpus` once a second for `seconds`, as the sampler sends it."""
    out: list[act.Action] = []
    for _ in range(int(seconds)):
        out += h.feed(listing(*processes, gpus=gpus))
        h.now += 1.0
    return out


def unhooked_pids(h: Harness) -> list[int]:
    return [u.pid for u in h.core.status(h.now).unhooked]


def test_a_pod_process_that_never_registers_is_reported_once_with_a_warning_on_its_pod(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.feed(ev.PodSeen(SHARED))
    old = process(4242, pod_uid="uid-old", executable="/usr/bin/python3.6", container_id="c" * 64)
    out = every_second(harness, GRACE_S - 1, old)
    assert of(out, act.PodWarning) == [] and unhooked_pids(harness) == []  # still in its grace
    out = every_second(harness, 5, old)
    [warning] = of(out, act.PodWarning)
    assert warning.pod == SHARED.ref and warning.reason == WARNING_REASON
    assert f"older than {HOOK_MIN_GLIBC}" in warning.message and "musl" in warning.message
    assert "container cccccccccccc" in warning.message and "/usr/bin/python3.6" in warning.message
    [logged] = [r.getMessage() for r in caplog.records if "without registering" in r.getMessage()]
    assert "pid 4242" in logged and "team/legacy-train" in logged and GPU in logged
    [row] = harness.core.status(harness.now).unhooked
    assert (row.pid, row.pod, row.gpus, row.memory_used) == (4242, "team/legacy-train", (GPU,), GiB)
    assert harness.state.counters["unhooked_processes"] == 1


def test_a_process_that_registers_within_the_grace_period_is_never_reported(
    harness: Harness,
) -> None:
    starting = process(500)
    every_second(harness, GRACE_S / 2, starting)  # context created, registration on its way
    harness.register(pid=500)
    out = every_second(harness, 2 * GRACE_S, starting)
    assert unhooked_pids(harness) == [] and of(out, act.PodWarning) == []
    assert harness.state.unhooked == {}


def test_hooks_reconnecting_after_a_daemon_restart_are_not_reported(harness: Harness) -> None:
    # A fresh daemon sees every running process at once, before any hook has reconnected.
    running = [process(pid) for pid in (11, 12, 13)]
    every_second(harness, 6, *running)  # the hooks retry at least every 5 s
    for pid in (11, 12, 13):
        harness.register(pid=pid)
    every_second(harness, 2 * GRACE_S, *running)
    assert unhooked_pids(harness) == []


def test_a_short_lived_process_is_forgotten_and_a_reported_one_that_exits_goes(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    every_second(harness, GRACE_S / 2, process(7))
    every_second(harness, GRACE_S)  # it exited: NVML no longer lists it
    assert harness.state.unhooked == {}
    every_second(harness, GRACE_S + 1, process(8))
    assert unhooked_pids(harness) == [8]
    caplog.set_level(logging.INFO)
    every_second(harness, 1)
    assert unhooked_pids(harness) == []
    assert any(
        "pid 8" in r.getMessage() and "no longer on any GPU" in r.getMessage()
        for r in caplog.records
    )


def test_a_reported_process_that_registers_after_all_leaves_the_report(harness: Harness) -> None:
    every_second(harness, GRACE_S + 1, process(9))
    assert unhooked_pids(harness) == [9]
    harness.register(pid=9)  # its hook reached a daemon it could not reach before
    assert unhooked_pids(harness) == []


def test_a_gpu_nvml_could_not_list_keeps_what_was_known(harness: Harness) -> None:
    """One GPU's listing failing must neither forget a process there nor restart its grace."""
    on_two = process(21, gpu=GPU2)
    every_second(harness, GRACE_S / 2, on_two, gpus=(GPU, GPU2))
    every_second(harness, GRACE_S, gpus=(GPU,))  # GPU2 could not be listed since
    assert unhooked_pids(harness) == [21]  # the grace ran on, from its first sighting


def test_a_reused_pid_is_another_process_with_its_own_grace(harness: Harness) -> None:
    every_second(harness, GRACE_S - 2, process(33, executable="/bin/first"))
    every_second(harness, 5, process(33, executable="/bin/second"))
    assert unhooked_pids(harness) == []
    every_second(harness, GRACE_S, process(33, executable="/bin/second"))
    [row] = harness.core.status(harness.now).unhooked
    assert row.executable == "/bin/second"


def test_a_process_on_two_gpus_is_one_process_with_its_memory_summed(harness: Harness) -> None:
    both = (process(40, gpu=GPU), process(40, gpu=GPU2, memory=2 * GiB))
    every_second(harness, GRACE_S + 1, *both, gpus=(GPU, GPU2))
    [row] = harness.core.status(harness.now).unhooked
    assert row.gpus == tuple(sorted((GPU, GPU2))) and row.memory_used == 3 * GiB


def test_pods_that_did_not_ask_for_the_shared_resource_get_no_event(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod given a whole GPU by NVIDIA's plugin is not sharing: no Warning on it, but the
    node's log and status still show a GPU used outside nvshare."""
    harness.feed(ev.PodSeen(WHOLE))
    out = every_second(harness, GRACE_S + 1, process(50, pod_uid="uid-whole"))
    assert of(out, act.PodWarning) == []
    assert unhooked_pids(harness) == [50]
    assert any("did not ask for nvshare.com/gpu" in r.getMessage() for r in caplog.records)


def test_host_processes_are_told_how_to_start_under_the_hook(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    out = every_second(harness, GRACE_S + 1, process(60, systemd_unit="train.service"))
    assert of(out, act.PodWarning) == []
    [logged] = [r.getMessage() for r in caplog.records if "pid 60" in r.getMessage()]
    assert "train.service" in logged and "LD_PRELOAD" in logged


def test_the_grace_period_comes_from_the_policy() -> None:
    h = Harness(NodeCore(Policy(unhooked_processes=UnhookedProcesses(grace_s=5.0))))
    every_second(h, 4, process(70))
    assert unhooked_pids(h) == []
    every_second(h, 2, process(70))
    assert unhooked_pids(h) == [70]
