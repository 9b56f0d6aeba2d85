"""Python mirror of `ld_hook/nvshare_proto.h`, the one definition of the wire format.

Frames are a 24-byte header followed by a fixed little-endian body (JSON for the CLI-only
types). `tests/protocol` compiles a C probe that prints every size and offset of the header's
structs and checks them against the formats here, so the two sides cannot drift apart.

Sans-I/O: `FrameDecoder` turns bytes into frames and `encode` turns messages into bytes;
sockets live in `appliance.server` and `appliance.client`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from appliance.policy.model import Backing, Mode

MAGIC = 0x4853564E
VERSION = 1
MAX_BODY = 1 << 20
MAX_DOCUMENT = 64 << 20  # a JSON reply split over JSON_PART frames (status of 10,000 clients: 4 MB)
UUID_LEN = 48
NAME_LEN = 64
MESSAGE_LEN = 248

HEADER = struct.Struct("<IHHIIQ")

# Where the daemon listens and every client (hooks, nvsharectl, the device plugin's mounts)
# looks. Containers mount the directory, never the socket file.
SOCKET_NAME = "scheduler.sock"
DEFAULT_SOCKET_DIR = Path("/var/run/nvshare")


def socket_dir_from_env(environ: Mapping[str, str] | None = None) -> Path:
    """`NVSHARE_SOCKET_DIR`, else the default: the same rule as the hook's."""
    env = os.environ if environ is None else environ
    return Path(env.get("NVSHARE_SOCKET_DIR") or DEFAULT_SOCKET_DIR)


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
    QUERY = 30
    QUERY_REPLY = 31
    JSON_PART = 40
    HEARTBEAT = 50
    HEARTBEAT_ACK = 51
    MEM_OBSERVED = 52
    LEDGER_PEERS = 53


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


class ProtocolError(Exception):
    """A frame that cannot be accepted; `status` says how to answer it."""

    def __init__(self, status: Status, message: str, *, ref_type: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.ref_type = ref_type


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _fixed(text: str, size: int) -> bytes:
    data = text.encode("utf-8")[: size - 1]
    return data


# ---------------------------------------------------------------- bodies


@dataclass(frozen=True, slots=True)
class Register:
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQQ{UUID_LEN}s{NAME_LEN}s{NAME_LEN}s")
    pid: int
    gpu_uuid: str
    gpu_total_mem: int
    env_mem_limit: int = 0
    env_core_limit: int = 0
    pod_namespace: str = ""
    pod_name: str = ""

    def pack(self) -> bytes:
        return self.FORMAT.pack(
            self.pid,
            self.env_core_limit,
            self.gpu_total_mem,
            self.env_mem_limit,
            _fixed(self.gpu_uuid, UUID_LEN),
            _fixed(self.pod_namespace, NAME_LEN),
            _fixed(self.pod_name, NAME_LEN),
        )

    @classmethod
    def unpack(cls, body: bytes) -> Register:
        pid, core, total, mem, uuid, ns, name = cls.FORMAT.unpack(body)
        return cls(
            pid=pid,
            gpu_uuid=_cstr(uuid),
            gpu_total_mem=total,
            env_mem_limit=mem,
            env_core_limit=core,
            pod_namespace=_cstr(ns),
            pod_name=_cstr(name),
        )


@dataclass(frozen=True, slots=True)
class WireLimits:
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QIIII")
    mem_limit: int  # bytes, 0 = none
    core_limit: int
    mode: WireMode
    backing: WireBacking = WireBacking.DEVICE
    flags: int = 0

    def pack(self) -> bytes:
        return self.FORMAT.pack(
            self.mem_limit, self.core_limit, self.mode, self.backing, self.flags
        )

    @classmethod
    def unpack(cls, body: bytes) -> WireLimits:
        mem, core, mode, backing, flags = cls.FORMAT.unpack(body)
        return cls(mem, core, WireMode(mode), WireBacking(backing), flags)


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


def _empty(name: str, msg_type: MsgType) -> Any:
    @dataclass(frozen=True, slots=True)
    class Empty:
        TYPE: ClassVar[MsgType] = msg_type
        FORMAT: ClassVar[struct.Struct] = struct.Struct("<")

        def pack(self) -> bytes:
            return b""

        @classmethod
        def unpack(cls, body: bytes) -> Any:
            if body:
                raise struct.error(f"{name} carries no body")
            return cls()

    Empty.__name__ = Empty.__qualname__ = name
    return Empty


LockRequest = _empty("LockRequest", MsgType.LOCK_REQUEST)
LockDrop = _empty("LockDrop", MsgType.LOCK_DROP)
StatusRequest = _empty("StatusRequest", MsgType.STATUS_REQUEST)
Heartbeat = _empty("Heartbeat", MsgType.HEARTBEAT)
HeartbeatAck = _empty("HeartbeatAck", MsgType.HEARTBEAT_ACK)


@dataclass(frozen=True, slots=True)
class LockGrant:
    TYPE: ClassVar[MsgType] = MsgType.LOCK_GRANT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    tq_ms: int
    idle_release_ms: int = 0  # policy scheduler.idleRelease; 0 = the hook's default

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.tq_ms, self.idle_release_ms)

    @classmethod
    def unpack(cls, body: bytes) -> LockGrant:
        return cls(*cls.FORMAT.unpack(body))


