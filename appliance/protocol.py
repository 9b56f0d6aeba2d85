"""Python mirror of `ld_hook/nvshare_proto.h`, the one definition of the wire format.

Frames are a 24-byte header followed by a fixed little-endian body (JSON for the CLI-only
types). `tests/protocol` compiles a C probe that prints every size and offset of the header's
structs and checks them against the formats here, so the two sides cannot drift apart.

What travels on a stream of frames (encoding, decoding, JSON documents split over frames) is
in `appliance.framing`; sockets live in `appliance.server` and `appliance.client`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from appliance.policy.model import Backing, Mode

MAGIC = 0x4853564E
VERSION = 1
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
    LOCK_TERMS = 80
    MEM_REFUSALS = 60


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


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _string_sizes(fmt: struct.Struct) -> list[int]:
    """Per item of a format: the size of a fixed string (`48s`), 0 for a number."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt.format.lstrip("<"))
    return [int(count or 1) if code == "s" else 0 for count, code in items]


class _Fixed:
    """A fixed-layout body: FORMAT's items are LAYOUT's fields in order (the dataclass's fields
    when LAYOUT is empty; "" marks a reserved field sent as 0). Strings travel NUL-padded and cut
    to fit; DECODE turns numbers read back into their enums."""

    FORMAT: ClassVar[struct.Struct]
    LAYOUT: ClassVar[tuple[str, ...]] = ()
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    def _layout(cls) -> tuple[str, ...]:
        return cls.LAYOUT or tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def pack(self) -> bytes:
        values: list[Any] = []
        for name, size in zip(self._layout(), _string_sizes(self.FORMAT), strict=True):
            value: Any = getattr(self, name) if name else 0
            values.append(value.encode("utf-8")[: size - 1] if size else value)
        return self.FORMAT.pack(*values)

    @classmethod
    def unpack(cls, body: bytes) -> Any:
        fields = {}
        for name, value in zip(cls._layout(), cls.FORMAT.unpack(body), strict=True):
            if name:
                raw = _cstr(value) if isinstance(value, bytes) else value
                fields[name] = cls.DECODE[name](raw) if name in cls.DECODE else raw
        return cls(**fields)


# ---------------------------------------------------------------- bodies


@dataclass(frozen=True, slots=True)
class Register(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQQ{UUID_LEN}s{NAME_LEN}s{NAME_LEN}s")
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
class WireLimits(_Fixed):
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
class LockGrant(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_GRANT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    tq_ms: int  # the hook bounds how long a stream capture may outlive a drop by it
    idle_release_ms: int = 0  # policy scheduler.idleRelease; 0 = the hook's default


@dataclass(frozen=True, slots=True)
class LockTerms(LockGrant):  # new terms for the grant held; a hook not holding ignores them
    TYPE: ClassVar[MsgType] = MsgType.LOCK_TERMS


@dataclass(frozen=True, slots=True)
class LockReleased(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.LOCK_RELEASED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    LAYOUT: ClassVar[tuple[str, ...]] = ("reason", "")
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {"reason": ReleaseReason}
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class SetTq(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.SET_TQ
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    seconds: int
    flags: int = 0  # SET_FOLLOW_POLICY


@dataclass(frozen=True, slots=True)
class SetMode(_Fixed):
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
class Result(_Fixed):
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
class MemReserve(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RESERVE
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # more reservation wanted
    used: int  # bytes allocated now (usage report)


@dataclass(frozen=True, slots=True)
class MemGrant(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_GRANT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    granted: int  # 0 = refused
    reserved: int  # the client's whole reservation now


@dataclass(frozen=True, slots=True)
class MemReturn(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.MEM_RETURN
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nbytes: int  # reservation given back
    used: int


@dataclass(frozen=True, slots=True)
class MemObserved(_Fixed):
    """What NVML shows the client's process holding; the hook counts what its ledger misses."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_OBSERVED
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQ")
    nvml_used: int  # bytes, per-process usage from NVML
    allowance: int  # bytes of it left uncounted (the CUDA context)


@dataclass(frozen=True, slots=True)
class LedgerPeers(_Fixed):
    """How many processes share the receiver's memory ledger (pod, GPU), itself included."""

    TYPE: ClassVar[MsgType] = MsgType.LEDGER_PEERS
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<II")
    LAYOUT: ClassVar[tuple[str, ...]] = ("clients", "")
    clients: int


@dataclass(frozen=True, slots=True)
class MemRefusals(_Fixed):
    """Allocations the hook refused on its own (over the limit it knows) since its last report;
    the daemon's own refusals are not in it."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_REFUSALS
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IIQ")
    LAYOUT: ClassVar[tuple[str, ...]] = ("count", "", "largest")
    count: int
    largest: int = 0  # bytes: the largest refused request


@dataclass(frozen=True, slots=True)
class LimitSet(_Fixed):
    TYPE: ClassVar[MsgType] = MsgType.LIMIT_SET
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<IIQII{NAME_LEN}s{NAME_LEN}s")
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


Message = Any  # one of the body classes above

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
    "nvs_mem_refusals": MemRefusals.FORMAT,
}
