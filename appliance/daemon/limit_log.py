"""One log line per live limit change, as nvshare's fork prints one per annotation change.

`Memory limit changed for pod default/train: 0 -> 2147483648 bytes` is what seed 000 checks
its test plan against; here every change pushed to a running hook says who (pod, client, pid),
what moved (old -> new, for each limit that did) and what set the new value (an annotation, a
policy rule and its file, nvsharectl, the policy default), so an operator can follow a
`kubectl annotate` to the hooks without a debugger.

It sits in front of the socket server for the two actions that tell a hook its limits
(`Registered`, `LimitsChanged`): it remembers what each client was told and passes every
action on unchanged. The core decides; this only narrates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.core import actions as act
from appliance.core.limits import HookLimits
from appliance.policy.quantity import format_bytes

if TYPE_CHECKING:
    from appliance.core.node import NodeCore

log = logging.getLogger("nvshare.limits")


@dataclass(frozen=True, slots=True)
class LimitContext:
    """Who a client is and what set its limits, read from the core when a change is logged."""

    who: str  # "pod default/train (client 3, pid 4242)"
    memory_source: str  # "annotation", "rule 'big' (10-team.yaml#/rules/0)", ...
    core_source: str


def _memory(limits: HookLimits) -> str:
    return "unlimited" if limits.memory_bytes is None else format_bytes(limits.memory_bytes)


def describe_change(old: HookLimits | None, new: HookLimits, context: LimitContext) -> str:
    """`limits of pod default/train (client 3, pid 4242): memory 2Gi -> 4Gi (from annotation)`"""
    parts = []
    if old is None or old.memory_bytes != new.memory_bytes:
        was = "unknown" if old is None else _memory(old)
        parts.append(f"memory {was} -> {_memory(new)} (from {context.memory_source})")
    if old is None or old.core_percent != new.core_percent:
        was = "unknown" if old is None else f"{old.core_percent}%"
        parts.append(f"core {was} -> {new.core_percent}% (from {context.core_source})")
    if old is not None and old.mode != new.mode:
        parts.append(f"mode {old.mode.value} -> {new.mode.value}")
    if old is not None and old.backing != new.backing:
        parts.append(f"backing {old.backing.value} -> {new.backing.value}")
    if (
        old is not None
        and old.single_process_oversubscription != new.single_process_oversubscription
    ):
        parts.append(
            "oversubscription "
            f"{old.single_process_oversubscription} -> {new.single_process_oversubscription}"
        )
    return f"limits of {context.who}: {', '.join(parts) or 'unchanged'}"


class LimitChangeLog:
    """A sink for `Registered` and `LimitsChanged` that logs each change, then forwards."""

    ACTIONS: tuple[type, ...] = (act.Registered, act.LimitsChanged)

    def __init__(
        self,
        forward: Callable[[Any], None],  # the socket server's send
        *,
        context: Callable[[int], LimitContext | None],
        live: Callable[[], int],
    ) -> None:
        self._forward = forward
        self._context = context  # None: the client is gone already
        self._live = live  # how many clients the core knows, to bound what is remembered
        self._told: dict[int, HookLimits] = {}

    def __call__(self, action: act.Registered | act.LimitsChanged) -> None:
        if isinstance(action, act.Registered):
            self._remember(action.client_id, action.limits)
        else:
            old = self._told.get(action.client_id)
            context = self._context(action.client_id)
            if context is not None:
                log.info("%s", describe_change(old, action.limits, context))
            self._told[action.client_id] = action.limits
        self._forward(action)

    def _remember(self, client_id: int, limits: HookLimits) -> None:
        self._told[client_id] = limits
        if len(self._told) > 2 * self._live() + 64:  # clients that left: forget them
            for gone in [c for c in self._told if self._context(c) is None]:
                del self._told[gone]


def limit_context(core: NodeCore, client_id: int) -> LimitContext | None:
    """Who a client is and what set its limits, for the log line of a limit change."""
    c = core.state.clients.get(client_id)
    if c is None:
        return None
    pod, source = core.state.pod_of(c.ident)
    who = f"client {c.id} (pid {c.ident.pid})"
    if pod is not None:
        claimed = ", claimed" if source == "claimed" else ""
        who = f"pod {pod.namespace}/{pod.name} (client {c.id}, pid {c.ident.pid}{claimed})"
    sources = c.limits.sources
    return LimitContext(
        who=who,
        memory_source=sources.memory,
        core_source=sources.core,
    )
