"""The one table of wire messages: every message type, who sends it, its body class and the C
struct of `ld_hook/nvshare_proto.h` that carries it.

Framing's fixed bodies, the JSON types, the struct formats compared with the C header and the
core events a registered hook's messages become (`codec.HOOK_EVENTS`) are derived from it;
`tests/protocol/test_messages.py` parses the header's message enum and fails when the header
and this table disagree (a message missing on either side, another number, sender or struct,
another size), and when the hook's reader (`ld_hook/frames.c`) does not take every message sent
to hooks with its body. Adding a message: a line here, its enum line in the header, and for one
sent to hooks its shape in frames.c. One a hook sends becomes the core event its line names, or
is one the hooks' socket answers itself (REGISTER, HEARTBEAT, VIEW_REQUEST).
"""

from __future__ import annotations

import builtins
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from appliance.core import events as ev
from appliance.wire import protocol as p
from appliance.wire import protocol_gang as pg
from appliance.wire import protocol_view as pv
from appliance.wire.protocol import HEADER, MsgType

HOOK = "hook -> daemon"
TO_HOOK = "daemon -> hook"
CTL = "ctl -> daemon"
TO_CTL = "daemon -> ctl"
EITHER = "either way"

EMPTY = "empty"  # no body
JSON = "JSON"  # a UTF-8 JSON document (nvsharectl only)
RAW = "raw bytes"  # the first bytes of a JSON document (JSON_PART)


# Every message body of a fixed layout, read by its class.
Body = (
    p.Register
    | p.Registered
    | p.LockRequest
    | p.LockGrant
    | p.LockDrop
    | p.LockReleased
    | p.SetTq
    | p.SetMode
    | p.StatusRequest
    | p.Result
    | p.MemReserve
    | p.MemGrant
    | p.MemReturn
    | p.LimitUpdate
    | p.MemReclaim
    | p.LimitSet
    | p.Heartbeat
    | p.HeartbeatAck
    | p.MemObserved
    | p.LedgerPeers
    | pv.ViewRequest
    | pv.View
    | p.MemRefusals
    | pg.GangHint
    | pg.GangDrop
    | pg.GangPosition
    | pg.GangCut
    | pg.GangCatchup
    | pg.GangCutOver
    | p.PriorityHint
    | p.LockTerms
    | p.LockLent
    | p.LockUnlent
)
Message = Body | p.JsonBody  # what is sent in a frame
Decoded = Message | p.JsonPart  # what a frame's body is read as

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class Wire(Generic[M]):
    """One message: its type, its sender as the header says it, how its body is read here, the
    body as the header names it (`struct nvs_...`, EMPTY, JSON or RAW), and for a message of a
    registered hook the core event it becomes (from the message, its client id and the frame's
    seq)."""

    type: MsgType
    sender: str
    body: builtins.type[M] | None  # None where the body is a JSON document or a part of one
    c_body: str
    event: Callable[[M, int, int], ev.Event] | None = None


_RELEASE_REASONS = {reason: ev.ReleaseReason[reason.name] for reason in p.ReleaseReason}


def _lock_requested(msg: p.LockRequest, client: int, seq: int) -> ev.Event:
    return ev.LockRequested(client, seq)


def _caught_up(msg: pg.GangCatchup, client: int, seq: int) -> ev.Event:
    return ev.LockRequested(client, seq, catch_up=True)


def _lock_released(msg: p.LockReleased, client: int, seq: int) -> ev.Event:
    return ev.LockReleased(client, _RELEASE_REASONS[msg.reason])


def _reserve(msg: p.MemReserve, client: int, seq: int) -> ev.Event:
    return ev.MemoryReserveRequested(client, seq, msg.nbytes, msg.used)


def _return(msg: p.MemReturn, client: int, seq: int) -> ev.Event:
    return ev.MemoryReturned(client, msg.nbytes, msg.used)


def _refusals(msg: p.MemRefusals, client: int, seq: int) -> ev.Event:
    return ev.MemoryRefusedByHook(client, msg.count, msg.largest)


def _gang_hint(msg: pg.GangHint, client: int, seq: int) -> ev.Event:
    return ev.GangHint(client, msg.name)


def _gang_position(msg: pg.GangPosition, client: int, seq: int) -> ev.Event:
    return ev.GangPosition(client, msg.cut_id, msg.collectives)


def _priority_hint(msg: p.PriorityHint, client: int, seq: int) -> ev.Event:
    return ev.PriorityHint(client, msg.priority)


def _event(
    msg_type: MsgType, body: builtins.type[M], c_body: str, event: Callable[[M, int, int], ev.Event]
) -> Wire[Any]:
    """A message a registered hook sends, which becomes the core event `event` makes of it
    (a function of its own, so that mypy holds the event's body to the body class)."""
    return Wire(msg_type, HOOK, body, c_body, event)


