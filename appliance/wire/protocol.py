"""Python mirror of `ld_hook/nvshare_proto.h`, the one definition of the wire format.

Frames are a 24-byte header followed by a fixed little-endian body (JSON for the CLI-only
types). `tests/protocol` compiles a C probe that prints every size and offset of the header's
structs and checks them against the formats here, so the two sides cannot drift apart.

What travels on a stream of frames (encoding, decoding, JSON documents split over frames) is
in `appliance.wire.framing`, every message's registration in `appliance.wire.messages`; sockets
live in `appliance.serve.server` and `appliance.cli.client`, and where they are in
`appliance.wire.socket_dirs`.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from appliance.policy.model import Backing, Mode
from appliance.wire.layout import Empty, Fixed

MAGIC = 0x4853564E
VERSION = 4  # 4: a borrower's queue bound; 3: idle windows in us; 2: pod names of 253 chars
UUID_LEN = 48
NAME_LEN = 64  # a namespace: a DNS-1123 label, at most 63
POD_NAME_LEN = 256  # a pod name: a DNS-1123 subdomain, at most 253
MESSAGE_LEN = 248

HEADER = struct.Struct("<IHHIIQ")


class MsgType(enum.IntEnum):
    REGISTER = 1
    REGISTERED = 2
    LOCK_REQUEST = 3
    LOCK_GRANT = 4
    LOCK_DROP = 5
    LOCK_RELEASED = 6
    SET_TQ = 7
    SET_MODE = 8
    STATUS_REQUEST = 9
    STATUS_REPLY = 10
    ERROR = 11
    OK = 12
    MEM_RESERVE = 20
    MEM_GRANT = 21
    MEM_RETURN = 22
    LIMIT_UPDATE = 23
    LIMIT_SET = 24
    MEM_RECLAIM = 25
    QUERY = 30
    QUERY_REPLY = 31
    JSON_PART = 40
    HEARTBEAT = 50
    HEARTBEAT_ACK = 51
    MEM_OBSERVED = 52
    LEDGER_PEERS = 53
    VIEW_REQUEST = 54
    VIEW = 55
    MEM_REFUSALS = 60
    LOCK_TERMS = 80
    LOCK_LENT = 81
    LOCK_UNLENT = 82
    GANG_HINT = 70
    GANG_DROP = 71
    GANG_POSITION = 72
    GANG_CUT = 73
    GANG_CATCHUP = 74
    GANG_CUT_OVER = 75
    PRIORITY_HINT = 76


class WireMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


_WIRE_MODES = {Mode.OFF: WireMode.OFF, Mode.ON: WireMode.ON, Mode.AUTO: WireMode.AUTO}
_MODES = {wire: mode for mode, wire in _WIRE_MODES.items()}


def wire_mode(mode: Mode) -> WireMode:
    """The one mapping from a scheduling mode to its number on the wire (and in metrics)."""
    return _WIRE_MODES[mode]


def mode_of(wire: WireMode) -> Mode:
    return _MODES[wire]


class WireBacking(enum.IntEnum):
    DEVICE = 0
    MANAGED = 1


def wire_backing(backing: Backing) -> WireBacking:
    return WireBacking.MANAGED if backing is Backing.MANAGED else WireBacking.DEVICE


class ReleaseReason(enum.IntEnum):
    DROPPED = 0
    IDLE = 1
    EXIT = 2
    UNDRAINED = 3  # a stream capture outlived the quantum: handed over without synchronising


class Status(enum.IntEnum):
    OK = 0
    BAD_VERSION = 1
    UNKNOWN_TYPE = 2
    BAD_BODY = 3
    PERMISSION = 4
    INVALID = 5
    NOT_FOUND = 6
    NOT_REGISTERED = 7


LIMIT_SINGLE_OVERSUB = 0x1
LIMIT_SET_CLEAR_MEM = 0x1
LIMIT_SET_CLEAR_CORE = 0x2
LIMIT_SET_HAS_MEM = 0x4
LIMIT_SET_HAS_CORE = 0x8
SET_FOLLOW_POLICY = 0x1  # SetTq/SetMode flags: drop nvsharectl's value, follow the policy again


# ---------------------------------------------------------------- bodies


@dataclass(frozen=True, slots=True)
class Register(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQQ{UUID_LEN}s{NAME_LEN}s{POD_NAME_LEN}s")
    LAYOUT: ClassVar[tuple[str, ...]] = (
        "pid",
        "env_core_limit",
        "gpu_total_mem",
        "env_mem_limit",
        "gpu_uuid",
        "pod_namespace",
        "pod_name",
    )
    pid: int
    gpu_uuid: str
    gpu_total_mem: int
    env_mem_limit: int = 0
    env_core_limit: int = 0
    pod_namespace: str = ""
    pod_name: str = ""


@dataclass(frozen=True, slots=True)
class PriorityHint(Fixed):
    """NVSHARE_GPU_PRIORITY as a number, sent right after REGISTER; it can only lower."""

    TYPE: ClassVar[MsgType] = MsgType.PRIORITY_HINT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<iI")
    LAYOUT: ClassVar[tuple[str, ...]] = ("priority", "")
    priority: int


@dataclass(frozen=True, slots=True)
class WireLimits(Fixed):
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QIIII")
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {
        "mode": WireMode,
        "backing": WireBacking,
    }
    mem_limit: int  # bytes, 0 = none
    core_limit: int
    mode: WireMode
    backing: WireBacking = WireBacking.DEVICE
    flags: int = 0


@dataclass(frozen=True, slots=True)
class Registered:
    TYPE: ClassVar[MsgType] = MsgType.REGISTERED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<Q" + WireLimits.FORMAT.format[1:])
    client_id: int
    limits: WireLimits

    def pack(self) -> bytes:
        return struct.pack("<Q", self.client_id) + self.limits.pack()

    @classmethod
    def unpack(cls, body: bytes) -> Registered:
        cls.FORMAT.unpack(body)  # length check
        (cid,) = struct.unpack_from("<Q", body)
        return cls(cid, WireLimits.unpack(body[8:]))


@dataclass(frozen=True, slots=True)
class LimitUpdate:
    TYPE: ClassVar[MsgType] = MsgType.LIMIT_UPDATE
    FORMAT: ClassVar[struct.Struct] = WireLimits.FORMAT
    limits: WireLimits

    def pack(self) -> bytes:
        return self.limits.pack()

    @classmethod
    def unpack(cls, body: bytes) -> LimitUpdate:
        return cls(WireLimits.unpack(body))


@dataclass(frozen=True, slots=True)
class LockRequest(Empty):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_REQUEST


@dataclass(frozen=True, slots=True)
class MemReclaim(Empty):
    """A peer was refused for want of room: give back what is reserved and unused."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_RECLAIM


