"""The view messages of the wire format (`ld_hook/nvshare_proto.h`, VIEW_*): the GPU as a process
is shown it (NVML, `cuMemGetInfo`, nvidia-smi), asked for before or without REGISTER
(`appliance.core.shown`).

Kept beside `appliance.wire.protocol`, whose types and packing they use; `tests/protocol` checks
their layout against the C header like every other body.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from appliance.wire.layout import Fixed
from appliance.wire.protocol import NAME_LEN, POD_NAME_LEN, UUID_LEN, MsgType


@dataclass(frozen=True, slots=True)
class ViewRequest(Fixed):
    """How a GPU looks to the asking process; no REGISTER needed (nvidia-smi, monitoring)."""

    TYPE: ClassVar[MsgType] = MsgType.VIEW_REQUEST
    FORMAT: ClassVar[struct.Struct] = struct.Struct(f"<{UUID_LEN}sQ{NAME_LEN}s{POD_NAME_LEN}s")
    gpu_uuid: str
    gpu_total_mem: int = 0  # bytes, as NVML reports them
    pod_namespace: str = ""  # hints, as in Register
    pod_name: str = ""


VIEW_MAX_PROCESSES = 16
VIEW_SELF = 0x1  # ViewProcess.flags: the process that asked


@dataclass(frozen=True, slots=True)
class ViewProcess(Fixed):
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IIQ")
    pid: int  # as the asking process sees it
    flags: int  # VIEW_SELF
    used: int  # bytes, as the ledger counts them


@dataclass(frozen=True, slots=True)
class View:
    """The answer to a ViewRequest: the asker's limit on the GPU (0: none, the real GPU is
    shown), what its pod (or, outside pods, the process) holds there, and its processes."""

    TYPE: ClassVar[MsgType] = MsgType.VIEW
    HEAD: ClassVar[struct.Struct] = struct.Struct("<QQII")
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<QQII" + "IIQ" * VIEW_MAX_PROCESSES)
    mem_limit: int
    used: int
    processes: tuple[ViewProcess, ...] = ()
    unlisted: int = 0  # counted in `used`, not listed (past the array, or not visible to it)

    def pack(self) -> bytes:
        shown = self.processes[:VIEW_MAX_PROCESSES]
        unlisted = self.unlisted + len(self.processes) - len(shown)
        entries = b"".join(x.pack() for x in shown)
        padding = bytes(ViewProcess.FORMAT.size * (VIEW_MAX_PROCESSES - len(shown)))
        return self.HEAD.pack(self.mem_limit, self.used, len(shown), unlisted) + entries + padding

    @classmethod
    def unpack(cls, body: bytes) -> View:
        cls.FORMAT.unpack(body)  # length check
        mem_limit, used, count, unlisted = cls.HEAD.unpack_from(body)
        if count > VIEW_MAX_PROCESSES:
            raise struct.error(f"{count} processes, at most {VIEW_MAX_PROCESSES} fit")
        entries = ViewProcess.FORMAT.iter_unpack(body[cls.HEAD.size :])
        processes = tuple(ViewProcess(*next(entries)) for _ in range(count))
        return cls(mem_limit, used, processes, unlisted)