@dataclass(frozen=True, slots=True)
class LockReleased:
    TYPE: ClassVar[MsgType] = MsgType.LOCK_RELEASED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    reason: ReleaseReason

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.reason, 0)

    @classmethod
    def unpack(cls, body: bytes) -> LockReleased:
        return cls(ReleaseReason(cls.FORMAT.unpack(body)[0]))


class _Plain:
    """A body whose dataclass fields are FORMAT's items, in order, with no padding fields."""

    FORMAT: ClassVar[struct.Struct]

    def pack(self) -> bytes:
        values = (getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return self.FORMAT.pack(*values)

    @classmethod
    def unpack(cls, body: bytes) -> Any:
        return cls(*cls.FORMAT.unpack(body))


@dataclass(frozen=True, slots=True)
class SetTq(_Plain):
    TYPE: ClassVar[MsgType] = MsgType.SET_TQ
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    seconds: int
    flags: int = 0  # SET_FOLLOW_POLICY


@dataclass(frozen=True, slots=True)
class SetMode:
    TYPE: ClassVar[MsgType] = MsgType.SET_MODE
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<II{UUID_LEN}s")
    mode: WireMode
    gpu_uuid: str = ""
    flags: int = 0  # SET_FOLLOW_POLICY (mode is then ignored)

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.mode, self.flags, _fixed(self.gpu_uuid, UUID_LEN))

    @classmethod
    def unpack(cls, body: bytes) -> SetMode:
        mode, flags, uuid = cls.FORMAT.unpack(body)
        return cls(WireMode(mode), _cstr(uuid), flags)


@dataclass(frozen=True, slots=True)
class Result:
    """OK (status 0) or ERROR frames."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<iI{MESSAGE_LEN}s")
    status: Status
    ref_type: int
    message: str

    @property
    def TYPE(self) -> MsgType:  # noqa: N802 - mirrors the class attribute of other bodies
        return MsgType.OK if self.status == Status.OK else MsgType.ERROR

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.status, self.ref_type, _fixed(self.message, MESSAGE_LEN))

    @classmethod
    def unpack(cls, body: bytes) -> Result:
        status, ref, msg = cls.FORMAT.unpack(body)
        try:
            st = Status(status)
        except ValueError:
            st = Status.INVALID
        return cls(st, ref, _cstr(msg))


@dataclass(frozen=True, slots=True)
class MemReserve(_Plain):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RESERVE
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # more reservation wanted
    used: int  # bytes allocated now (usage report)


@dataclass(frozen=True, slots=True)
class MemGrant(_Plain):
    TYPE: ClassVar[MsgType] = MsgType.MEM_GRANT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    granted: int  # 0 = refused
    reserved: int  # the client's whole reservation now


@dataclass(frozen=True, slots=True)
class MemReturn(_Plain):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RETURN
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # reservation given back
    used: int


@dataclass(frozen=True, slots=True)
class MemObserved(_Plain):
    """What NVML shows the client's process holding; the hook counts what its ledger misses."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_OBSERVED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nvml_used: int  # bytes, per-process usage from NVML
    allowance: int  # bytes of it left uncounted (the CUDA context)