@dataclass(frozen=True, slots=True)
class LockDrop(Empty):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_DROP


@dataclass(frozen=True, slots=True)
class LockLent(Empty):
    """Lent idle: take the lock back without waiting."""

    TYPE: ClassVar[MsgType] = MsgType.LOCK_LENT


@dataclass(frozen=True, slots=True)
class LockUnlent(Empty):
    """Lent no longer: ask and wait again."""

    TYPE: ClassVar[MsgType] = MsgType.LOCK_UNLENT


@dataclass(frozen=True, slots=True)
class StatusRequest(Empty):
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REQUEST


@dataclass(frozen=True, slots=True)
class Heartbeat(Empty):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT


@dataclass(frozen=True, slots=True)
class HeartbeatAck(Empty):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT_ACK


@dataclass(frozen=True, slots=True)
class GrantBody(Fixed):
    """The terms of a grant (LOCK_GRANT, LOCK_TERMS). Each message is its own subclass, neither
    a subclass of the other, so telling one from the other by class never confuses them."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQQ")
    tq_ms: int  # the hook bounds how long a stream capture may outlive a drop by it
    idle_release_us: int = 0  # the idle window (idleRelease, idleHandoff); 0 = the hook's default
    queue_us: int = 0  # the most work to keep queued (borrowerQueue, ld_hook/pace.h); 0 = no bound


class LockGrant(GrantBody):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_GRANT


class LockTerms(GrantBody):
    """New terms for the grant held (the idle window while others wait); a hook not holding
    ignores it."""

    TYPE: ClassVar[MsgType] = MsgType.LOCK_TERMS


@dataclass(frozen=True, slots=True)
class LockReleased(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_RELEASED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    LAYOUT: ClassVar[tuple[str, ...]] = ("reason", "")
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"reason": ReleaseReason}
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class SetTq(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.SET_TQ
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    seconds: int
    flags: int = 0  # SET_FOLLOW_POLICY


@dataclass(frozen=True, slots=True)
class SetMode(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.SET_MODE
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<II{UUID_LEN}s")
    LAYOUT: ClassVar[tuple[str, ...]] = ("mode", "flags", "gpu_uuid")
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"mode": WireMode}
    mode: WireMode
    gpu_uuid: str = ""
    flags: int = 0  # SET_FOLLOW_POLICY (mode is then ignored)


def _status(value: int) -> Status:
    """A status we do not know reads as INVALID: still an error, never a crash."""
    try:
        return Status(value)
    except ValueError:
        return Status.INVALID


@dataclass(frozen=True, slots=True)
class Result(Fixed):
    """OK (status 0) or ERROR frames."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<iI{MESSAGE_LEN}s")
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"status": _status}
    status: Status
    ref_type: int
    message: str

    @property
    def TYPE(self) -> MsgType:  # noqa: N802 - mirrors the class attribute of other bodies
        return MsgType.OK if self.status == Status.OK else MsgType.ERROR


