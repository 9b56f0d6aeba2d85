"""The real-time check at scheduling time: does a node's GPU really have room for a pod?

A node's GPUs can be full of memory nobody here manages: a pod of NVIDIA's device plugin, a
process on the host. Judging by what nodes publish (`placement.status`) keeps a pod from being
placed there only to fail with out-of-memory. Per node, with the pod's need per GPU
(`placement.demand`) and the policy's `realtimeCheck`:

* fresh status: the node fits when its `gpus` best healthy GPUs each have `need` free beyond
  the safety margin. Not fitting: `strict` filters it out (the reason goes back to
  kube-scheduler, which shows it on the pod), `warning` keeps it; both log the requested,
  really used and total memory.
* status missing, unreadable, or older than its publisher's refresh promise plus
  `maxSampleAge`: fall back to the cached/declared capacity (the last status that parsed, with
  the policy's declared GPU sizes, minus what pods already bound there need) and log
  `Failed to get real-time usage, using cached data node=... gpu=... error=...` (once per
  node, GPU and kind of failure until it recovers). With no capacity known at all the node is
  kept: no information never filters a node out.
* `disabled`, or a pod that opted out: every node is kept, unjudged.

Scores for prioritize run from 0 to 10 (kube-scheduler's MaxExtenderPriority), in proportion
to the room each node has for the pod, real where known and estimated otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from appliance.core.gpus import GpuFacts
from appliance.core.limits import gpu_settings
from appliance.placement.demand import PodDemand
from appliance.placement.status import GpuStatus, NodeGpuStatus
from appliance.policy.model import Policy, RealtimeCheckMode
from appliance.policy.quantity import MiB, format_bytes

log = logging.getLogger("nvshare.extender")

MAX_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority


class Basis(enum.Enum):
    REALTIME = "real-time"  # the node's fresh NVML status
    CACHED = "cached"  # the fallback: capacity known, use unknown
    NONE = "none"  # nothing known, or not judged


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the extender's caches know about one node."""

    name: str
    status: NodeGpuStatus | None  # the annotation now, if it parses
    error: str | None = None  # why it does not (absent, malformed)
    last_good: NodeGpuStatus | None = None  # the newest status that ever parsed
    bound_bytes: int = 0  # what the pods bound to the node are known to need


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    node: str
    keep: bool  # stays in the filter's answer
    fits: bool  # has room for the pod, by `basis`
    basis: Basis
    reason: str  # why, in a sentence (kube-scheduler shows it on the pod when not kept)
    room_bytes: int = 0  # free beyond the margin and the need; drives the score


def check_mode(
    policy: Policy, *, switch: bool | None, pod_opt_in: bool | None
) -> RealtimeCheckMode:
    """The mode for one pod: the policy's mode, the extender's on/off switch, the pod's opt-in,
    with HAMi's meaning (`RealtimeCheck.mode_for`): a pod's "true" opts in while the check is
    off by default, and a mode set to disabled stays disabled whatever the switch says."""
    return policy.realtime_check.mode_for(pod_opt_in=pod_opt_in, switch=switch)


def _mib(n: int) -> str:
    return f"{max(n, 0) // MiB}MiB"


class NodeJudge:
    """Judges nodes for pods; remembers which fallbacks it has logged, nothing else."""

    def __init__(self) -> None:
        self._fallbacks_said: dict[str, set[tuple[str, str]]] = {}  # node -> {(gpu, kind)}

    def judge(
        self,
        view: NodeView,
        demand: PodDemand,
        *,
        mode: RealtimeCheckMode,
        policy: Policy,
        now: float,
    ) -> NodeVerdict:
        if mode is RealtimeCheckMode.DISABLED:
            return NodeVerdict(view.name, True, True, Basis.NONE, "real-time check not applied")
        max_age = policy.realtime_check.max_sample_age_s
        status, problem = _usable(view, max_sample_age_s=max_age, now=now)
        if status is not None:
            self._fallbacks_said.pop(view.name, None)
            verdict = _judge_realtime(view.name, status, demand, policy)
        else:
            assert problem is not None
            self._say_fallback(view, problem)
            verdict = _judge_cached(view, demand, policy, problem)
        if verdict.fits:
            return verdict
        kept = mode is not RealtimeCheckMode.STRICT
        if status is not None:
            _say_failed(view.name, status, demand, policy, mode=mode, kept=kept)
        else:
            log.log(
                logging.WARNING if kept else logging.INFO,
                "Real-time check failed on cached data node=%s pod=%s mode=%s node %s: %s",
                view.name,
                demand.pod,
                mode.value,
                "kept" if kept else "filtered out",
                verdict.reason,
            )
        return dataclasses.replace(verdict, keep=kept)

    def _say_fallback(self, view: NodeView, problem: tuple[str, str]) -> None:
        kind, error = problem
        known = view.last_good or view.status
        gpus = [g.uuid for g in known.gpus] if known is not None else ["unknown"]
        said = self._fallbacks_said.setdefault(view.name, set())
        for gpu in gpus:
            level = logging.DEBUG if (gpu, kind) in said else logging.WARNING
            said.add((gpu, kind))
            log.log(
                level,
                "Failed to get real-time usage, using cached data node=%s gpu=%s error=%s",
                view.name,
                gpu,
                error,
            )


