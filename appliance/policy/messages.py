"""Schema and value errors, as messages a user can act on: what is wrong, in the file's words.

jsonschema's own messages name Python types and regular expressions; these say "expected a
number, got a string '4Gx'", "is not a size (a number with a unit such as 512Mi...)", and
"unknown field 'timeQuantm' (did you mean 'timeQuantum'?)".
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from appliance.policy import schema
from appliance.policy.model import MAX_DURATION_S
from appliance.policy.parse import escape_pointer
from appliance.policy.quantity import QuantityError, parse_seconds, parse_size

_PATTERN_HINTS = {
    "/devicePlugin/resourceName": "an extended resource name such as nvshare.com/gpu",
    "/metrics/address": "HOST:PORT, such as [::]:9402 or 127.0.0.1:9402",
    "/gpus/*/match/uuid": "a GPU UUID such as GPU-8f6e0c52-...",
    "/rules/*/name": "a name of letters, digits, '-', '_' and '.' (at most 64)",
    "/migFallback/chains/*/*": "a MIG profile such as 1g.18gb, 3g.71gb or 1g.18gb+me",
}
_KIND_HINTS = {
    "size": "is not a size (a number with a unit such as 512Mi, 4Gi or 8G; a bare number is MiB)",
    "duration": "is not a duration (seconds, or a number with a unit: 500ms, 30s, 2m, 1h)",
}
_JSON_TYPES = {
    "integer": "a whole number",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
    "null": "null",
}


def pattern_path(json_path: str) -> str:
    return re.sub(r"/\d+(?=/|$)", "/*", json_path)


def _pointer(parts: Iterable[Any]) -> str:
    return "".join("/" + escape_pointer(str(p)) for p in parts)


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _message(error: jsonschema.ValidationError, json_path: str) -> str:
    title = error.schema.get("title") if isinstance(error.schema, dict) else None
    if title in _KIND_HINTS:
        return (
            kind_problem(str(title), error.instance)
            or f"{short(error.instance)} {_KIND_HINTS[title]}"
        )
    if error.validator == "anyOf" and (alternative := _telling_alternative(error)) is not None:
        return _message(alternative, json_path)
    if error.validator == "type":
        return _type_message(error, json_path)
    if error.validator == "pattern" and (hint := _PATTERN_HINTS.get(pattern_path(json_path))):
        return f"{short(error.instance)} is not {hint}"
    if error.validator == "minItems" and pattern_path(json_path) == "/migFallback/chains/*":
        return "a fallback chain needs at least two profiles"
    if error.validator in _BY_VALIDATOR:
        return _BY_VALIDATOR[error.validator](error)
    return str(error.message)


_BY_VALIDATOR: dict[str, Callable[[Any], str]] = {
    "enum": lambda e: (
        f"{short(e.instance)} is not one of: {', '.join(str(v) for v in e.validator_value)}"
    ),
    "const": lambda e: f"{short(e.instance)} is not supported (the only policy version is 1)",
    "maxItems": lambda e: f"{len(e.instance):,} entries; at most {e.validator_value:,}",
}


def _telling_alternative(error: jsonschema.ValidationError) -> Any:
    """Of a failed anyOf, the branch whose message says most: a size or duration before the
    rest, never "is not null"."""
    useful = [
        c
        for c in error.context or ()
        if not (c.validator == "type" and c.validator_value == "null")
    ]
    titled = [
        c for c in useful if isinstance(c.schema, dict) and c.schema.get("title") in _KIND_HINTS
    ]
    return (titled or useful or [None])[0]


def _type_message(error: jsonschema.ValidationError, json_path: str) -> str:
    wanted = (
        error.validator_value
        if isinstance(error.validator_value, list)
        else [error.validator_value]
    )
    got = _describe_type(error.instance)
    if json_path == "":
        return f"expected a mapping of policy settings at the top level, got {got}"
    expected = " or ".join(_JSON_TYPES.get(str(w), str(w)) for w in wanted)
    return f"expected {expected}, got {got} {short(error.instance)}"


def schema_problems(value: Any) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for error in schema.validator().iter_errors(value):
        path = _pointer(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = list(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - set(allowed)):
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "allowed: " + ", ".join(allowed)
                problems.append(
                    (f"{path}/{escape_pointer(str(key))}", f"unknown field {key!r} ({hint})")
                )
        else:
            problems.append((path, _message(error, path)))
    return problems


def kind_problem(kind: str, value: Any) -> str | None:
    """What is wrong with a size or duration, bounds included; None if nothing is."""
    if kind == "size":
        try:
            parse_size(value)
        except QuantityError as e:
            return str(e)
        return None
    try:
        seconds = parse_seconds(value)
    except QuantityError:
        return None  # the schema's own message says what a duration looks like
    if seconds < 0:
        return f"{short(value)} is negative: durations are 0 or more"
    if seconds > MAX_DURATION_S:
        return (
            f"{short(value)} is too long: durations are at most {MAX_DURATION_S / 3600:g}h "
            "(a day is past any sensible quantum or idle time)"
        )
    return None