@dataclass(frozen=True, slots=True)
class MemReserve(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RESERVE
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # more reservation wanted
    used: int  # bytes allocated now (usage report)


@dataclass(frozen=True, slots=True)
class MemGrant(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_GRANT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    granted: int  # 0 = refused
    reserved: int  # the client's whole reservation now


@dataclass(frozen=True, slots=True)
class MemReturn(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RETURN
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # reservation given back
    used: int


@dataclass(frozen=True, slots=True)
class MemObserved(Fixed):
    """What NVML shows the client's process holding; the hook counts what its ledger misses."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_OBSERVED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nvml_used: int  # bytes, per-process usage from NVML
    allowance: int  # bytes of it left uncounted (the CUDA context)


@dataclass(frozen=True, slots=True)
class LedgerPeers(Fixed):
    """How many processes share the receiver's memory ledger (pod, GPU), itself included."""

    TYPE: ClassVar[MsgType] = MsgType.LEDGER_PEERS
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    LAYOUT: ClassVar[tuple[str, ...]] = ("clients", "")
    clients: int


@dataclass(frozen=True, slots=True)
class MemRefusals(Fixed):
    """Allocations the hook refused on its own (over the limit it knows) since its last report;
    the daemon's own refusals are not in it."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_REFUSALS
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IIQ")
    LAYOUT: ClassVar[tuple[str, ...]] = ("count", "", "largest")
    count: int
    largest: int = 0  # bytes: the largest refused request


@dataclass(frozen=True, slots=True)
class LimitSet(Fixed):
    TYPE: ClassVar[MsgType] = MsgType.LIMIT_SET
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQII{NAME_LEN}s{POD_NAME_LEN}s")
    LAYOUT: ClassVar[tuple[str, ...]] = (
        "pid",
        "flags",
        "mem_limit",
        "core_limit",
        "",
        "pod_namespace",
        "pod_name",
    )
    pid: int = 0
    flags: int = 0
    mem_limit: int = 0
    core_limit: int = 0
    pod_namespace: str = ""
    pod_name: str = ""


@dataclass(frozen=True, slots=True)
class JsonPart:
    """A JSON_PART frame: the first bytes of a document too big for one frame. The parts and
    the frame of the document's own type that ends it share one sequence number."""

    data: bytes


@dataclass(frozen=True, slots=True)
class JsonBody:
    """STATUS_REPLY, QUERY and QUERY_REPLY: a UTF-8 JSON document (CLI only)."""

    msg_type: MsgType
    doc: Any

    @property
    def TYPE(self) -> MsgType:  # noqa: N802
        return self.msg_type

    def pack(self) -> bytes:
        return json.dumps(self.doc, sort_keys=True).encode("utf-8")
