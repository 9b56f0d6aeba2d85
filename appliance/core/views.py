"""What the core shows: status (GPUs, clients, counters), explain, and nvsharectl's overrides.

Read-only views of `NodeState` for nvsharectl, the metrics collector and the device plugin;
building them changes nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from appliance.core.limits import describe
from appliance.core.state import Client, NodeState, Phase


def client_view(s: NodeState, c: Client, now: float) -> dict[str, Any]:
    return {
        "id": c.id,
        "pid": c.ident.pid,
        "uid": c.ident.uid,
        "pod": s.pod_label(c),
        "pod_source": c.pod_source or None,
        "gpu": c.gpu,
        "state": c.phase.value,
        "memory_limit": c.limits.memory_bytes,
        "core_limit": c.limits.core_percent,
        "gated": c.gated,
        "memory_used": c.used,
        "memory_reserved": c.reserved,
        "memory_observed": c.nvml_used,
        "held_for_s": round(now - c.granted_at, 3) if c.phase is Phase.HOLDING else None,
        "waiting_for_s": round(now - c.requested_at, 3) if c.phase is Phase.WAITING else None,
        "limits_from": dict(c.limits.sources),
    }


def status(s: NodeState, now: float) -> dict[str, Any]:
    modes = s.overrides.modes
    gpus = []
    for uuid, gpu in sorted(s.gpus.items()):
        gpus.append(
            {
                "uuid": uuid,
                "index": gpu.facts.index,
                "model": gpu.facts.model,
                "mode": s.gpu_mode(uuid).value,
                "mode_source": "nvsharectl" if (uuid in modes or "" in modes) else "policy",
                "time_quantum_s": s.time_quantum(uuid),
                "tq_source": "nvsharectl" if s.overrides.time_quantum_s else "policy",
                "memory_total": s.gpu_memory(uuid),
                "holders": sorted(gpu.holders),
                "queue": list(gpu.queue),
            }
        )
    return {
        "gpus": gpus,
        "clients": [client_view(s, c, now) for c in s.clients.values()],
        "counters": dict(s.counters),
        "default_mode": s.policy.scheduler.mode.value,
        "default_time_quantum_s": s.overrides.time_quantum_s or s.policy.scheduler.time_quantum_s,
    }


def explain(
    s: NodeState, *, pid: int | None = None, pod: str | None = None
) -> list[dict[str, Any]]:
    out = []
    for c in s.clients.values():
        label = s.pod_label(c)
        if pid is not None and c.ident.pid != pid:
            continue
        if pod is not None and label.split(" ")[0] != pod:
            continue
        out.append(
            {"client": c.id, "pid": c.ident.pid, "pod": label, "gpu": c.gpu, **describe(c.limits)}
        )
    return out


def load(s: NodeState) -> dict[str, int]:
    """Connected clients per GPU, for the device plugin's placement."""
    return dict(Counter(c.gpu for c in s.clients.values()))


def overrides(s: NodeState) -> dict[str, Any]:
    """Every limit stored by `nvsharectl limit set` and whom it reaches now, the time quantum
    and the modes set by nvsharectl."""
    rows = [
        {
            "target": str(target),
            "memory_limit": limits.memory_bytes,
            "core_limit": limits.core_percent,
            "clients": sorted({c.ident.pid for c in s.reached(target)}),
        }
        for target, limits in sorted(s.overrides.limits.items())
    ]
    return {
        "limits": rows,
        "time_quantum_s": s.overrides.time_quantum_s,
        "modes": {uuid or "*": m.value for uuid, m in s.overrides.modes.items()},
    }
