"""How much GPU memory a pod will need, decided before it runs, from what the pod says.

In order, the first that says something wins:

1. the annotation `nvshare.com/gpu-memory-limit`, judged exactly as the node daemon judges it
   (`resolve_overrides`: a bare number is MiB, the policy's annotation caps apply, a refused
   value counts as absent and is reported);
2. HAMi's resource `nvidia.com/gpumem` (MiB per GPU), so pods written for HAMi keep working;
3. the policy: the last matching rule that sets `memoryLimit`, else `defaults.memoryLimit`.
   Only rules a pod can match before it runs count (namespace, pod name, labels); a rule on a
   Unix user, group, unit or executable is about processes and is left to the node.

None of them: the need is unknown, and the check asks only for the safety margin.
The number of GPUs is the pod's `devicePlugin.resourceName` (or HAMi's `nvidia.com/gpu`)
count, at least one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.core.annotations import MEMORY_LIMIT, resolve_overrides
from appliance.core.identity import ClientIdentity
from appliance.core.limits import rule_matches
from appliance.placement.resources import pod_info, pod_request
from appliance.policy.model import Policy
from appliance.policy.quantity import MiB

HAMI_MEMORY = "nvidia.com/gpumem"  # MiB per GPU
HAMI_GPUS = "nvidia.com/gpu"

# A process nobody is: no uid, user, group, unit or executable matches it, so only rules that
# name nothing but pods (or nothing at all) match a pod through it.
_NO_PROCESS = ClientIdentity(pid=0, uid=-1, gid=-1)


@dataclass(frozen=True, slots=True)
class PodDemand:
    pod: str  # namespace/name, for log lines
    memory_bytes: int | None  # per GPU; None: nothing says
    source: str  # what set memory_bytes
    gpus: int
    realtime_check: bool | None  # the pod's own opt-in (True) or opt-out (False)
    problems: tuple[str, ...] = ()  # annotations that were refused, for the log


def pod_demand(pod: Mapping[str, Any], policy: Policy) -> PodDemand:
    """What `pod` (as the API serves it) needs on each GPU, and who said so."""
    info = pod_info(pod)
    overrides, refused = resolve_overrides(
        info.annotations, pod=info.ref, policy=policy.annotations, previous=None
    )
    gpus = max(pod_request(pod, policy.device_plugin.resource_name), pod_request(pod, HAMI_GPUS))
    memory, source = overrides.memory_bytes, f"annotation {MEMORY_LIMIT}"
    if memory is None and (hami := pod_request(pod, HAMI_MEMORY)):
        memory, source = hami * MiB, f"resource {HAMI_MEMORY}"
    if memory is None:
        memory, source = policy.defaults.memory_bytes, "policy defaults.memoryLimit"
        for rule in policy.rules:
            if rule.limits.memory_bytes is not None and rule_matches(rule.match, _NO_PROCESS, info):
                memory, source = rule.limits.memory_bytes, f"policy rule {rule.name!r}"
    return PodDemand(
        pod=str(info.ref),
        memory_bytes=memory,
        source=source if memory is not None else "nothing (no annotation, resource or rule)",
        gpus=max(gpus, 1),
        realtime_check=overrides.realtime_check,
        problems=tuple(str(p) for p in refused),
    )
