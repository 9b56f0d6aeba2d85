"""The limits the daemon publishes for hooks that cannot register, and remembers across its own
restarts.

A hook that cannot reach the daemon, or is not answered (the daemon restarting, overloaded, or
refusing it a connection), would otherwise run with no limit but its own environment's. So the
daemon keeps a file in the hooks' socket directory current (`appliance.daemon.limits_file`
writes it):
the memory limit of every pod of the node as its annotations, nvsharectl and the policy's pod
rules set it, and a default for everyone else. The same file, read at start, is what a
restarted daemon knows of pods its pod watch has not listed yet.

Only the memory limit is published: the lock needs the daemon anyway. Rules that match a
user, group, unit or executable cannot be resolved without the process, so the default is the
tightest memory limit the policy sets anywhere (its defaults or any rule): under a 1 GiB rule
per user and no default, a program kept from registering (a connection churner filling the
backlog) used to run with no limit at all. No limit only where the policy sets none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.limits import resolve_limits
from appliance.core.state import NodeState

_ANYONE = ClientIdentity(pid=0, uid=-1, gid=-1)  # matches no uid, user or group rule
_ANY_GPU = GpuFacts(uuid="")


@dataclass(frozen=True, slots=True)
class PublishedLimits:
    default: int | None  # bytes; None = no limit
    pods: Mapping[str, int | None] = field(default_factory=dict)  # pod UID -> bytes


def published_limits(s: NodeState) -> PublishedLimits:
    pods: dict[str, int | None] = dict(s.pods.remembered)
    for uid, pod in s.pods.pods.items():
        pods[uid] = resolve_limits(
            policy=s.policy,
            ident=ClientIdentity(pid=0, uid=-1, gid=-1, pod_uid=uid),
            gpu=_ANY_GPU,
            pod=pod,
            annotations=s.pods.overrides_of(pod),
            admin=s.overrides.limits_for(0, pod),
        ).memory_bytes
    default = resolve_limits(policy=s.policy, ident=_ANYONE, gpu=_ANY_GPU).memory_bytes
    return PublishedLimits(default=_tightest(default, s), pods=pods)


def _tightest(default: int | None, s: NodeState) -> int | None:
    """The smallest memory limit of the defaults and every rule, None where none sets one."""
    limits = [r.limits.memory_bytes for r in s.policy.rules if r.limits.memory_bytes is not None]
    if default is not None:
        limits.append(default)
    return min(limits, default=None)
