"""The GPU as a process is shown it: what nvidia-smi, NVML and cuMemGetInfo report inside a pod.

A tenant who types `nvidia-smi`, or a monitoring agent polling NVML, must see the GPU it has: its
limit as the total, what its pod holds as used (outside pods: what the process holds), and its
pod's own processes, not the whole card and everyone's. The hook asks for this view (also in
processes that never initialise CUDA, such as nvidia-smi) and shows it; a process without a
limit is shown the real GPU. Used is counted as the ledger counts it (allocations, plus what NVML
shows a process holding beyond them and its context allowance), so free memory in the view is
what the pod can still allocate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from appliance.core.identity import ClientIdentity
from appliance.core.ledger import counted
from appliance.core.state import NodeState


@dataclass(frozen=True, slots=True)
class HeldMemory:
    pid: int  # as the daemon sees it (the host's PID namespace)
    used: int  # bytes, as the ledger counts them
    asker: bool  # the process the view is for


@dataclass(frozen=True, slots=True)
class MemoryView:
    limit: int | None  # bytes; None: no limit, the real GPU is shown
    used: int  # bytes the pod (or process) holds on the GPU
    processes: tuple[HeldMemory, ...]  # the asker first, then by pid


def memory_view(s: NodeState, ident: ClientIdentity, gpu_uuid: str, gpu_total: int) -> MemoryView:
    """How `gpu_uuid` looks to the process `ident`, registered there or not."""
    facts = s.facts(gpu_uuid)
    if not facts.memory_total:
        facts = dataclasses.replace(facts, memory_total=gpu_total)
    limit = s.resolve_for(ident, facts).memory_bytes
    subject = s.subject_of(ident)
    held: dict[int, int] = {}
    for c in s.clients.values():
        if c.gpu == gpu_uuid and s.subject(c) == subject:
            held[c.ident.pid] = held.get(c.ident.pid, 0) + counted(c)
    processes = sorted(
        (HeldMemory(pid, used, pid == ident.pid) for pid, used in held.items()),
        key=lambda h: (not h.asker, h.pid),
    )
    return MemoryView(limit=limit, used=sum(held.values()), processes=tuple(processes))