MESSAGES: tuple[Wire[Any], ...] = (
    Wire(MsgType.REGISTER, HOOK, p.Register, "struct nvs_register"),
    Wire(MsgType.REGISTERED, TO_HOOK, p.Registered, "struct nvs_registered"),
    _event(MsgType.LOCK_REQUEST, p.LockRequest, EMPTY, _lock_requested),
    Wire(MsgType.LOCK_GRANT, TO_HOOK, p.LockGrant, "struct nvs_lock_grant"),
    Wire(MsgType.LOCK_DROP, TO_HOOK, p.LockDrop, EMPTY),
    _event(MsgType.LOCK_RELEASED, p.LockReleased, "struct nvs_lock_released", _lock_released),
    Wire(MsgType.SET_TQ, CTL, p.SetTq, "struct nvs_set_tq"),
    Wire(MsgType.SET_MODE, CTL, p.SetMode, "struct nvs_set_mode"),
    Wire(MsgType.STATUS_REQUEST, CTL, p.StatusRequest, EMPTY),
    Wire(MsgType.STATUS_REPLY, TO_CTL, None, JSON),
    Wire(MsgType.ERROR, EITHER, p.Result, "struct nvs_result"),
    Wire(MsgType.OK, TO_CTL, p.Result, "struct nvs_result"),
    _event(MsgType.MEM_RESERVE, p.MemReserve, "struct nvs_mem_reserve", _reserve),
    Wire(MsgType.MEM_GRANT, TO_HOOK, p.MemGrant, "struct nvs_mem_grant"),
    _event(MsgType.MEM_RETURN, p.MemReturn, "struct nvs_mem_return", _return),
    Wire(MsgType.LIMIT_UPDATE, TO_HOOK, p.LimitUpdate, "struct nvs_limits"),
    Wire(MsgType.MEM_RECLAIM, TO_HOOK, p.MemReclaim, EMPTY),
    Wire(MsgType.LIMIT_SET, CTL, p.LimitSet, "struct nvs_limit_set"),
    Wire(MsgType.QUERY, CTL, None, JSON),
    Wire(MsgType.QUERY_REPLY, TO_CTL, None, JSON),
    Wire(MsgType.JSON_PART, TO_CTL, None, RAW),
    Wire(MsgType.HEARTBEAT, HOOK, p.Heartbeat, EMPTY),
    Wire(MsgType.HEARTBEAT_ACK, TO_HOOK, p.HeartbeatAck, EMPTY),
    Wire(MsgType.MEM_OBSERVED, TO_HOOK, p.MemObserved, "struct nvs_mem_observed"),
    Wire(MsgType.LEDGER_PEERS, TO_HOOK, p.LedgerPeers, "struct nvs_ledger_peers"),
    Wire(MsgType.VIEW_REQUEST, HOOK, pv.ViewRequest, "struct nvs_view_request"),
    Wire(MsgType.VIEW, TO_HOOK, pv.View, "struct nvs_view"),
    _event(MsgType.MEM_REFUSALS, p.MemRefusals, "struct nvs_mem_refusals", _refusals),
    _event(MsgType.GANG_HINT, pg.GangHint, "struct nvs_gang_hint", _gang_hint),
    Wire(MsgType.GANG_DROP, TO_HOOK, pg.GangDrop, "struct nvs_gang_cut"),
    _event(MsgType.GANG_POSITION, pg.GangPosition, "struct nvs_gang_cut", _gang_position),
    Wire(MsgType.GANG_CUT, TO_HOOK, pg.GangCut, "struct nvs_gang_cut"),
    _event(MsgType.GANG_CATCHUP, pg.GangCatchup, EMPTY, _caught_up),
    Wire(MsgType.GANG_CUT_OVER, TO_HOOK, pg.GangCutOver, "struct nvs_gang_cut"),
    _event(MsgType.PRIORITY_HINT, p.PriorityHint, "struct nvs_priority_hint", _priority_hint),
    Wire(MsgType.LOCK_TERMS, TO_HOOK, p.LockTerms, "struct nvs_lock_grant"),
    Wire(MsgType.LOCK_LENT, TO_HOOK, p.LockLent, EMPTY),
    Wire(MsgType.LOCK_UNLENT, TO_HOOK, p.LockUnlent, EMPTY),
)

BY_TYPE: Mapping[MsgType, Wire[Any]] = {m.type: m for m in MESSAGES}

# Bodies of a fixed layout, read by their class (OK and ERROR share `Result`, read apart).
FIXED: Mapping[MsgType, type[Body]] = {
    m.type: m.body for m in MESSAGES if m.body is not None and m.body is not p.Result
}
JSON_TYPES = frozenset(m.type for m in MESSAGES if m.c_body == JSON)
SENT_BY_HOOKS = frozenset(m.body for m in MESSAGES if m.sender == HOOK)
# A registered hook's message, its client id and the frame's seq -> the core's event.
HOOK_EVENTS: Mapping[type[Body], Callable[[Any, int, int], ev.Event]] = {
    m.body: m.event for m in MESSAGES if m.body is not None and m.event is not None
}

# Every struct of the header with the format that mirrors it: those of the bodies above, and
# the ones they are made of.
BODY_FORMATS: Mapping[str, struct.Struct] = {
    "nvs_header": HEADER,
    "nvs_limits": p.WireLimits.FORMAT,
    "nvs_view_process": pv.ViewProcess.FORMAT,
    **{
        m.c_body.removeprefix("struct "): m.body.FORMAT
        for m in MESSAGES
        if m.body is not None and m.c_body.startswith("struct ")
    },
}
