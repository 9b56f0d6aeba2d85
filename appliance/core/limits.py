"""Effective limits: a pure function of (policy, pod, overrides, identity, GPU).

Order, lowest to highest: policy default, matching rules (in order, later ones win field by
field), the GPU's declared size, pod annotations (capped by policy), an admin's
`nvsharectl limit set`. A limit the process set for itself through its environment can only
lower the result. Every value carries the name of what set it, for `policy explain`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from appliance.core.annotations import PodInfo, PodOverrides
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.policy.model import (
    Backing,
    GpuRule,
    Limits,
    Mode,
    Policy,
    RuleMatch,
    priority_name,
)
from appliance.policy.quantity import format_bytes


@dataclass(frozen=True, slots=True)
class Provenance:
    """What set each resolved limit ("policy default (file)", "rule 'x' (file)", "annotation",
    "nvsharectl limit set", "env NAME", ...), for `policy explain`, status and the limit log."""

    memory: str = "default"
    core: str = "default"
    priority: str = "default"
    request: str = "default"
    mode: str | None = None  # the rule that set a mode, where one did

    def as_dict(self) -> dict[str, str]:
        """As status shows it (`limits_from`): by limit, "mode" only where a rule set one."""
        shown = {
            "memory": self.memory,
            "core": self.core,
            "priority": self.priority,
            "request": self.request,
        }
        return shown | ({"mode": self.mode} if self.mode is not None else {})


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    memory_bytes: int | None  # None: the whole GPU
    core_percent: int
    exempt: bool  # a rule set mode off: never gated
    sources: Provenance = Provenance()
    priority: int = 0  # higher is granted first (`core.priority`)
    core_request: int = 0  # guaranteed percent under contention (`core.share`), <= core_percent


@dataclass(frozen=True, slots=True)
class HookLimits:
    """What a hook enforces: its limits, how it is gated (OFF: not at all) and how memory is
    backed. The socket server puts it on the wire; the core compares it to see what changed."""

    memory_bytes: int | None
    core_percent: int
    mode: Mode
    backing: Backing = Backing.DEVICE
    single_process_oversubscription: bool = False


def rule_matches(match: RuleMatch, ident: ClientIdentity, pod: PodInfo | None) -> bool:
    namespace = pod.namespace if pod else None
    name = pod.name if pod else None
    labels = pod.labels if pod else {}
    checks = [
        match.namespace is None or match.namespace == namespace,
        match.pod_name is None or (name is not None and fnmatchcase(name, match.pod_name)),
        all(labels.get(k) == v for k, v in match.pod_labels.items()),
        match.uid is None or match.uid == ident.uid,
        match.user is None or match.user == ident.user,
        match.group is None or match.group in ident.groups,
        match.systemd_unit is None
        or (ident.systemd_unit is not None and fnmatchcase(ident.systemd_unit, match.systemd_unit)),
        match.executable is None
        or (ident.executable is not None and fnmatchcase(ident.executable, match.executable)),
    ]
    return all(checks)


def gpu_rule_matches(rule: GpuRule, gpu: GpuFacts) -> bool:
    m = rule.match
    return (
        (m.uuid is None or m.uuid == gpu.uuid)
        and (m.index is None or m.index == gpu.index)
        and (m.model is None or (gpu.model is not None and fnmatchcase(gpu.model, m.model)))
    )


@dataclass(frozen=True, slots=True)
class GpuSettings:
    """What the policy's `gpus` rules make of one GPU."""

    mode: Mode
    time_quantum_s: float
    memory_bytes: int  # its size: declared by a rule, else NVML's; 0 where neither knows


def gpu_settings(policy: Policy, gpu: GpuFacts) -> GpuSettings:
    """The mode, time quantum and memory size of a GPU after the policy's `gpus` rules."""
    mode, tq, memory = policy.scheduler.mode, policy.scheduler.time_quantum_s, gpu.memory_total
    for rule in policy.gpus:
        if gpu_rule_matches(rule, gpu):
            mode = rule.mode or mode
            tq = rule.time_quantum_s or tq
            memory = rule.memory_bytes or memory
    return GpuSettings(mode=mode, time_quantum_s=tq, memory_bytes=memory)


def _source(policy: Policy, path: str) -> str:
    return policy.sources.get(path, "default")


