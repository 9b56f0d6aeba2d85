"""Sizes, durations and counts, parsed once at the edge: "4Gi" -> bytes, "30s" -> seconds.

One size grammar for the whole project. A size is a Kubernetes quantity with a binary suffix
(Ki Mi Gi Ti Pi Ei) or a decimal one (k M G T P E), or a bare number, which means MiB
everywhere: in policy files, pod annotations, nvsharectl and the hook's
NVSHARE_GPU_MEMORY_LIMIT (`ld_hook/size.c` implements the same rules; `tests/data/sizes.json`
is the table of cases both are tested against). MiB and not bytes, because nvshare's deployment
guide documents a bare annotation as MiB and nobody means 4096 bytes of GPU memory.

Kubernetes accepts more than this (milli `m`, exponents `1e9`, signs, spaces); those are refused
here with a message, because "512m" as GPU memory is always a typo for 512Mi. Every size this
module accepts has the value `kubernetes.utils.parse_quantity` gives it (tests hold that), but
that function is not called: importing the `kubernetes` package costs nvsharectl and a bare-metal
daemon about 0.4 s and 36 MB, for one multiplication. Fractions of a byte round up, as
Kubernetes' `Quantity.Value()` does.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

MiB = 1 << 20
MAX_SIZE_BYTES = 1 << 60  # 1Ei: far above any GPU, far below where 64-bit sums overflow
MAX_FRACTION_DIGITS = 9  # the hook computes in 128-bit integers; nano is Kubernetes' finest

SIZE_UNITS = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_TIME_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

_BLANKS = " \t\n\r"  # what ld_hook/size.c skips around a size
_NUMBER = re.compile(r"([0-9]+)(?:\.([0-9]+))?")
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_GRAMMAR = "a number with a unit such as 512Mi, 4Gi or 1.5G; a bare number is MiB"
_UNITS = "units: Ki Mi Gi Ti Pi Ei (1024s), k M G T P E (1000s); a bare number is MiB"


class QuantityError(ValueError):
    """A size, duration or count that cannot be used; the message says what was expected."""


def parse_size(value: str | int | float) -> int:
    """Whole bytes of a size such as "4Gi", "512Mi", "1.5G" or 4096 (MiB); see the module."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise QuantityError(f"{value!r} is not a size ({_GRAMMAR})")
    if isinstance(value, str):
        number, multiplier = _split_size(value)
    else:
        if value < 0 or not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a size: it must not be negative")
        number, multiplier = Decimal(str(value)), MiB
    result = math.ceil(number * multiplier)
    if result > MAX_SIZE_BYTES:
        raise QuantityError(f"{value!r} is too large: sizes are at most 1Ei")
    return result


def _split_size(text: str) -> tuple[Decimal, int]:
    stripped = text.strip(_BLANKS)
    m = _NUMBER.match(stripped)
    if stripped.startswith(("-", "+")):
        raise QuantityError(f"{text!r} is not a size: write it without a sign")
    if not m:
        raise QuantityError(f"{text!r} is not a size ({_GRAMMAR})")
    if m.group(2) is not None and len(m.group(2)) > MAX_FRACTION_DIGITS:
        raise QuantityError(
            f"{text!r} is not a size: at most {MAX_FRACTION_DIGITS} digits after the point"
        )
    unit = stripped[m.end() :]
    if unit and unit not in SIZE_UNITS:
        raise QuantityError(f"{text!r} is not a size: {_unit_hint(unit)}")
    return Decimal(m.group(0)), SIZE_UNITS.get(unit, MiB)


def _unit_hint(unit: str) -> str:
    """Why a unit is refused, with the likely intended one."""
    if unit != unit.lstrip():
        return "write the unit right after the number, without a space"
    if unit in ("m", "u", "n"):
        return f"{unit!r} is a fraction (milli, micro, nano), not a memory unit; did you mean Mi?"
    if re.fullmatch(r"[eE][0-9+-].*", unit):
        return "exponents are not accepted; write it with a unit such as G or Gi"
    base = unit[:-1] if unit[-1:] in ("B", "b") and len(unit) > 1 else unit
    binary = [s for s in SIZE_UNITS if s.endswith("i") and s.lower() == base.lower()]
    if binary:
        return f"unknown unit {unit!r}; did you mean {binary[0]}?"
    decimal = [s for s in SIZE_UNITS if len(s) == 1 and s.lower() == base.lower()]
    if decimal:
        d = decimal[0]
        return f"unknown unit {unit!r}; did you mean {d} (1000s) or {d.upper()}i (1024s)?"
    return f"unknown unit {unit!r} ({_UNITS})"


def parse_count(value: object) -> int:
    """A whole, non-negative Kubernetes quantity: an extended resource's device count ("2")."""
    text = str(value).strip()
    m = _NUMBER.match(text)
    unit = text[m.end() :] if m else ""
    if m is None or (unit and unit not in SIZE_UNITS):
        raise QuantityError(f"{value!r} is not a whole number of devices")
    number = Decimal(m.group(0)) * SIZE_UNITS.get(unit, 1)
    if number != number.to_integral_value():
        raise QuantityError(f"{value!r} is not a whole number of devices")
    return int(number)


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
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return f"{n} bytes" if n else "0"
