"""Policy text to Python values, with the line of every JSON path, so errors can say where.

PyYAML's safe loader follows YAML 1.1, where an unquoted `on`, `off`, `yes` or `no` is a boolean.
`mode: on` is the most natural thing to write in a policy, so this loader resolves booleans the
YAML 1.2 way (only true/false) and everything else stays a string. Duplicate keys, which PyYAML
silently lets the last one win, are reported instead.

A policy is untrusted text read by a long-running daemon, so reading it is bounded: a file nested
deeper than `MAX_DEPTH` (PyYAML's composer and every walk after it recurse) or holding more than
`MAX_VALUES` values once YAML aliases are expanded (a few hundred bytes of aliases can stand for
billions of values) is refused with a message naming the bound, before anything is built. The
bounds are checked on the parser's event stream, which is iterative. libyaml's parser is used
where PyYAML has it: it reads a large policy about ten times faster than the pure-Python one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

MAX_DEPTH = 16  # the deepest field of a policy (/rules/0/match/podLabels/KEY) is 5 levels down
MAX_VALUES = 500_000  # about what a 1 MiB file can hold without aliases

_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class PolicyYamlLoader(_SafeLoader):  # type: ignore[valid-type,misc]
    """SafeLoader (libyaml's where available) with YAML 1.2 booleans."""


PolicyYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
PolicyYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong found while parsing: a line (1-based) if known, a JSON path, a message."""

    line: int | None
    json_path: str
    message: str


class TooBig(ValueError):
    """A document past `MAX_DEPTH` or `MAX_VALUES`; the message names the bound."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line  # 1-based, where the parser was when the bound was passed


@dataclass(slots=True)
class ParsedDocument:
    """One YAML/JSON document: its value and the line of each JSON path in it."""

    value: Any
    lines: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    node: yaml.Node | None = None  # YAML only: the composed node, for manifests' line offsets

    def line_of(self, json_path: str) -> int | None:
        """The line of the path, or of its nearest ancestor that has one."""
        path = json_path
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path.rsplit("/", 1)[0]


def escape_pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _map_lines(node: yaml.Node, path: str, doc: ParsedDocument, line_offset: int) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = f"{path}/{escape_pointer(key)}"
            line = key_node.start_mark.line + 1 + line_offset
            if key in seen:
                doc.problems.append(Problem(line, child, f"duplicate key {key!r}"))
            seen.add(key)
            doc.lines.setdefault(child, line)
            _map_lines(value_node, child, doc, line_offset)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = f"{path}/{index}"
            doc.lines[child] = item.start_mark.line + 1 + line_offset
            _map_lines(item, child, doc, line_offset)


@dataclass(slots=True)
class _Frame:
    anchor: str | None
    first_value: int  # the value count when this collection started
    height: int = 0  # of its deepest child so far


@dataclass(slots=True)
class _Bounds:
    """How deep and how large a YAML event stream is so far, aliases expanded."""

    stack: list[_Frame] = field(default_factory=list)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # anchor -> (values, height)
    values: int = 0
    line: int = 0

    def see(self, event: yaml.Event) -> None:
        anchor = getattr(event, "anchor", None)
        if isinstance(event, yaml.AliasEvent):
            count, height = self.sizes.get(str(anchor), (1, 0))
            self.values += count
            self._child(height)
        elif isinstance(event, yaml.ScalarEvent):
            self.values += 1
            if anchor is not None:
                self.sizes[anchor] = (1, 0)
            self._child(0)
        elif isinstance(event, yaml.CollectionStartEvent):
            self.values += 1
            self._child(1)
            self.stack.append(_Frame(anchor, self.values - 1))
        elif isinstance(event, yaml.CollectionEndEvent):
            frame = self.stack.pop()
            height = frame.height + 1
            if frame.anchor is not None:
                self.sizes[frame.anchor] = (self.values - frame.first_value, height)
            self._child(height)

    def _child(self, height: int) -> None:
        if len(self.stack) + height > MAX_DEPTH:
            raise TooBig(
                f"nested deeper than {MAX_DEPTH} levels (a policy needs at most 5)", self.line
            )
        if self.values > MAX_VALUES:
            raise TooBig(
                f"holds more than {MAX_VALUES:,} values once YAML aliases are expanded; "
                "write the repeated parts out, or split the policy",
                self.line,
            )
        if self.stack:
            self.stack[-1].height = max(self.stack[-1].height, height)


def check_bounds(text: str) -> None:
    """Raise `TooBig` if the YAML stream, aliases expanded, is too deep or holds too much."""
    loader = PolicyYamlLoader(text)
    bounds = _Bounds()
    try:
        while loader.check_event():
            event = loader.get_event()
            bounds.line = event.start_mark.line + 1
            bounds.see(event)
    finally:
        loader.dispose()


def parse_yaml_documents(text: str, *, line_offset: int = 0) -> list[ParsedDocument]:
    """Every document of a YAML stream; raises `yaml.YAMLError` (with a mark) on bad syntax
    and `TooBig` past the bounds."""
    check_bounds(text)
    loader = PolicyYamlLoader(text)
    docs: list[ParsedDocument] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                break
            doc = ParsedDocument(
                loader.construct_document(node),
                {"": node.start_mark.line + 1 + line_offset},
                node=node,
            )
            _map_lines(node, "", doc, line_offset)
            docs.append(doc)
    finally:
        loader.dispose()
    return docs


def _json_shape_problem(value: Any) -> str | None:
    """Depth and size bounds for a parsed JSON document (no aliases there)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    count = 0
    while pending:
        item, depth = pending.pop()
        count += 1
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels (a policy needs at most 5)"
        if count > MAX_VALUES:
            return f"holds more than {MAX_VALUES:,} values"
        if isinstance(item, dict):
            pending.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            pending.extend((v, depth + 1) for v in item)
    return None


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _refused(line: int | None, message: str) -> ParsedDocument:
    return ParsedDocument(None, problems=[Problem(line, "", message)])


def parse_policy_text(text: str, *, is_json: bool, line_offset: int = 0) -> ParsedDocument:
    """One policy document. Syntax problems come back in `problems`, never as an exception.

    An empty file is an empty policy ({}), so a drop-in can be emptied to switch it off.
    """
    if is_json:
        return _parse_json(text, line_offset)
    try:
        docs = parse_yaml_documents(text, line_offset=line_offset)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 + line_offset if mark is not None else None
        what = " ".join(p for p in (e.context, e.problem) if p)
        return _refused(line, f"not valid YAML: {what}")
    except yaml.YAMLError as e:
        return _refused(None, f"not valid YAML: {e}")
    except TooBig as e:
        return _refused(None if e.line is None else e.line + line_offset, str(e))
    if not docs:
        return ParsedDocument({}, {"": 1 + line_offset})
    if len(docs) > 1:
        second = min((line for path, line in docs[1].lines.items()), default=None)
        return _refused(second, "a policy file holds one YAML document, found several")
    doc = docs[0]
    if doc.value is None:
        doc.value = {}
    return doc


def _parse_json(text: str, line_offset: int) -> ParsedDocument:
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicates) if text.strip() else {}
    except json.JSONDecodeError as e:
        return _refused(e.lineno + line_offset, f"not valid JSON: {e.msg}")
    except RecursionError:
        return _refused(None, f"nested deeper than {MAX_DEPTH} levels (a policy needs at most 5)")
    except ValueError as e:
        return _refused(None, f"not valid JSON: {e}")
    if (problem := _json_shape_problem(value)) is not None:
        return _refused(None, problem)
    doc = ParsedDocument(value)
    try:  # JSON is (almost always) YAML: borrow the YAML composer for line numbers
        doc.lines = parse_yaml_documents(text, line_offset=line_offset)[0].lines
    except (yaml.YAMLError, TooBig, IndexError):
        doc.lines = {}
    return doc
