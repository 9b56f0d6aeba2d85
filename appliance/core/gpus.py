"""A physical GPU as everyone in the appliance knows it: NVML's inventory, the core's GPUs, the
device plugin's and the node status publisher's. One type, so a fact about a GPU has one name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuFacts:
    uuid: str
    index: int | None = None  # NVML's; None where only a hook has named the GPU
    model: str | None = None  # NVML's name, e.g. "NVIDIA H100 80GB HBM3"
    memory_total: int = 0  # bytes, as the driver reports it
    mig_enabled: bool = False


@dataclass(frozen=True, slots=True)
class GpuUse:
    """What NVML last showed of a GPU as a whole, every process's memory included."""

    uuid: str
    index: int | None
    memory_used: int | None  # bytes; None where NVML could not read it
    utilization_percent: int | None  # None where NVML does not report it (MIG, some boards)
    sampled_at: float  # the daemon's clock