@dataclass(slots=True)
class _Layers:
    """Limits being resolved, lowest layer first; each layer wins where it says something."""

    memory: int | None
    core: int
    priority: int
    request: int
    memory_from: str
    core_from: str
    priority_from: str
    request_from: str
    mode_from: str | None = None

    def over(self, memory: int | None, core: int | None, source: str) -> None:
        if memory is not None:
            self.memory, self.memory_from = memory, source
        if core is not None:
            self.core, self.core_from = core, source

    def over_scheduling(self, given: Limits | PodOverrides, source: str) -> None:
        """The priority and the guaranteed share, where `given` says them."""
        if given.priority is not None:
            self.priority, self.priority_from = given.priority, source
        if given.core_request is not None:
            self.request, self.request_from = given.core_request, source

    def provenance(self) -> Provenance:
        return Provenance(
            memory=self.memory_from,
            core=self.core_from,
            priority=self.priority_from,
            request=self.request_from,
            mode=self.mode_from,
        )


def _own(limits: _Layers, memory: int, core: int, priority: int | None) -> None:
    """What the process set for itself in its environment, which can only lower what the
    layers above decided."""
    if memory and (limits.memory is None or memory < limits.memory):
        limits.over(memory, None, "env NVSHARE_GPU_MEMORY_LIMIT")
    if core and core < limits.core:
        limits.over(None, core, "env NVSHARE_GPU_CORE_LIMIT")
    if priority is not None and priority < limits.priority:
        limits.priority, limits.priority_from = priority, "env NVSHARE_GPU_PRIORITY"


def _lower(memory: int | None, than: int | None) -> bool:
    return memory is not None and (than is None or memory < than)


def resolve_limits(
    *,
    policy: Policy,
    ident: ClientIdentity,
    gpu: GpuFacts,
    pod: PodInfo | None = None,
    annotations: PodOverrides | None = None,
    remembered: Limits | None = None,
    admin: Limits | None = None,
    env_memory_bytes: int = 0,
    env_core_percent: int = 0,
    env_priority: int | None = None,
) -> EffectiveLimits:
    limits = _Layers(
        policy.defaults.memory_bytes,
        policy.defaults.core_percent or 100,
        policy.defaults.priority or 0,
        policy.defaults.core_request or 0,
        memory_from=f"policy default ({_source(policy, '/defaults/memoryLimit')})",
        core_from=f"policy default ({_source(policy, '/defaults/coreLimit')})",
        priority_from=f"policy default ({_source(policy, '/defaults/priority')})",
        request_from=f"policy default ({_source(policy, '/defaults/coreRequest')})",
    )
    exempt = False
    for rule in (r for r in policy.rules if rule_matches(r.match, ident, pod)):
        label = f"rule {rule.name!r} ({rule.source})" if rule.source else f"rule {rule.name!r}"
        limits.over(rule.limits.memory_bytes, rule.limits.core_percent, label)
        limits.over_scheduling(rule.limits, label)
        if rule.mode is not None:
            exempt = rule.mode is Mode.OFF
            limits.mode_from = label
    gpu_memory = gpu_settings(policy, gpu).memory_bytes
    if limits.memory is None and gpu_memory and gpu_memory != gpu.memory_total:
        limits.over(gpu_memory, None, "declared GPU size (policy gpus)")
    if annotations is not None:
        limits.over(annotations.memory_bytes, annotations.core_percent, "annotation")
        limits.over_scheduling(annotations, "annotation")
    if remembered is not None and _lower(remembered.memory_bytes, limits.memory):
        # Lower only: a cgroup naming a pod proves nothing until the pod watch lists the pod.
        limits.over(remembered.memory_bytes, None, "last published for its pod (not listed yet)")
    if admin is not None:
        limits.over(admin.memory_bytes, admin.core_percent, "nvsharectl limit set")
    _own(limits, env_memory_bytes, env_core_percent, env_priority)
    if limits.request > limits.core:  # a guarantee beyond the cap cannot be kept
        limits.request = limits.core
        limits.request_from += f", cut to the core limit {limits.core}%"
    return EffectiveLimits(
        memory_bytes=limits.memory,
        core_percent=limits.core,
        exempt=exempt,
        sources=limits.provenance(),
        priority=limits.priority,
        core_request=limits.request,
    )


def describe(limits: EffectiveLimits) -> dict[str, str]:
    mem = "none" if limits.memory_bytes is None else format_bytes(limits.memory_bytes)
    return {
        "memory": f"{mem} (from {limits.sources.memory})",
        "core": f"{limits.core_percent}% (from {limits.sources.core})",
        "gated": "no (rule mode off)" if limits.exempt else "yes",
        "priority": f"{priority_name(limits.priority)} (from {limits.sources.priority})",
        "request": f"{limits.core_request}% (from {limits.sources.request})",
    }