def _usable(
    view: NodeView, *, max_sample_age_s: float, now: float
) -> tuple[NodeGpuStatus | None, tuple[str, str] | None]:
    """The node's status if it can be trusted now, else (None, (kind, why))."""
    status = view.status
    if status is None:
        return None, ("missing", view.error or "no GPU status published on the node")
    age = now - status.sampled_at
    trusted = status.refresh_s + max_sample_age_s
    if age > trusted:
        return None, (
            "stale",
            f"GPU status sampled {age:.0f}s ago, beyond its {status.refresh_s:g}s refresh "
            f"plus {max_sample_age_s:g}s maxSampleAge; is the node daemon running?",
        )
    if age < -max_sample_age_s:
        return None, ("future", f"GPU status is dated {-age:.0f}s in the future (clock skew?)")
    return status, None


def _rooms(gpus: Iterable[GpuStatus], margin: int) -> list[tuple[int, GpuStatus]]:
    """(free beyond the margin, gpu) of the healthy GPUs, most room first."""
    return sorted(
        ((g.memory_free - margin, g) for g in gpus if g.healthy),
        key=lambda pair: pair[0],
        reverse=True,
    )


def _judge_realtime(
    node: str, status: NodeGpuStatus, demand: PodDemand, policy: Policy
) -> NodeVerdict:
    margin = policy.realtime_check.safety_margin_bytes
    need = demand.memory_bytes or 0
    rooms = _rooms(status.gpus, margin)
    if not rooms:
        return NodeVerdict(node, False, False, Basis.REALTIME, "no healthy GPU on the node")
    count = min(demand.gpus, len(rooms))
    room, gpu = rooms[count - 1]
    if room >= need:
        return NodeVerdict(node, True, True, Basis.REALTIME, "fits", room - need)
    n = gpu.compute_processes
    processes = "" if n is None else f", {n} compute process{'' if n == 1 else 'es'}"
    reason = (
        f"nvshare real-time check: the pod needs {format_bytes(need)} per GPU "
        f"({demand.source}) on {count} GPU(s); GPU {gpu.uuid} has {_mib(room)} free beyond "
        f"the {format_bytes(margin)} margin ({_mib(gpu.memory_used)} of "
        f"{_mib(gpu.memory_total)} used{processes})"
    )
    return NodeVerdict(node, False, False, Basis.REALTIME, reason, room - need)


def _say_failed(
    node: str,
    status: NodeGpuStatus,
    demand: PodDemand,
    policy: Policy,
    *,
    mode: RealtimeCheckMode,
    kept: bool,
) -> None:
    margin = policy.realtime_check.safety_margin_bytes
    rooms = _rooms(status.gpus, margin)
    gpu = rooms[min(demand.gpus, len(rooms)) - 1][1] if rooms else None
    log.log(
        logging.WARNING if kept else logging.INFO,
        "Real-time check failed node=%s gpu=%s pod=%s requested=%s used=%s total=%s free=%s "
        "margin=%s mode=%s node %s",
        node,
        gpu.uuid if gpu else "none-healthy",
        demand.pod,
        _mib(demand.memory_bytes or 0),
        _mib(gpu.memory_used) if gpu else "-",
        _mib(gpu.memory_total) if gpu else "-",
        _mib(gpu.memory_free) if gpu else "-",
        _mib(margin),
        mode.value,
        "kept" if kept else "filtered out",
    )


def _declared(gpu: GpuStatus, policy: Policy) -> int:
    facts = GpuFacts(uuid=gpu.uuid, index=gpu.index, model=gpu.model, memory_total=gpu.memory_total)
    return gpu_settings(policy, facts).memory_bytes


def _judge_cached(
    view: NodeView, demand: PodDemand, policy: Policy, problem: tuple[str, str]
) -> NodeVerdict:
    known = view.last_good or view.status
    if known is None:
        reason = f"no GPU capacity known ({problem[1]}); kept unjudged"
        return NodeVerdict(view.name, True, True, Basis.NONE, reason)
    margin = policy.realtime_check.safety_margin_bytes
    need = demand.memory_bytes or 0
    sizes = sorted((_declared(g, policy) for g in known.gpus if g.healthy), reverse=True)
    if not sizes:
        return NodeVerdict(view.name, False, False, Basis.CACHED, "no healthy GPU cached")
    count = min(demand.gpus, len(sizes))
    spare = sum(sizes) - view.bound_bytes - margin - need * count
    fits = sizes[count - 1] - margin >= need and spare >= 0
    reason = (
        "fits by cached capacity"
        if fits
        else f"nvshare real-time check (cached data, {problem[1]}): the pod needs "
        f"{format_bytes(need)} per GPU on {count} GPU(s); the node's {len(sizes)} GPU(s) hold "
        f"{_mib(sum(sizes))} of which pods bound there need {_mib(view.bound_bytes)}"
    )
    return NodeVerdict(view.name, fits, fits, Basis.CACHED, reason, spare)


def scores(verdicts: Iterable[NodeVerdict]) -> dict[str, int]:
    """0-10 per node, in proportion to its room for the pod; nothing known scores 0."""
    rooms: Mapping[str, int] = {
        v.node: max(v.room_bytes, 0) if v.basis is not Basis.NONE else 0 for v in verdicts
    }
    best = max(rooms.values(), default=0)
    if best <= 0:
        return dict.fromkeys(rooms, 0)
    return {node: (room * MAX_SCORE) // best for node, room in rooms.items()}
