"""Policy directory to `Policy`: read, validate, merge, parse quantities, record provenance.

The directory is conf.d style: every `*.yaml`, `*.yml` and `*.json` file, in file-name order,
over the built-in defaults (the schema's `default` values), then environment overrides on top.
Merge rules: objects merge key by key and a later file's value replaces an earlier one's;
`rules` and `gpus` concatenate (file-name order, then order inside each file); every other list
(`migFallback.chains`) is one value and is replaced whole. Hidden names are skipped, which also
skips kubelet's `..data` and `..2026_...` entries of a mounted ConfigMap: its visible files are
symlinks through `..data` and are followed like any other file.

Every file is validated against the schema on its own (so errors name the file and line it was
written on), and the merged result is validated again, with cross-field checks. All errors, of
all files, are collected before `PolicyLoadError` is raised. The same code validates offline:
`validate_paths` backs `nvsharectl policy validate`, and also reads ConfigMap manifests.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

from appliance.policy import model, schema
from appliance.policy.env import env_overrides
from appliance.policy.errors import PolicyError, PolicyLoadError
from appliance.policy.model import MAX_DURATION_S, MIN_TIME_QUANTUM_S
from appliance.policy.parse import (
    ParsedDocument,
    escape_pointer,
    parse_policy_text,
    parse_yaml_documents,
)
from appliance.policy.quantity import QuantityError, parse_seconds, parse_size

__all__ = [
    "PolicyError",
    "PolicyLoadError",
    "PolicyFile",
    "PolicySnapshot",
    "read_policy_dir",
    "build_policy",
    "load_policy_dir",
    "validate_paths",
    "POLICY_SUFFIXES",
]

POLICY_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """One policy file's bytes, as read.

    `name` is what `Policy.files` lists; `label` is how errors name it; `line_offset` maps its
    lines to the lines of the file a user opens (a ConfigMap key's text starts lines into the
    manifest), or is None where its lines map to nothing the user can open.
    """

    name: str
    content: bytes
    label: str
    line_offset: int | None = 0


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """What a policy directory held at one moment; `errors` are problems reading it."""

    directory: str
    files: tuple[PolicyFile, ...]
    errors: tuple[PolicyError, ...]
    content_hash: str
    # Visible names whose symlink target is missing: the directory is in flux (kubelet has
    # removed `..data` and not yet renamed the new one in), never "these files were removed".
    dangling: tuple[str, ...] = ()
    missing: bool = False  # the directory itself does not exist


def _content_hash(files: Iterable[PolicyFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        for part in (f.name.encode(), f.content):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


MAX_FILE_BYTES = 1 << 20  # what one ConfigMap can hold; a policy is kilobytes
MAX_RULES = 10_000  # every client's limits are resolved against every rule
MAX_GPU_ENTRIES = 1_024
_LIST_BOUNDS = {"rules": MAX_RULES, "gpus": MAX_GPU_ENTRIES}


_DANGLING = (
    "is a symlink to a file that does not exist (a ConfigMap being updated: kubelet swaps "
    "its ..data link); the policy in force is kept"
)


def _read_regular_file(path: Path) -> bytes | None:
    """The file's bytes (following symlinks, as kubelet's go through ..data); None if it is
    not a regular file. Opened non-blocking so a FIFO named like a policy cannot hang us."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > MAX_FILE_BYTES:
            raise OSError(
                0, f"larger than {MAX_FILE_BYTES >> 20} MiB (what a ConfigMap can hold); not read"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_policy_dir(path: Path, *, label_prefix: str = "") -> PolicySnapshot:
    """Read every policy file of the directory, in file-name order. Never raises for I/O."""
    directory = str(path)
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        err = PolicyError(directory, None, "", "the policy directory does not exist")
        return PolicySnapshot(directory, (), (err,), _content_hash(()), missing=True)
    except NotADirectoryError:
        err = PolicyError(directory, None, "", "is not a directory (give the policy directory)")
        return PolicySnapshot(directory, (), (err,), _content_hash(()))
    except OSError as e:
        err = PolicyError(directory, None, "", f"cannot list the policy directory: {e.strerror}")
        return PolicySnapshot(directory, (), (err,), _content_hash(()))
    files: list[PolicyFile] = []
    errors: list[PolicyError] = []
    dangling: list[str] = []
    for name in names:
        if name.startswith(".") or not name.endswith(POLICY_SUFFIXES):
            continue
        try:
            content = _read_regular_file(path / name)
        except FileNotFoundError:
            if os.path.islink(path / name):
                dangling.append(name)
                errors.append(PolicyError(label_prefix + name, None, "", _DANGLING))
            continue  # else removed while we listed: the event that follows re-reads
        except OSError as e:
            errors.append(PolicyError(label_prefix + name, None, "", f"cannot read: {e.strerror}"))
            continue
        if content is not None:
            files.append(PolicyFile(name, content, label_prefix + name))
    return PolicySnapshot(
        directory, tuple(files), tuple(errors), _content_hash(files), dangling=tuple(dangling)
    )


# --- validation -----------------------------------------------------------------------------

_PATTERN_HINTS = {
    "/devicePlugin/resourceName": "an extended resource name such as nvshare.com/gpu",
    "/metrics/address": "HOST:PORT, such as 0.0.0.0:9402 or [::]:9402",
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


def _pattern_path(json_path: str) -> str:
    return re.sub(r"/\d+(?=/|$)", "/*", json_path)


def _pointer(parts: Iterable[Any]) -> str:
    return "".join("/" + escape_pointer(str(p)) for p in parts)


def _short(value: Any) -> str:
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
            _kind_problem(str(title), error.instance)
            or f"{_short(error.instance)} {_KIND_HINTS[title]}"
        )
    if error.validator == "anyOf":
        useful = [
            c
            for c in error.context or ()
            if not (c.validator == "type" and c.validator_value == "null")
        ]
        titled = [
            c for c in useful if isinstance(c.schema, dict) and c.schema.get("title") in _KIND_HINTS
        ]
        if titled or useful:
            return _message((titled or useful)[0], json_path)
    if error.validator == "enum":
        choices = ", ".join(str(v) for v in error.validator_value)
        return f"{_short(error.instance)} is not one of: {choices}"
    if error.validator == "const":
        return f"{_short(error.instance)} is not supported (the only policy version is 1)"
    if error.validator == "type":
        wanted = (
            error.validator_value
            if isinstance(error.validator_value, list)
            else [error.validator_value]
        )
        expected = " or ".join(_JSON_TYPES.get(str(w), str(w)) for w in wanted)
        if json_path == "":
            got = _describe_type(error.instance)
            return f"expected a mapping of policy settings at the top level, got {got}"
        return f"expected {expected}, got {_describe_type(error.instance)} {_short(error.instance)}"
    if error.validator == "pattern":
        hint = _PATTERN_HINTS.get(_pattern_path(json_path))
        if hint:
            return f"{_short(error.instance)} is not {hint}"
    if error.validator == "maxItems":
        return f"{len(error.instance):,} entries; at most {error.validator_value:,}"
    if error.validator == "minItems" and _pattern_path(json_path) == "/migFallback/chains/*":
        return "a fallback chain needs at least two profiles"
    return str(error.message)


def _schema_problems(value: Any) -> list[tuple[str, str]]:
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
    "/scheduler/quotaSampleInterval": (0.0, False, "the sample interval must be longer than 0"),
    "/realtimeCheck/maxSampleAge": (0.0, False, "the sample age must be longer than 0"),
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


def _kind_problem(kind: str, value: Any) -> str | None:
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
        return f"{_short(value)} is negative: durations are 0 or more"
    if seconds > MAX_DURATION_S:
        return (
            f"{_short(value)} is too long: durations are at most {MAX_DURATION_S / 3600:g}h "
            "(the hook is sent milliseconds in 32 bits)"
        )
    return None


def _value_problems(doc: dict[str, Any], *, skip: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Checks of single values the schema cannot express (bounds of sizes and durations written
    as strings, ports, chunk); paths in `skip` already have an error."""
    problems: list[tuple[str, str]] = []
    flagged = set(skip)
    for path, value in _leaves(doc):
        if path in flagged:
            continue
        try:
            problem = _value_problem(_pattern_path(path), value)
        except (QuantityError, ValueError, IndexError, TypeError):
            continue  # not a valid value at all: the schema check reports it
        if problem:
            problems.append((path, problem))
    return problems


def _value_problem(pattern: str, value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    kind = _KINDS.get(pattern)
    if kind is not None and (problem := _kind_problem(kind, value)) is not None:
        return problem
    if kind == "duration" and pattern in _MIN_SECONDS:
        bound, inclusive, why = _MIN_SECONDS[pattern]
        seconds = parse_seconds(value)
        if seconds < bound or (not inclusive and seconds <= bound):
            return f"{_short(value)} is too short: {why}"
    elif pattern == "/memory/chunk" and parse_size(value) == 0:
        return "the reservation chunk must be larger than 0"
    elif pattern == "/metrics/address":
        port = int(str(value).rsplit(":", 1)[1])
        if not 1 <= port <= 65535:
            return f"port {port} is not from 1 to 65535"
    return None


def _merged_problems(doc: dict[str, Any], origin: _Merge) -> list[tuple[str, str]]:
    """Checks that span fields, possibly set in different files."""
    problems: list[tuple[str, str]] = []
    sch = doc["scheduler"]
    if parse_seconds(sch["quotaSampleInterval"]) > parse_seconds(sch["computeWindow"]):
        problems.append(
            (
                "/scheduler/quotaSampleInterval",
                f"{_short(sch['quotaSampleInterval'])} is longer than "
                f"/scheduler/computeWindow ({sch['computeWindow']!r})",
            )
        )
    status = doc["realtimeCheck"]["nodeStatus"]
    if parse_seconds(status["refreshInterval"]) < parse_seconds(status["minInterval"]):
        problems.append(
            (
                "/realtimeCheck/nodeStatus/refreshInterval",
                f"{_short(status['refreshInterval'])} is shorter than "
                f"/realtimeCheck/nodeStatus/minInterval ({status['minInterval']!r})",
            )
        )
    limits = doc["annotations"]["coreLimitRange"]
    if limits["min"] > limits["max"]:
        problems.append(
            ("/annotations/coreLimitRange/min", f"min {limits['min']} is above max {limits['max']}")
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


# --- merge with provenance ------------------------------------------------------------------


def _record(value: Any, path: str, source: str, sources: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _record(sub, f"{path}/{escape_pointer(str(key))}", source, sources)
    elif isinstance(value, list) and path in schema.ITEM_ARRAYS and value:
        for index, sub in enumerate(value):
            _record(sub, f"{path}/{index}", source, sources)
    else:
        sources[path] = source


class _Merge:
    """The merged document, which file set each value, and where each list item came from."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = schema.default_document()
        self.sources: dict[str, str] = {}
        self.items: dict[str, tuple[str, str]] = {}  # "/rules/3" -> ("20-b.yaml", "/rules/1")
        _record(self.value, "", "default", self.sources)

    def _forget(self, path: str) -> None:
        for key in [k for k in self.sources if k == path or k.startswith(path + "/")]:
            del self.sources[key]

    def apply(
        self,
        doc: Mapping[str, Any],
        source: str,
        *,
        target: dict[str, Any] | None = None,
        path: str = "",
    ) -> None:
        target = self.value if target is None else target
        for key, value in doc.items():
            child = f"{path}/{escape_pointer(str(key))}"
            if child in schema.ITEM_ARRAYS:
                start = len(target[key])
                if start == 0:
                    self._forget(child)
                for index, item in enumerate(value):
                    self.items[f"{child}/{start + index}"] = (source, f"{child}/{index}")
                    _record(item, f"{child}/{start + index}", source, self.sources)
                target[key] = target[key] + copy.deepcopy(value)
            elif isinstance(value, dict) and isinstance(target.get(key), dict):
                self.apply(value, source, target=target[key], path=child)
            else:
                self._forget(child)
                target[key] = copy.deepcopy(value)
                _record(value, child, source, self.sources)

    def set(self, json_path: str, value: Any, source: str) -> None:
        *parents, last = json_path.strip("/").split("/")
        node = self.value
        for part in parents:
            node = node[part]
        node[last] = value
        self._forget(json_path)
        self.sources[json_path] = source

    def locate(self, json_path: str) -> tuple[str, str]:
        """(file name or "env NAME" or "default", the path inside it) of a merged path."""
        parts = json_path.split("/")
        if len(parts) >= 3 and "/" + parts[1] in schema.ITEM_ARRAYS:
            item = "/".join(parts[:3])
            if item in self.items:
                source, inner = self.items[item]
                return source, inner + json_path[len(item) :]
        path = json_path
        while True:
            if path in self.sources:
                return self.sources[path], json_path
            if not path:
                break
            path = path.rsplit("/", 1)[0]
        below = [v for k, v in self.sources.items() if k.startswith(json_path + "/")]
        return (below[0] if below else "default"), json_path


# --- building the Policy --------------------------------------------------------------------


def _opt_bytes(value: Any) -> int | None:
    return None if value is None else parse_size(value)


def _opt_mode(value: Any) -> model.Mode | None:
    return None if value is None else model.Mode(value)


def _to_policy(doc: dict[str, Any], merge: _Merge, snapshot: PolicySnapshot) -> model.Policy:
    sch, mem, rt = doc["scheduler"], doc["memory"], doc["realtimeCheck"]
    rules = []
    for index, rule in enumerate(doc["rules"]):
        file, inner = merge.locate(f"/rules/{index}")
        match = rule.get("match", {})
        rules.append(
            model.Rule(
                name=rule.get("name") or f"{file}#{inner}",
                match=model.RuleMatch(
                    namespace=match.get("namespace"),
                    pod_name=match.get("podName"),
                    pod_labels=dict(match.get("podLabels") or {}),
                    uid=match.get("uid"),
                    user=match.get("user"),
                    group=match.get("group"),
                    systemd_unit=match.get("systemdUnit"),
                    executable=match.get("executable"),
                ),
                limits=model.Limits(
                    memory_bytes=_opt_bytes(rule.get("memoryLimit")),
                    core_percent=rule.get("coreLimit"),
                ),
                mode=_opt_mode(rule.get("mode")),
                source=f"{file}#{inner}",
            )
        )
    gpus = []
    for index, gpu in enumerate(doc["gpus"]):
        file, inner = merge.locate(f"/gpus/{index}")
        match = gpu.get("match", {})
        tq = gpu.get("timeQuantum")
        gpus.append(
            model.GpuRule(
                match=model.GpuMatch(
                    uuid=match.get("uuid"), index=match.get("index"), model=match.get("model")
                ),
                mode=_opt_mode(gpu.get("mode")),
                time_quantum_s=None if tq is None else parse_seconds(tq),
                memory_bytes=_opt_bytes(gpu.get("memory")),
                source=f"{file}#{inner}",
            )
        )
    ann = doc["annotations"]
    return model.Policy(
        version=doc["version"],
        scheduler=model.SchedulerSettings(
            mode=model.Mode(sch["mode"]),
            time_quantum_s=parse_seconds(sch["timeQuantum"]),
            compute_window_s=parse_seconds(sch["computeWindow"]),
            quota_sample_interval_s=parse_seconds(sch["quotaSampleInterval"]),
            carry_over_percent=sch["carryOverPercent"],
            drop_tail_billing_percent=sch["dropTailBillingPercent"],
            idle_release_s=parse_seconds(sch["idleRelease"]),
        ),
        memory=model.MemorySettings(
            backing=model.Backing(mem["backing"]),
            single_process_oversubscription=mem["singleProcessOversubscription"],
            reserve_bytes=parse_size(mem["reserve"]),
            chunk_bytes=parse_size(mem["chunk"]),
        ),
        realtime_check=model.RealtimeCheck(
            mode=model.RealtimeCheckMode(rt["mode"]),
            safety_margin_bytes=parse_size(rt["safetyMargin"]),
            enabled_by_default=rt["enabledByDefault"],
            max_sample_age_s=parse_seconds(rt["maxSampleAge"]),
            node_status=model.NodeStatusSettings(
                publish=rt["nodeStatus"]["publish"],
                min_interval_s=parse_seconds(rt["nodeStatus"]["minInterval"]),
                refresh_interval_s=parse_seconds(rt["nodeStatus"]["refreshInterval"]),
                memory_change_bytes=parse_size(rt["nodeStatus"]["memoryChange"]),
            ),
        ),
        defaults=model.Limits(
            memory_bytes=_opt_bytes(doc["defaults"]["memoryLimit"]),
            core_percent=doc["defaults"]["coreLimit"],
        ),
        rules=tuple(rules),
        gpus=tuple(gpus),
        annotations=model.AnnotationPolicy(
            allowed=ann["allowed"],
            max_memory_bytes=_opt_bytes(ann["maxMemoryLimit"]),
            min_core_percent=ann["coreLimitRange"]["min"],
            max_core_percent=ann["coreLimitRange"]["max"],
        ),
        device_plugin=model.DevicePluginSettings(
            replicas_per_gpu=doc["devicePlugin"]["replicasPerGpu"],
            resource_name=doc["devicePlugin"]["resourceName"],
        ),
        mig_fallback=model.MigFallback(
            chains=tuple(tuple(chain) for chain in doc["migFallback"]["chains"])
        ),
        metrics=model.MetricsSettings(
            enabled=doc["metrics"]["enabled"], address=doc["metrics"]["address"]
        ),
        sources=dict(merge.sources),
        document=copy.deepcopy(doc),
        files=tuple(f.name for f in snapshot.files),
        content_hash=snapshot.content_hash,
    )


def _check_file(f: PolicyFile, room: dict[str, int]) -> tuple[ParsedDocument, list[PolicyError]]:
    """Parse and validate one file; `room` is how many entries each bounded list may still
    take, across all files (checked before the schema, which would walk every entry)."""
    offset = f.line_offset or 0

    def error(line: int | None, json_path: str, message: str) -> PolicyError:
        return PolicyError(f.label, line if f.line_offset is not None else None, json_path, message)

    try:
        text = f.content.decode("utf-8")
    except UnicodeDecodeError as e:
        return ParsedDocument(None), [error(None, "", f"not UTF-8 text (byte {e.start})")]
    doc = parse_policy_text(text, is_json=f.name.endswith(".json"), line_offset=offset)
    errors = [error(p.line, p.json_path, p.message) for p in doc.problems]
    if doc.value is None or errors:
        return doc, errors
    for field, left in room.items():
        entries = doc.value.get(field) if isinstance(doc.value, dict) else None
        if isinstance(entries, list) and len(entries) > left:
            bound = _LIST_BOUNDS[field]
            here = f"/{field}"
            return doc, [
                error(
                    doc.line_of(here),
                    here,
                    f"{len(entries):,} entries here make more than {bound:,} in all files; "
                    f"at most {bound:,}",
                )
            ]
    problems = _schema_problems(doc.value)
    if isinstance(doc.value, dict):
        problems += _value_problems(doc.value, skip=(path for path, _ in problems))
    errors += [error(doc.line_of(path), path, message) for path, message in problems]
    errors.sort(key=lambda e: e.line if e.line is not None else 0)  # stable: schema order
    return doc, errors


def build_policy(
    snapshot: PolicySnapshot, *, environ: Mapping[str, str] | None = None
) -> model.Policy:
    """Validate and merge what was read; raise `PolicyLoadError` with every error found."""
    environ = os.environ if environ is None else environ
    errors = list(snapshot.errors)
    merge = _Merge()
    parsed: dict[str, tuple[PolicyFile, ParsedDocument]] = {}
    room = dict(_LIST_BOUNDS)
    for f in snapshot.files:
        doc, file_errors = _check_file(f, room)
        errors += file_errors
        if not file_errors:
            parsed[f.name] = (f, doc)
            merge.apply(doc.value, f.name)
            for field in room:
                room[field] -= len(doc.value.get(field) or [])
    overrides, env_errors = env_overrides(environ)
    errors += env_errors
    for override in overrides:
        merge.set(override.json_path, override.value, f"env {override.variable}")
    # Each rules/gpus entry was checked in its own file and nothing else adds to those lists:
    # check the merged document without walking them again (they are most of a big policy).
    rest = {**merge.value, **{path.lstrip("/"): [] for path in schema.ITEM_ARRAYS}}
    problems = _schema_problems(rest)
    if not problems:
        problems = _value_problems(rest) + _merged_problems(merge.value, merge)
    seen = set(errors)
    for path, message in problems:
        source, inner = merge.locate(path)
        if source in parsed:
            f, doc = parsed[source]
            line = doc.line_of(inner) if f.line_offset is not None else None
            err = PolicyError(f.label, line, inner, message)
        else:
            err = PolicyError(source, None, inner, message)
        if err not in seen:
            seen.add(err)
            errors.append(err)
    if errors:
        raise PolicyLoadError(errors, where=snapshot.directory)
    return _to_policy(merge.value, merge, snapshot)


def load_policy_dir(path: Path, *, environ: Mapping[str, str] | None = None) -> model.Policy:
    """The policy a directory says, over the built-in defaults, with environment overrides.

    An empty directory (or one whose files were all removed) gives the built-in defaults.
    Raises `PolicyLoadError` carrying every `PolicyError` found in every file.
    """
    return build_policy(read_policy_dir(Path(path)), environ=environ)


# --- offline validation ---------------------------------------------------------------------


def _configmap_files(
    path: Path, text: str
) -> tuple[list[list[PolicyFile]], list[PolicyError]] | None:
    """The policy files of each ConfigMap in a manifest; None if the file is not a manifest."""
    try:
        docs = parse_yaml_documents(text)
    except yaml.YAMLError:
        return None
    manifests = [
        d
        for d in docs
        if isinstance(d.value, dict) and "kind" in d.value and "apiVersion" in d.value
    ]
    if not manifests:
        return None
    groups: list[list[PolicyFile]] = []
    errors: list[PolicyError] = []
    loader_nodes = _data_nodes(text)
    for number, doc in enumerate(manifests):
        if doc.value.get("kind") != "ConfigMap":
            continue
        data = doc.value.get("data") or {}
        if not isinstance(data, dict):
            errors.append(
                PolicyError(str(path), doc.line_of("/data"), "/data", "expected a mapping")
            )
            continue
        name = (doc.value.get("metadata") or {}).get("name", f"document {number + 1}")
        group = []
        for key in sorted(data):
            if not str(key).endswith(POLICY_SUFFIXES) or str(key).startswith("."):
                continue
            value = data[key]
            if not isinstance(value, str):
                errors.append(
                    PolicyError(
                        str(path),
                        doc.line_of(f"/data/{key}"),
                        f"/data/{key}",
                        "a ConfigMap data value must be a string",
                    )
                )
                continue
            offset = loader_nodes.get((doc.lines[""], str(key)))
            group.append(PolicyFile(str(key), value.encode(), f"{path}[{name}/{key}]", offset))
        groups.append(group)
    return groups, errors


def _data_nodes(text: str) -> dict[tuple[int, str], int | None]:
    """Line offsets of literal-block `data` values: (document's first line, key) -> offset."""
    offsets: dict[tuple[int, str], int | None] = {}
    for node in yaml.compose_all(text, Loader=yaml.SafeLoader):
        if not isinstance(node, yaml.MappingNode):
            continue
        first = node.start_mark.line + 1
        for key_node, value_node in node.value:
            if key_node.value != "data" or not isinstance(value_node, yaml.MappingNode):
                continue
            for data_key, data_value in value_node.value:
                literal = isinstance(data_value, yaml.ScalarNode) and data_value.style == "|"
                offsets[(first, str(data_key.value))] = (
                    data_value.start_mark.line + 1 if literal else None
                )
    return offsets


def validate_paths(
    paths: Sequence[Path], *, environ: Mapping[str, str] | None = None
) -> list[PolicyError]:
    """Every error in the given policy directories, policy files and ConfigMap manifests.

    Offline and side-effect free: `nvsharectl policy validate PATH...`. A directory is checked as
    the daemon would load it; a single file as a directory holding only it; a manifest's
    ConfigMaps each as the directory kubelet would mount. Environment overrides are not applied
    unless `environ` is given.
    """
    environ = {} if environ is None else environ
    errors: list[PolicyError] = []
    for raw in paths:
        path = Path(raw)
        snapshots: list[PolicySnapshot] = []
        if path.is_dir():
            snapshots.append(read_policy_dir(path, label_prefix=f"{path}/"))
        else:
            try:
                content = path.read_bytes()
            except OSError as e:
                errors.append(PolicyError(str(path), None, "", f"cannot read: {e.strerror}"))
                continue
            found = None
            if path.suffix in (".yaml", ".yml"):
                try:
                    found = _configmap_files(path, content.decode("utf-8"))
                except UnicodeDecodeError:
                    found = None
            if found is None:
                f = PolicyFile(path.name, content, str(path))
                snapshots.append(PolicySnapshot(str(path), (f,), (), _content_hash((f,))))
            else:
                groups, manifest_errors = found
                errors += manifest_errors
                if not groups and not manifest_errors:
                    errors.append(
                        PolicyError(
                            str(path), None, "", "holds Kubernetes manifests but no ConfigMap"
                        )
                    )
                for group in groups:
                    snapshots.append(
                        PolicySnapshot(str(path), tuple(group), (), _content_hash(group))
                    )
        for snapshot in snapshots:
            try:
                build_policy(snapshot, environ=environ)
            except PolicyLoadError as e:
                errors += e.errors
    return errors
