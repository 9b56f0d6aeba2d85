"""Checks the schema cannot express: bounds of sizes and durations written as strings, ports,
and rules that span fields (possibly set in different files)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from appliance.policy import schema
from appliance.policy.merge import Merge
from appliance.policy.messages import kind_problem, pattern_path, short
from appliance.policy.model import MIN_TIME_QUANTUM_S, priority_value
from appliance.policy.parse import escape_pointer
from appliance.policy.quantity import QuantityError, parse_seconds, parse_size

_KINDS = {path: schema.value_kind(sub) for path, sub in schema.iter_properties()}
_TQ_FLOOR = (
    MIN_TIME_QUANTUM_S,
    True,
    f"the time quantum must be at least {MIN_TIME_QUANTUM_S:g}s "
    "(nvshare measured throughput collapse below about 10s)",
)
# Lower bounds the schema cannot say of "30s"-style strings: (seconds, inclusive?, why).
_MIN_SECONDS = {
    "/scheduler/timeQuantum": _TQ_FLOOR,
    "/gpus/*/timeQuantum": _TQ_FLOOR,
    "/scheduler/computeWindow": (0.0, False, "the compute window must be longer than 0"),
    "/scheduler/requestWindow": (0.0, False, "the request window must be longer than 0"),
    "/scheduler/quotaSampleInterval": (0.0, False, "the sample interval must be longer than 0"),
    "/realtimeCheck/maxSampleAge": (0.0, False, "the sample age must be longer than 0"),
    "/scheduler/dropDeadline": (0.1, True, "the drop deadline must be at least 100ms"),
    "/unhookedProcesses/grace": (
        1.0,
        True,
        "the grace must be at least 1s (a process needs a moment to register after it starts)",
    ),
    "/realtimeCheck/nodeStatus/refreshInterval": (
        1.0,
        True,
        "the refresh interval must be at least 1s (each refresh is a write to the Node)",
    ),
}


def _leaves(value: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, f"{path}/{escape_pointer(str(key))}")
    elif isinstance(value, list) and path in schema.ITEM_ARRAYS:
        for index, sub in enumerate(value):
            yield from _leaves(sub, f"{path}/{index}")
    else:
        yield path, value


def value_problems(doc: dict[str, Any], *, skip: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Checks of single values the schema cannot express (bounds of sizes and durations written
    as strings, ports, chunk); paths in `skip` already have an error."""
    problems: list[tuple[str, str]] = []
    flagged = set(skip)
    for path, value in _leaves(doc):
        if path in flagged:
            continue
        try:
            problem = _value_problem(pattern_path(path), value)
        except (QuantityError, ValueError, IndexError, TypeError):
            continue  # not a valid value at all: the schema check reports it
        if problem:
            problems.append((path, problem))
    return problems


def _value_problem(pattern: str, value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    kind = _KINDS.get(pattern)
    if kind is not None and (problem := kind_problem(kind, value)) is not None:
        return problem
    if kind == "duration" and pattern in _MIN_SECONDS:
        bound, inclusive, why = _MIN_SECONDS[pattern]
        seconds = parse_seconds(value)
        if seconds < bound or (not inclusive and seconds <= bound):
            return f"{short(value)} is too short: {why}"
    elif pattern == "/memory/chunk" and parse_size(value) == 0:
        return "the reservation chunk must be larger than 0"
    elif pattern == "/metrics/address":
        port = int(str(value).rsplit(":", 1)[1])
        if not 1 <= port <= 65535:
            return f"port {port} is not from 1 to 65535"
    return None


def merged_problems(doc: dict[str, Any], origin: Merge) -> list[tuple[str, str]]:
    """Checks that span fields, possibly set in different files."""
    problems: list[tuple[str, str]] = []
    sch = doc["scheduler"]
    if parse_seconds(sch["quotaSampleInterval"]) > parse_seconds(sch["computeWindow"]):
        problems.append(
            (
                "/scheduler/quotaSampleInterval",
                f"{short(sch['quotaSampleInterval'])} is longer than "
                f"/scheduler/computeWindow ({sch['computeWindow']!r})",
            )
        )
    status = doc["realtimeCheck"]["nodeStatus"]
    if parse_seconds(status["refreshInterval"]) < parse_seconds(status["minInterval"]):
        problems.append(
            (
                "/realtimeCheck/nodeStatus/refreshInterval",
                f"{short(status['refreshInterval'])} is shorter than "
                f"/realtimeCheck/nodeStatus/minInterval ({status['minInterval']!r})",
            )
        )
    limits = doc["annotations"]["coreLimitRange"]
    if limits["min"] > limits["max"]:
        problems.append(
            ("/annotations/coreLimitRange/min", f"min {limits['min']} is above max {limits['max']}")
        )
    priorities = doc["annotations"]["priorityRange"]
    if priority_value(priorities["min"]) > priority_value(priorities["max"]):
        problems.append(
            (
                "/annotations/priorityRange/min",
                f"min {priorities['min']} is above max {priorities['max']}",
            )
        )
    mem = doc["memory"]
    if mem["singleProcessOversubscription"] and mem["backing"] != "managed":
        problems.append(
            (
                "/memory/singleProcessOversubscription",
                "oversubscribing a single process needs /memory/backing: managed",
            )
        )
    named: dict[str, str] = {}
    for index, rule in enumerate(doc["rules"]):
        name = rule.get("name") or ""
        if not name:
            continue
        here = f"/rules/{index}/name"
        if name in named:
            problems.append((here, f"rule name {name!r} is already used by {named[name]}"))
        else:
            file, file_path = origin.locate(f"/rules/{index}")
            named[name] = f"{file}#{file_path}"
    return problems
