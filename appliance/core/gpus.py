"""What the core knows of a physical GPU: its identity and size, as NVML or the hook reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuFacts:
    uuid: str
    index: int | None = None
    model: str | None = None
    total_memory: int = 0  # as the driver reports it
