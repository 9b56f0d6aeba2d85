"""Between the core's words and the wire's: the socket server's translation tables.

Frames from hooks become core events (`HOOK_EVENTS`), nvsharectl's state changes become control
events (`control_event`), and the core's actions become message bodies (`to_hook`, `result`). Pure
and in one place, so what the core hears and says on the wire can be read here at a glance; the
server applies these per connection, after it has checked identity and permission.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, assert_never

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuFacts
from appliance.core.limits import HookLimits
from appliance.policy.model import MAX_PRIORITY, MIN_PRIORITY, Limits, Policy
from appliance.policy.quantity import MAX_SIZE_BYTES
from appliance.wire import messages
from appliance.wire import protocol as p
from appliance.wire import protocol_gang as pg
from appliance.wire import protocol_view as pv
from appliance.wire.messages import Decoded, Message

# More than any GPU holds, far below any overflow: a hook's byte counts beyond it are lies.
MAX_GPU_BYTES = 1 << 50
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,46}")  # GPU-<uuid>, MIG-<uuid>
_NAMESPACE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")  # a DNS-1123 label, lenient on '.'
_POD_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")  # a DNS-1123 subdomain

_STATUS = {
    act.Outcome.DONE: p.Status.OK,
    act.Outcome.INVALID: p.Status.INVALID,
    act.Outcome.NOT_FOUND: p.Status.NOT_FOUND,
    act.Outcome.REFUSED: p.Status.PERMISSION,
}

# A registered hook's message, its client id and the frame's seq -> the core's event: each
# message's line of the table (`appliance.wire.messages`) names it.
HOOK_EVENTS = messages.HOOK_EVENTS


# The state changes nvsharectl asks for (`control_event`).
ControlMessage = p.SetTq | p.SetMode | p.LimitSet
CONTROL: tuple[type, ...] = typing.get_args(ControlMessage)


def control_event(msg: ControlMessage, by: str, to: ev.Requester) -> ev.Event:
    """A state change nvsharectl asks for as its event, from the message, who asked and whom
    to reply to; the core decides whether the asker may."""
    match msg:
        case p.SetTq():
            return _set_tq(msg, by, to)
        case p.SetMode():
            return _set_mode(msg, by, to)
        case p.LimitSet():
            return _limit_set(msg, by, to)
    assert_never(msg)


def _set_tq(msg: p.SetTq, by: str, to: ev.Requester) -> ev.Event:
    seconds = None if msg.flags & p.SET_FOLLOW_POLICY else float(msg.seconds)
    return ev.TimeQuantumSet(seconds, by=by, reply_to=to)


def _set_mode(msg: p.SetMode, by: str, to: ev.Requester) -> ev.Event:
    mode = None if msg.flags & p.SET_FOLLOW_POLICY else p.mode_of(msg.mode)
    return ev.ModeSet(mode, msg.gpu_uuid, by=by, reply_to=to)


def _limit_set(msg: p.LimitSet, by: str, to: ev.Requester) -> ev.Event:
    if msg.pid:
        target: ev.LimitTarget | None = ev.LimitTarget.pid(msg.pid)
    elif msg.pod_name and msg.pod_namespace:
        target = ev.LimitTarget.pod(msg.pod_namespace, msg.pod_name)
    else:
        target = None  # the core says what is missing
    return ev.AdminLimitSet(
        target,
        Limits(
            memory_bytes=msg.mem_limit if msg.flags & p.LIMIT_SET_HAS_MEM else None,
            core_percent=msg.core_limit if msg.flags & p.LIMIT_SET_HAS_CORE else None,
        ),
        clear_memory=bool(msg.flags & p.LIMIT_SET_CLEAR_MEM),
        clear_core=bool(msg.flags & p.LIMIT_SET_CLEAR_CORE),
        by=by,
        reply_to=to,
    )


def _place_problem(m: p.Register | pv.ViewRequest) -> str | None:
    """What is wrong with the GPU and the pod a hook names."""
    if not _DEVICE_NAME.fullmatch(m.gpu_uuid):
        return f"GPU name {m.gpu_uuid[:48]!r} is not a device UUID"
    if m.gpu_total_mem > MAX_GPU_BYTES:
        return "a byte count beyond any GPU"
    for what, name, pattern in (
        ("namespace", m.pod_namespace, _NAMESPACE),
        ("pod name", m.pod_name, _POD_NAME),
    ):
        if name and not pattern.fullmatch(name):
            return f"{what} {name[:64]!r} is not a Kubernetes name"
    return None


def _register_problem(m: p.Register) -> str | None:
    if m.env_mem_limit > MAX_SIZE_BYTES:
        return "a byte count beyond any GPU"
    if m.env_core_limit > 100:
        return f"core limit {m.env_core_limit} is above 100"
    return _place_problem(m)


def _bytes_problem(m: p.MemReserve | p.MemReturn) -> str | None:
    if m.nbytes > MAX_GPU_BYTES or m.used > MAX_GPU_BYTES:
        return "a byte count beyond any GPU"
    if isinstance(m, p.MemReserve) and m.nbytes == 0:
        return "a reservation of 0 bytes"
    return None


def _refusals_problem(m: p.MemRefusals) -> str | None:
    return "a byte count beyond any GPU" if m.largest > MAX_GPU_BYTES else None


def _gang_hint_problem(m: pg.GangHint) -> str | None:
    # the job's name becomes a gang key in logs, status and metric labels
    return None if m.name.isprintable() else f"job name {m.name[:64]!r} is not printable"


def _priority_hint_problem(m: p.PriorityHint) -> str | None:
    if MIN_PRIORITY <= m.priority <= MAX_PRIORITY:
        return None
    return f"priority {m.priority} is outside {MIN_PRIORITY} to {MAX_PRIORITY}"


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """The GPUs a hook may register on: those NVML lists on this node and those the policy
    declares by UUID. A made-up UUID used to be a GPU of its own, enough to make a process's
    two connections a gang "holding part of its GPUs" and have another client dropped at once.
    Empty (no NVML, none declared: a test machine) checks nothing; MIG instances are not
    listed one by one, so where a GPU has MIG on, a "MIG-" UUID passes."""

    uuids: frozenset[str] = frozenset()
    mig: bool = False

    @classmethod
    def of(cls, inventory: Iterable[GpuFacts], policy: Policy) -> NodeGpus:
        listed = list(inventory)
        declared = {r.match.uuid for r in policy.gpus if r.match.uuid}
        return cls(
            uuids=frozenset({g.uuid for g in listed} | declared),
            mig=any(g.mig_enabled for g in listed),
        )

    def problem(self, uuid: str) -> str | None:
        """Why a hook may not register on `uuid`, or None."""
        if not self.uuids or uuid in self.uuids or (self.mig and uuid.startswith("MIG-")):
            return None
        known = ", ".join(sorted(self.uuids)[:8])
        return (
            f"GPU {uuid[:64]!r} is not a GPU of this node (NVML lists and the policy "
            f"declares: {known})"
        )


# What is checked of each message a hook sends, by its class (looked up once per frame: every
# frame of every hook comes here); a message not listed has no field that can be out of range.
_HOOK_CHECKS: dict[type, Callable[[Any], str | None]] = {
    pg.GangHint: _gang_hint_problem,
    p.PriorityHint: _priority_hint_problem,
    p.Register: _register_problem,
    pv.ViewRequest: _place_problem,
    p.MemReserve: _bytes_problem,
    p.MemReturn: _bytes_problem,
    p.MemRefusals: _refusals_problem,
}


def hook_problem(message: Decoded) -> str | None:
    """What makes a hook's message unacceptable (a field out of range), or None (the daemon
    closes a hook that sends one)."""
    check = _HOOK_CHECKS.get(type(message))
    return None if check is None else check(message)


def wire_limits(limits: HookLimits) -> p.WireLimits:
    return p.WireLimits(
        mem_limit=limits.memory_bytes or 0,
        core_limit=limits.core_percent,
        mode=p.wire_mode(limits.mode),
        backing=p.wire_backing(limits.backing),
        flags=p.LIMIT_SINGLE_OVERSUB if limits.single_process_oversubscription else 0,
    )


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def to_hook(a: act.HookAction) -> tuple[int, Message, int]:
    """An action for a hook as (client id, message, seq): the whole of what the core says to
    hooks (mypy fails on an action of `HookAction` left out)."""
    match a:  # the lock's hand-off first: every hand-off sends a grant and most a drop
        case act.Grant():
            grant = p.LockGrant(_ms(a.time_quantum_s), _us(a.idle_release_s), _us(a.queue_s))
            return a.client_id, grant, a.seq
        case act.Drop():
            return a.client_id, p.LockDrop(), 0
        case act.Registered():
            return a.client_id, p.Registered(a.client_id, wire_limits(a.limits)), a.seq
        case act.LockTerms():
            terms = p.LockTerms(_ms(a.time_quantum_s), _us(a.idle_release_s), _us(a.queue_s))
            return a.client_id, terms, 0
        case act.Lent():
            return a.client_id, p.LockLent() if a.lent else p.LockUnlent(), 0
        case act.GangDrop() | act.GangCut() | act.GangCutOver():
            return a.client_id, _gang_message(a), 0
        case act.LimitsChanged() | act.MemoryGranted() | act.MemoryObserved() | act.PeersChanged():
            return _memory_message(a)
        case act.MemoryReclaim():
            return a.client_id, p.MemReclaim(), 0
    assert_never(a)


def _gang_message(a: act.GangDrop | act.GangCut | act.GangCutOver) -> Message:
    match a:
        case act.GangDrop():
            return pg.GangDrop(a.cut_id)
        case act.GangCut():
            return pg.GangCut(a.cut_id, a.collectives)
        case act.GangCutOver():
            return pg.GangCutOver(a.cut_id)
    assert_never(a)


def _memory_message(
    a: act.LimitsChanged | act.MemoryGranted | act.MemoryObserved | act.PeersChanged,
) -> tuple[int, Message, int]:
    match a:
        case act.LimitsChanged():
            return a.client_id, p.LimitUpdate(wire_limits(a.limits)), 0
        case act.MemoryGranted():
            return a.client_id, p.MemGrant(a.granted, a.reserved), a.seq
        case act.MemoryObserved():
            return a.client_id, p.MemObserved(a.used, a.allowance), 0
        case act.PeersChanged():
            return a.client_id, p.LedgerPeers(a.processes), 0
    assert_never(a)


def result(reply: act.Reply, ref: int) -> p.Result:
    """The OK or ERROR frame answering a control request of type `ref`."""
    return p.Result(_STATUS[reply.outcome], ref, reply.message)
