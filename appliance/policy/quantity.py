"""Quantities parsed once, at the edge: "4Gi" -> bytes, "30s" -> seconds.

Kubernetes quantity suffixes are accepted for sizes (Ki, Mi, Gi, Ti, Pi and the decimal
k, M, G, T, P); a bare number means `bare_unit` bytes (MiB for annotations, as nvshare's
deployment guide documents; bytes elsewhere unless a caller says otherwise).
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
}
_TIME_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kMGTP]i?|)\s*$")
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")

MiB = 1 << 20


class QuantityError(ValueError):
    """A size or duration that cannot be parsed; the message says what was expected."""


def parse_bytes(value: str | int | float, *, bare_unit: int = 1) -> int:
    """Parse a size such as "4Gi", "512Mi", "1.5G" or 1024 into whole bytes."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        number, unit = float(value), bare_unit
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise QuantityError(
                f"{value!r} is not a size (expected a number with an optional unit such as "
                "512Mi, 4Gi or 8G)"
            )
        number = float(m.group(1))
        unit = _SIZE_UNITS[m.group(2)] if m.group(2) else bare_unit
    result = int(number * unit)
    if result < 0:
        raise QuantityError(f"{value!r} is negative")
    return result


def parse_seconds(value: str | int | float, *, bare_unit: float = 1.0) -> float:
    """Parse a duration such as "30s", "2000ms", "1m" or 30 into seconds."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        return float(value) * bare_unit
    m = _TIME_RE.match(value)
    if not m:
        raise QuantityError(
            f"{value!r} is not a duration (expected a number with an optional unit: ms, s, m, h)"
        )
    unit = _TIME_UNITS[m.group(2)] if m.group(2) else bare_unit
    return float(m.group(1)) * unit


def format_bytes(n: int) -> str:
    """The shortest exact binary form ("4Gi", "1536Mi"), or bytes."""
    for suffix, size in (
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)