@dataclass(frozen=True, slots=True)
class LedgerPeers:
    """How many processes share the receiver's memory ledger (pod, GPU), itself included."""

    TYPE: ClassVar[MsgType] = MsgType.LEDGER_PEERS
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    clients: int

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.clients, 0)

    @classmethod
    def unpack(cls, body: bytes) -> LedgerPeers:
        return cls(cls.FORMAT.unpack(body)[0])


@dataclass(frozen=True, slots=True)
class LimitSet:
    TYPE: ClassVar[MsgType] = MsgType.LIMIT_SET
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQII{NAME_LEN}s{NAME_LEN}s")
    pid: int = 0
    flags: int = 0
    mem_limit: int = 0
    core_limit: int = 0
    pod_namespace: str = ""
    pod_name: str = ""

    def pack(self) -> bytes:
        return self.FORMAT.pack(
            self.pid,
            self.flags,
            self.mem_limit,
            self.core_limit,
            0,
            _fixed(self.pod_namespace, NAME_LEN),
            _fixed(self.pod_name, NAME_LEN),
        )

    @classmethod
    def unpack(cls, body: bytes) -> LimitSet:
        pid, flags, mem, core, _, ns, name = cls.FORMAT.unpack(body)
        return cls(pid, flags, mem, core, _cstr(ns), _cstr(name))


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


Message = Any  # one of the body classes above

_FIXED: dict[MsgType, Any] = {
    cls.TYPE: cls
    for cls in (
        Register,
        Registered,
        LockRequest,
        LockGrant,
        LockDrop,
        LockReleased,
        SetTq,
        SetMode,
        StatusRequest,
        MemReserve,
        MemGrant,
        MemReturn,
        LimitUpdate,
        LimitSet,
        Heartbeat,
        HeartbeatAck,
        MemObserved,
        LedgerPeers,
    )
}
_JSON_TYPES = {MsgType.STATUS_REPLY, MsgType.QUERY, MsgType.QUERY_REPLY}
# Every body struct, for the C probe comparison.
BODY_FORMATS: dict[str, struct.Struct] = {
    "nvs_header": HEADER,
    "nvs_register": Register.FORMAT,
    "nvs_limits": WireLimits.FORMAT,
    "nvs_registered": Registered.FORMAT,
    "nvs_lock_grant": LockGrant.FORMAT,
    "nvs_lock_released": LockReleased.FORMAT,
    "nvs_set_tq": SetTq.FORMAT,
    "nvs_set_mode": SetMode.FORMAT,
    "nvs_result": Result.FORMAT,
    "nvs_mem_reserve": MemReserve.FORMAT,
    "nvs_mem_grant": MemGrant.FORMAT,
    "nvs_mem_return": MemReturn.FORMAT,
    "nvs_limit_set": LimitSet.FORMAT,
    "nvs_mem_observed": MemObserved.FORMAT,
    "nvs_ledger_peers": LedgerPeers.FORMAT,
}


@dataclass(frozen=True, slots=True)
class Frame:
    msg_type: int
    seq: int
    body: bytes


