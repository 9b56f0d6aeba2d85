"""How a fixed-layout message body is packed: the rules every message of the wire shares.

`appliance.wire.protocol` declares each body as a frozen dataclass with a little-endian struct
format mirroring `ld_hook/nvshare_proto.h`; this module turns such a declaration into bytes
and back (strings NUL-padded and cut to fit, reserved fields sent as 0, numbers read back into
their enums), so the protocol module holds the messages and nothing else.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _string_sizes(fmt: struct.Struct) -> list[int]:
    """Per item of a format: the size of a fixed string (`48s`), 0 for a number."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt.format.lstrip("<"))
    return [int(count or 1) if code == "s" else 0 for count, code in items]


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one body class goes to bytes and back, worked out once per class: every message
    sent or read goes through here, so nothing of it is looked up per message."""

    names: tuple[str, ...]  # per item of FORMAT: its field, "" for a reserved one
    sizes: tuple[int, ...]  # per item: a string's size, 0 for a number
    plain: bool  # numbers only, every item a field in the class's own order, none decoded
    # what unpacking keeps: (item, field, is a string, what turns the number into its enum)
    reads: tuple[tuple[int, str, bool, Callable[[Any], Any] | None], ...]
    values: Callable[[Any], tuple[Any, ...]]  # a plain body's items, in order (packing)

    @classmethod
    def of(cls, body: type[Fixed]) -> _Plan:
        fields = tuple(f.name for f in dataclasses.fields(body))  # type: ignore[arg-type]
        names = body.LAYOUT or fields
        sizes = tuple(_string_sizes(body.FORMAT))
        if len(names) != len(sizes):
            raise ValueError(f"{body.__name__}: {len(names)} fields for {len(sizes)} items")
        plain = names == fields and not any(sizes) and not body.DECODE
        reads = tuple(
            (i, name, bool(size), body.DECODE.get(name))
            for i, (name, size) in enumerate(zip(names, sizes, strict=True))
            if name
        )
        return cls(names, sizes, plain, reads, _getter(names))


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The fields `names` of a body as a tuple, read in C (`attrgetter`): every grant sent
    is packed through here."""
    if len(names) > 1 and all(names):
        return operator.attrgetter(*names)
    return lambda body: tuple(getattr(body, name) for name in names)


_PLANS: dict[type, _Plan] = {}


def _plan(body: type[Fixed]) -> _Plan:
    plan = _PLANS.get(body)
    if plan is None:
        plan = _PLANS[body] = _Plan.of(body)
    return plan


class Fixed:
    """A fixed-layout body: FORMAT's items are LAYOUT's fields in order (the dataclass's fields
    when LAYOUT is empty; "" marks a reserved field sent as 0). Strings travel NUL-padded and cut
    to fit; DECODE turns numbers read back into their enums."""

    FORMAT: ClassVar[struct.Struct]
    LAYOUT: ClassVar[tuple[str, ...]] = ()
    DECODE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    def pack(self) -> bytes:
        plan = _plan(type(self))
        if plan.plain:
            return self.FORMAT.pack(*plan.values(self))
        values: list[Any] = []
        for name, size in zip(plan.names, plan.sizes, strict=True):
            value: Any = getattr(self, name) if name else 0
            values.append(value.encode("utf-8")[: size - 1] if size else value)
        return self.FORMAT.pack(*values)

    @classmethod
    def unpack(cls, body: bytes) -> Self:
        plan = _plan(cls)
        if plan.plain:
            return cls(*cls.FORMAT.unpack(body))
        items = cls.FORMAT.unpack(body)
        fields = {}
        for i, name, text, decode in plan.reads:
            value = _cstr(items[i]) if text else items[i]
            fields[name] = value if decode is None else decode(value)
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
