"""How a fixed-layout message body is packed: the rules every message of the wire shares.

`appliance.wire.protocol` declares each body as a frozen dataclass with a little-endian struct
format mirroring `ld_hook/nvshare_proto.h`; this module turns such a declaration into bytes
and back (strings NUL-padded and cut to fit, reserved fields sent as 0, numbers read back into
their enums), so the protocol module holds the messages and nothing else.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _string_sizes(fmt: struct.Struct) -> list[int]:
    """Per item of a format: the size of a fixed string (`48s`), 0 for a number."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt.format.lstrip("<"))
    return [int(count or 1) if code == "s" else 0 for count, code in items]


class Fixed:
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
    def unpack(cls, body: bytes) -> Self:
        fields = {}
        for name, value in zip(cls._layout(), cls.FORMAT.unpack(body), strict=True):
            if name:
                raw = _cstr(value) if isinstance(value, bytes) else value
                fields[name] = cls.DECODE[name](raw) if name in cls.DECODE else raw
        return cls(**fields)


class Empty:
    """A message with no body (LOCK_REQUEST, HEARTBEAT, ...): each is a frozen dataclass
    subclass naming its TYPE, so a message is told from another by its class."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct("<")

    def pack(self) -> bytes:
        return b""

    @classmethod
    def unpack(cls, body: bytes) -> Self:
        if body:
            raise struct.error(f"{cls.__name__} carries no body")
        return cls()
