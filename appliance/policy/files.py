"""Reading policy files: a directory (conf.d style), or the ConfigMaps of a manifest.

Every `*.yaml`, `*.yml` and `*.json` file of the directory, in file-name order; hidden names are
skipped, which also skips kubelet's `..data` and `..2026_...` entries of a mounted ConfigMap: its
visible files are symlinks through `..data` and are followed like any other file. Reading is
bounded (a file larger than a ConfigMap can hold is refused) and never blocks on a FIFO; a name
whose symlink dangles means the directory is in flux, not that the file was removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from appliance.policy.errors import PolicyError
from appliance.policy.parse import ParsedDocument, parse_yaml_documents

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


def content_hash(files: Iterable[PolicyFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        for part in (f.name.encode(), f.content):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


MAX_FILE_BYTES = 1 << 20  # what one ConfigMap can hold; a policy is kilobytes


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
        return PolicySnapshot(directory, (), (err,), content_hash(()), missing=True)
    except NotADirectoryError:
        err = PolicyError(directory, None, "", "is not a directory (give the policy directory)")
        return PolicySnapshot(directory, (), (err,), content_hash(()))
    except OSError as e:
        err = PolicyError(directory, None, "", f"cannot list the policy directory: {e.strerror}")
        return PolicySnapshot(directory, (), (err,), content_hash(()))
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
        directory, tuple(files), tuple(errors), content_hash(files), dangling=tuple(dangling)
    )


@dataclass(frozen=True, slots=True)
class ManifestContents:
    """What a stream of Kubernetes manifests holds for policy: the policy files of each policy
    ConfigMap (one group per ConfigMap, as kubelet would mount it), the errors in reading them,
    and what was skipped as no policy at all, one line each."""

    groups: list[list[PolicyFile]]
    errors: list[PolicyError]
    skipped: list[str]


# A ConfigMap so labelled is one of nvshare's, but not its policy (the scheduler extender's
# KubeSchedulerConfiguration): `kubectl kustomize deploy/` renders both.
_COMPONENT_LABEL = "app.kubernetes.io/component"
# A data value that is itself a Kubernetes-style object (a KubeSchedulerConfiguration, a
# kubeconfig) is some program's configuration, not a policy file. Judged from its text: a
# ConfigMap's value is not parsed twice for a question this small.
_OBJECT_KEYS = (
    re.compile(r'^(apiVersion|"apiVersion")\s*:', re.M),
    re.compile(r'^(kind|"kind")\s*:', re.M),
)


def configmap_files(path: str, text: str) -> ManifestContents | None:
    """The policy files of each ConfigMap in a manifest (a multi-document stream too); None if
    the text is not Kubernetes manifests. Errors name `PATH: data[KEY]:LINE` (with the
    ConfigMap's name before `data` where the stream holds several)."""
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
    found = ManifestContents([], [], [])
    loader_nodes = _data_nodes(text)
    configmaps = sum(1 for d in manifests if d.value.get("kind") == "ConfigMap")
    others: list[str] = []
    for number, doc in enumerate(manifests):
        name = str((doc.value.get("metadata") or {}).get("name", f"document {number + 1}"))
        if doc.value.get("kind") != "ConfigMap":
            others.append(f"{doc.value.get('kind')} {name}")
            continue
        where = f"{path}: " if configmaps == 1 else f"{path}: {name} "
        _read_configmap(doc, path=path, name=name, where=where, nodes=loader_nodes, into=found)
    if others:
        found.skipped.append(f"{path}: skipped what is not a ConfigMap: {', '.join(others)}")
    return found


def _read_configmap(
    doc: ParsedDocument,
    *,
    path: str,
    name: str,
    where: str,
    nodes: dict[tuple[int, str], int | None],
    into: ManifestContents,
) -> None:
    """One ConfigMap's policy files as a group in `into`, or why it holds none."""
    component = ((doc.value.get("metadata") or {}).get("labels") or {}).get(_COMPONENT_LABEL)
    if component not in (None, "policy"):
        into.skipped.append(
            f"{path}: skipped ConfigMap {name}: labelled {_COMPONENT_LABEL}={component}, not policy"
        )
        return
    data = doc.value.get("data") or {}
    if not isinstance(data, dict):
        into.errors.append(PolicyError(path, doc.line_of("/data"), "/data", "expected a mapping"))
        return
    group, not_policy = [], []
    for key in sorted(data):
        if not str(key).endswith(POLICY_SUFFIXES) or str(key).startswith("."):
            continue
        value = data[key]
        label = f"{where}data[{key}]"
        if not isinstance(value, str):
            line = doc.line_of(f"/data/{key}")
            into.errors.append(
                PolicyError(label, line, "", "a ConfigMap data value must be a string")
            )
        elif all(pattern.search(value) for pattern in _OBJECT_KEYS):
            not_policy.append(str(key))
        else:
            offset = nodes.get((doc.lines[""], str(key)))
            group.append(PolicyFile(str(key), value.encode(), label, offset))
    if not_policy:
        into.skipped.append(
            f"{path}: skipped {', '.join(not_policy)} of ConfigMap {name}: a Kubernetes object "
            "(apiVersion, kind), not a policy file"
        )
    if group:
        into.groups.append(group)
    elif not not_policy:
        into.skipped.append(
            f"{path}: skipped ConfigMap {name}: no .yaml, .yml or .json key in its data"
        )


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
