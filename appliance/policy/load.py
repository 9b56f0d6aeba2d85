"""Policy directory to `Policy`: read, check each file, merge, check the whole, build.

Over the built-in defaults (the schema's `default` values), then environment overrides on top.
Every file is validated against the schema on its own (so errors name the file and line it was
written on), and the merged result is validated again, with cross-field checks. All errors, of
all files, are collected before `PolicyLoadError` is raised. The same code validates offline:
`validate_paths` backs `nvsharectl policy validate`, and also reads ConfigMap manifests.

The parts: `files` (reading), `parse` (text to values, with lines), `messages` (schema errors a
user can act on), `checks` (what the schema cannot say), `merge` (with provenance), `build`
(the typed policy, one builder per section).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.policy import model, schema
from appliance.policy.build import to_policy
from appliance.policy.checks import merged_problems, value_problems
from appliance.policy.env import env_overrides
from appliance.policy.errors import PolicyError, PolicyLoadError
from appliance.policy.files import (
    ManifestContents,
    PolicyFile,
    PolicySnapshot,
    configmap_files,
    content_hash,
    read_policy_dir,
)
from appliance.policy.merge import Merge
from appliance.policy.messages import schema_problems
from appliance.policy.parse import ParsedDocument, parse_policy_text

__all__ = [
    "PolicyError",
    "PolicyLoadError",
    "Validation",
    "build_policy",
    "check_paths",
    "load_policy_dir",
    "validate_paths",
]

MAX_RULES = 10_000  # every client's limits are resolved against every rule
MAX_GPU_ENTRIES = 1_024
_LIST_BOUNDS = {"rules": MAX_RULES, "gpus": MAX_GPU_ENTRIES}


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
    problems = schema_problems(doc.value)
    if isinstance(doc.value, dict):
        problems += value_problems(doc.value, skip=(path for path, _ in problems))
    errors += [error(doc.line_of(path), path, message) for path, message in problems]
    errors.sort(key=lambda e: e.line if e.line is not None else 0)  # stable: schema order
    return doc, errors


def build_policy(
    snapshot: PolicySnapshot, *, environ: Mapping[str, str] | None = None
) -> model.Policy:
    """Validate and merge what was read; raise `PolicyLoadError` with every error found."""
    environ = os.environ if environ is None else environ
    errors = list(snapshot.errors)
    merge = Merge()
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
    problems = schema_problems(rest)
    if not problems:
        problems = value_problems(rest) + merged_problems(merge.value, merge)
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
    return to_policy(merge.value, merge, snapshot)


def load_policy_dir(path: Path, *, environ: Mapping[str, str] | None = None) -> model.Policy:
    """The policy a directory says, over the built-in defaults, with environment overrides.

    An empty directory (or one whose files were all removed) gives the built-in defaults.
    Raises `PolicyLoadError` carrying every `PolicyError` found in every file.
    """
    return build_policy(read_policy_dir(Path(path)), environ=environ)


# --- offline validation ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Validation:
    """What `nvsharectl policy validate` found: every error, and what it skipped as no policy
    (one line each: the objects of a rendered `deploy/` that are not policy ConfigMaps)."""

    errors: list[PolicyError]
    skipped: list[str]


STDIN = "-"  # the path that means standard input

# What one path holds: the directories the daemon would read, the errors found reading it, and
# what was skipped as no policy.
Found = tuple[list[PolicySnapshot], list[PolicyError], list[str]]


def validate_paths(
    paths: Sequence[Path | str],
    *,
    environ: Mapping[str, str] | None = None,
    stdin: bytes = b"",
) -> list[PolicyError]:
    """Every error in the given policy directories, policy files and ConfigMap manifests."""
    return check_paths(paths, environ=environ, stdin=stdin).errors


def check_paths(
    paths: Sequence[Path | str],
    *,
    environ: Mapping[str, str] | None = None,
    stdin: bytes = b"",
) -> Validation:
    """Check the given policy directories, policy files and manifests; `-` is `stdin`.

    Offline and side-effect free: `nvsharectl policy validate PATH...`. A directory is checked as
    the daemon would load it, or, when every policy-named file in it is a Kubernetes manifest
    (`configmaps/examples/`), each file as a manifest; a single file as a directory holding
    only it; a manifest's policy ConfigMaps each as the directory kubelet would mount, skipping
    (and saying so) every other object. Environment overrides are not applied unless `environ`
    is given.
    """
    environ = {} if environ is None else environ
    errors: list[PolicyError] = []
    skipped: list[str] = []
    for raw in paths:
        if str(raw) == STDIN:
            snapshots, read_errors, passed = _text_snapshots("<stdin>", stdin)
        else:
            snapshots, read_errors, passed = _snapshots(Path(raw))
        errors += read_errors
        skipped += passed
        for snapshot in snapshots:
            try:
                build_policy(snapshot, environ=environ)
            except PolicyLoadError as e:
                errors += e.errors
    return Validation(errors, skipped)


def _snapshots(path: Path) -> Found:
    if path.is_dir():
        manifests = _manifest_directory(path)
        if manifests is None:
            return [read_policy_dir(path, label_prefix=f"{path}/")], [], []
        return (
            [s for found in manifests for s in found[0]],
            [e for found in manifests for e in found[1]],
            [x for found in manifests for x in found[2]],
        )
    try:
        content = path.read_bytes()
    except OSError as e:
        return [], [PolicyError(str(path), None, "", f"cannot read: {e.strerror}")], []
    if path.suffix not in (".yaml", ".yml"):
        f = PolicyFile(path.name, content, str(path))
        return [PolicySnapshot(str(path), (f,), (), content_hash((f,)))], [], []
    return _text_snapshots(str(path), content, name=path.name)


def _manifest_directory(path: Path) -> list[Found] | None:
    """Each file of a directory of manifests, read as a manifest; None for a policy directory
    (one whose files include a policy file, or that cannot be read whole)."""
    snapshot = read_policy_dir(path, label_prefix=f"{path}/")
    if not snapshot.files or snapshot.errors:
        return None
    found = []
    for f in snapshot.files:
        if not f.name.endswith((".yaml", ".yml")):
            return None
        try:
            manifest = configmap_files(f.label, f.content.decode("utf-8"))
        except UnicodeDecodeError:
            return None
        if manifest is None:
            return None
        found.append(_manifest_snapshots(f.label, manifest))
    return found


def _text_snapshots(label: str, content: bytes, *, name: str = "-") -> Found:
    """A manifest stream's policy ConfigMaps, else the text as one policy file."""
    try:
        manifest = configmap_files(label, content.decode("utf-8"))
    except UnicodeDecodeError:
        manifest = None
    if manifest is None:
        f = PolicyFile(name, content, label)
        return [PolicySnapshot(label, (f,), (), content_hash((f,)))], [], []
    return _manifest_snapshots(label, manifest)


def _manifest_snapshots(label: str, manifest: ManifestContents) -> Found:
    errors = manifest.errors
    if not manifest.groups and not errors:
        errors = [
            PolicyError(label, None, "", "holds Kubernetes manifests but no policy ConfigMap")
        ]
    snapshots = [PolicySnapshot(label, tuple(g), (), content_hash(g)) for g in manifest.groups]
    return snapshots, errors, manifest.skipped
