"""The one table of wire messages: every message type, who sends it, its body class and the C
struct of `ld_hook/nvshare_proto.h` that carries it.

Framing's fixed bodies, the JSON types and the struct formats compared with the C header are
derived from it; `tests/protocol/test_messages.py` parses the header's message enum and fails
when the header and this table disagree (a message missing on either side, another number,
sender or struct, another size), and when the hook's reader (`ld_hook/frames.c`) does not take
every message sent to hooks with its body. Adding a message: a line here, its enum line in the
header, and for one sent to hooks its shape in frames.c.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, slots=True)
class Wire:
    """One message: its type, its sender as the header says it, how its body is read here, and
    the body as the header names it (`struct nvs_...`, EMPTY, JSON or RAW)."""

    type: MsgType
    sender: str
    body: Any  # the body class; None where the body is a JSON document or a part of one
    c_body: str


MESSAGES: tuple[Wire, ...] = (
    Wire(MsgType.REGISTER, HOOK, p.Register, "struct nvs_register"),
    Wire(MsgType.REGISTERED, TO_HOOK, p.Registered, "struct nvs_registered"),
    Wire(MsgType.LOCK_REQUEST, HOOK, p.LockRequest, EMPTY),
    Wire(MsgType.LOCK_GRANT, TO_HOOK, p.LockGrant, "struct nvs_lock_grant"),
    Wire(MsgType.LOCK_DROP, TO_HOOK, p.LockDrop, EMPTY),
    Wire(MsgType.LOCK_RELEASED, HOOK, p.LockReleased, "struct nvs_lock_released"),
    Wire(MsgType.SET_TQ, CTL, p.SetTq, "struct nvs_set_tq"),
    Wire(MsgType.SET_MODE, CTL, p.SetMode, "struct nvs_set_mode"),
    Wire(MsgType.STATUS_REQUEST, CTL, p.StatusRequest, EMPTY),
    Wire(MsgType.STATUS_REPLY, TO_CTL, None, JSON),
    Wire(MsgType.ERROR, EITHER, p.Result, "struct nvs_result"),
    Wire(MsgType.OK, TO_CTL, p.Result, "struct nvs_result"),
    Wire(MsgType.MEM_RESERVE, HOOK, p.MemReserve, "struct nvs_mem_reserve"),
    Wire(MsgType.MEM_GRANT, TO_HOOK, p.MemGrant, "struct nvs_mem_grant"),
    Wire(MsgType.MEM_RETURN, HOOK, p.MemReturn, "struct nvs_mem_return"),
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
    Wire(MsgType.MEM_REFUSALS, HOOK, p.MemRefusals, "struct nvs_mem_refusals"),
    Wire(MsgType.GANG_HINT, HOOK, pg.GangHint, "struct nvs_gang_hint"),
    Wire(MsgType.GANG_DROP, TO_HOOK, pg.GangDrop, "struct nvs_gang_cut"),
    Wire(MsgType.GANG_POSITION, HOOK, pg.GangPosition, "struct nvs_gang_cut"),
    Wire(MsgType.GANG_CUT, TO_HOOK, pg.GangCut, "struct nvs_gang_cut"),
    Wire(MsgType.GANG_CATCHUP, HOOK, pg.GangCatchup, EMPTY),
    Wire(MsgType.GANG_CUT_OVER, TO_HOOK, pg.GangCutOver, "struct nvs_gang_cut"),
    Wire(MsgType.PRIORITY_HINT, HOOK, p.PriorityHint, "struct nvs_priority_hint"),
    Wire(MsgType.LOCK_TERMS, TO_HOOK, p.LockTerms, "struct nvs_lock_grant"),
    Wire(MsgType.LOCK_LENT, TO_HOOK, p.LockLent, EMPTY),
    Wire(MsgType.LOCK_UNLENT, TO_HOOK, p.LockUnlent, EMPTY),
)

BY_TYPE: Mapping[MsgType, Wire] = {m.type: m for m in MESSAGES}

# Bodies of a fixed layout, read by their class (OK and ERROR share `Result`, read apart).
FIXED: Mapping[MsgType, Any] = {
    m.type: m.body for m in MESSAGES if m.body is not None and m.body is not p.Result
}
JSON_TYPES = frozenset(m.type for m in MESSAGES if m.c_body == JSON)
SENT_BY_HOOKS = frozenset(m.body for m in MESSAGES if m.sender == HOOK)

# Every struct of the header with the format that mirrors it: those of the bodies above, and
# the ones they are made of.
BODY_FORMATS: Mapping[str, struct.Struct] = {
    "nvs_header": HEADER,
    "nvs_limits": p.WireLimits.FORMAT,
    "nvs_view_process": pv.ViewProcess.FORMAT,
    **{
        m.c_body.removeprefix("struct "): m.body.FORMAT
        for m in MESSAGES
        if m.c_body.startswith("struct ")
    },
}
