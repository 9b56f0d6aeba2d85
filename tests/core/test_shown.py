"""The GPU as a process is shown it (nvidia-smi, NVML, cuMemGetInfo inside a pod): its limit as
the total, what its pod holds as used, its pod's processes; the real GPU without a limit."""

from __future__ import annotations

from appliance.core import events as ev
from appliance.core.annotations import MEMORY_LIMIT, PodInfo
from appliance.core.identity import ClientIdentity
from appliance.core.ledger import CONTEXT_ALLOWANCE_BYTES
from appliance.core.node import NodeCore
from appliance.core.shown import HeldMemory
from appliance.policy.model import GpuMatch, GpuRule, Limits, Policy

from .conftest import GPU, GiB, Harness, MiB


def viewer(pid: int, pod_uid: str | None = None) -> ClientIdentity:
    """A process that never registered (nvidia-smi), as the kernel names it."""
    return ClientIdentity(pid=pid, uid=1000, gid=1000, pod_uid=pod_uid)


def test_a_pod_is_shown_its_limit_its_use_and_its_own_processes() -> None:
    h = Harness(NodeCore(Policy()))
    h.feed(ev.PodSeen(PodInfo("u1", "ns", "p", "n", annotations={MEMORY_LIMIT: "1Gi"})))
    a, b = h.register(pid=10, pod_uid="u1"), h.register(pid=11, pod_uid="u1")
    h.register(pid=12, pod_uid="other")
    h.feed(ev.MemoryReturned(a, 0, 300 * MiB))
    h.feed(ev.MemoryReturned(b, 0, 100 * MiB))
    shown = h.core.memory_view(viewer(99, "u1"), GPU, 80 * GiB)
    assert shown.limit == 1 * GiB
    assert shown.used == 400 * MiB
    assert shown.processes == (HeldMemory(10, 300 * MiB, False), HeldMemory(11, 100 * MiB, False))
    # a process of the pod asking is listed first and marked as itself
    assert h.core.memory_view(viewer(11, "u1"), GPU, 80 * GiB).processes[0] == HeldMemory(
        11, 100 * MiB, True
    )


def test_memory_nvml_shows_beyond_the_allocations_is_counted_as_the_hook_counts_it() -> None:
    h = Harness(NodeCore(Policy(defaults=Limits(memory_bytes=4 * GiB, core_percent=100))))
    a = h.register(pid=10)
    h.feed(ev.MemoryReturned(a, 0, 100 * MiB))
    held = CONTEXT_ALLOWANCE_BYTES + 1 * GiB  # module globals and heaps beyond the context
    h.feed(ev.GpuFreeMemory({GPU: 10 * GiB}, processes={GPU: {10: held}}))
    shown = h.core.memory_view(viewer(10), GPU, 80 * GiB)
    assert shown.used == 1 * GiB
    assert shown.processes == (HeldMemory(10, 1 * GiB, True),)


def test_outside_pods_a_process_is_shown_what_it_holds_itself() -> None:
    h = Harness(NodeCore(Policy(defaults=Limits(memory_bytes=1 * GiB, core_percent=100))))
    a = h.register(pid=10)
    h.feed(ev.MemoryReturned(a, 0, 200 * MiB))
    nvidia_smi = h.core.memory_view(viewer(50), GPU, 80 * GiB)
    assert (nvidia_smi.limit, nvidia_smi.used, nvidia_smi.processes) == (1 * GiB, 0, ())
    itself = h.core.memory_view(viewer(10), GPU, 80 * GiB)
    assert (itself.used, itself.processes) == (200 * MiB, (HeldMemory(10, 200 * MiB, True),))


def test_without_a_limit_the_real_gpu_is_shown() -> None:
    h = Harness(NodeCore(Policy()))
    h.register(pid=10)
    assert h.core.memory_view(viewer(50), GPU, 80 * GiB).limit is None


def test_a_gpu_declared_smaller_in_policy_is_shown_at_its_declared_size() -> None:
    policy = Policy(gpus=(GpuRule(GpuMatch(uuid=GPU), memory_bytes=8 * GiB),))
    h = Harness(NodeCore(policy))
    assert h.core.memory_view(viewer(50), GPU, 80 * GiB).limit == 8 * GiB
