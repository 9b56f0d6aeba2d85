"""The gang messages of the wire format (`ld_hook/nvshare_proto.h`, GANG_*): how the clients of
one job on several GPUs are named and stopped together (`appliance.core.gang`).

Kept beside `appliance.wire.protocol`, whose types and packing they use; `tests/protocol` checks
their layout against the C header like every other body.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from appliance.wire.layout import Empty, Fixed
from appliance.wire.protocol import MsgType

GANG_LEN = 128


@dataclass(frozen=True, slots=True)
class GangCatchup(Empty):
    TYPE: ClassVar[MsgType] = MsgType.GANG_CATCHUP


@dataclass(frozen=True, slots=True)
class GangHint(Fixed):
    """The job a process names outside pods (NVSHARE_GANG, torch.distributed's rendezvous)."""

    TYPE: ClassVar[MsgType] = MsgType.GANG_HINT
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<{GANG_LEN}s")
    name: str


@dataclass(frozen=True, slots=True)
class GangCutBody(Fixed):
    """One gang drop (GANG_DROP, GANG_POSITION, GANG_CUT, GANG_CUT_OVER): its number, and the
    collectives a member has begun (POSITION) or must submit before it releases (CUT)."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    cut_id: int
    collectives: int = 0


class GangDrop(GangCutBody):
    TYPE: ClassVar[MsgType] = MsgType.GANG_DROP


class GangPosition(GangCutBody):
    TYPE: ClassVar[MsgType] = MsgType.GANG_POSITION


class GangCut(GangCutBody):
    TYPE: ClassVar[MsgType] = MsgType.GANG_CUT


class GangCutOver(GangCutBody):
    TYPE: ClassVar[MsgType] = MsgType.GANG_CUT_OVER