def encode(message: Message, *, seq: int = 0) -> bytes:
    """The frame of a message; a JSON document over MAX_BODY becomes JSON_PART frames and a
    last frame of its own type."""
    body: bytes = message.pack()
    if len(body) <= MAX_BODY:
        return HEADER.pack(MAGIC, VERSION, int(message.TYPE), 0, len(body), seq) + body
    if not isinstance(message, JsonBody) or len(body) > MAX_DOCUMENT:
        raise ValueError(f"a {message.TYPE.name} body of {len(body)} bytes cannot be sent")
    frames = []
    for start in range(0, len(body), MAX_BODY):
        chunk = body[start : start + MAX_BODY]
        last = start + MAX_BODY >= len(body)
        kind = int(message.TYPE) if last else int(MsgType.JSON_PART)
        frames.append(HEADER.pack(MAGIC, VERSION, kind, 0, len(chunk), seq) + chunk)
    return b"".join(frames)


def decode_body(frame: Frame) -> Message:
    """Parse a frame's body; raises ProtocolError saying what is wrong with it."""
    try:
        msg_type = MsgType(frame.msg_type)
    except ValueError:
        raise ProtocolError(
            Status.UNKNOWN_TYPE, f"unknown message type {frame.msg_type}", ref_type=frame.msg_type
        ) from None
    try:
        if msg_type in (MsgType.OK, MsgType.ERROR):
            return Result.unpack(frame.body)
        if msg_type in _JSON_TYPES:
            return JsonBody(msg_type, json.loads(frame.body.decode("utf-8")))
        if msg_type is MsgType.JSON_PART:
            return JsonPart(frame.body)
        return _FIXED[msg_type].unpack(frame.body)
    except RecursionError:
        raise ProtocolError(
            Status.BAD_BODY,
            f"{msg_type.name} body is nested too deeply",
            ref_type=frame.msg_type,
        ) from None
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(
            Status.BAD_BODY,
            f"{msg_type.name} body of {len(frame.body)} bytes is malformed: {exc}",
            ref_type=frame.msg_type,
        ) from None


class FrameDecoder:
    """Incremental decoder: feed bytes, take complete frames.

    A bad magic or an oversized body makes the stream unusable (`ProtocolError` with
    `fatal=True` semantics: the caller closes the connection); a wrong version is reported per
    frame so the peer can be told which version we speak.

    With `max_document` (the CLI's side) JSON_PART frames are joined to the frame that ends
    their document, up to that many bytes; without it (the daemon's side) they are frames like
    any other, which the daemon does not accept.
    """

    def __init__(self, *, max_document: int = 0) -> None:
        self._buf = bytearray()
        self._max_document = max_document
        self._parts: dict[int, bytearray] = {}

    def feed(self, data: bytes) -> list[Frame | ProtocolError]:
        self._buf += data
        out: list[Frame | ProtocolError] = []
        while len(self._buf) >= HEADER.size:
            magic, version, msg_type, _flags, length, seq = HEADER.unpack_from(self._buf)
            if magic != MAGIC:
                raise ProtocolError(
                    Status.BAD_BODY, f"bad magic 0x{magic:08x}: not an nvshare peer"
                )
            if length > MAX_BODY:
                raise ProtocolError(Status.BAD_BODY, f"frame body of {length} bytes is too large")
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            if version != VERSION:
                out.append(
                    ProtocolError(
                        Status.BAD_VERSION,
                        f"protocol version {version} is not supported (we speak {VERSION})",
                        ref_type=msg_type,
                    )
                )
                continue
            if self._max_document and msg_type == MsgType.JSON_PART:
                part = self._parts.setdefault(seq, bytearray())
                part += body
                if len(part) > self._max_document:
                    raise ProtocolError(
                        Status.BAD_BODY, f"a document of more than {self._max_document} bytes"
                    )
                continue
            if seq in self._parts:
                body = bytes(self._parts.pop(seq)) + body
            out.append(Frame(msg_type, seq, body))
        return out
