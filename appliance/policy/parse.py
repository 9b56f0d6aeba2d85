"""Policy text to Python values, with the line of every JSON path, so errors can say where.

PyYAML's safe loader follows YAML 1.1, where an unquoted `on`, `off`, `yes` or `no` is a boolean.
`mode: on` is the most natural thing to write in a policy, so this loader resolves booleans the
YAML 1.2 way (only true/false) and everything else stays a string. Duplicate keys, which PyYAML
silently lets the last one win, are reported instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml


class PolicyYamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans."""


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


@dataclass(slots=True)
class ParsedDocument:
    """One YAML/JSON document: its value and the line of each JSON path in it."""

    value: Any
    lines: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

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


def parse_yaml_documents(text: str, *, line_offset: int = 0) -> list[ParsedDocument]:
    """Every document of a YAML stream; raises `yaml.YAMLError` (with a mark) on bad syntax."""
    loader = PolicyYamlLoader(text)
    docs: list[ParsedDocument] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                break
            doc = ParsedDocument(
                loader.construct_document(node), {"": node.start_mark.line + 1 + line_offset}
            )
            _map_lines(node, "", doc, line_offset)
            docs.append(doc)
    finally:
        loader.dispose()
    return docs


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_policy_text(text: str, *, is_json: bool, line_offset: int = 0) -> ParsedDocument:
    """One policy document. Syntax problems come back in `problems`, never as an exception.

    An empty file is an empty policy ({}), so a drop-in can be emptied to switch it off.
    """
    if is_json:
        try:
            value = json.loads(text, object_pairs_hook=_reject_duplicates) if text.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedDocument(
                None, problems=[Problem(e.lineno + line_offset, "", f"not valid JSON: {e.msg}")]
            )
        except ValueError as e:
            return ParsedDocument(None, problems=[Problem(None, "", f"not valid JSON: {e}")])
        doc = ParsedDocument(value)
        try:  # JSON is (almost always) YAML: borrow the YAML composer for line numbers
            doc.lines = parse_yaml_documents(text, line_offset=line_offset)[0].lines
        except (yaml.YAMLError, IndexError):
            doc.lines = {}
        return doc
    try:
        docs = parse_yaml_documents(text, line_offset=line_offset)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 + line_offset if mark is not None else None
        what = " ".join(p for p in (e.context, e.problem) if p)
        return ParsedDocument(None, problems=[Problem(line, "", f"not valid YAML: {what}")])
    except yaml.YAMLError as e:
        return ParsedDocument(None, problems=[Problem(None, "", f"not valid YAML: {e}")])
    if not docs:
        return ParsedDocument({}, {"": 1 + line_offset})
    if len(docs) > 1:
        second = min((line for path, line in docs[1].lines.items()), default=None)
        return ParsedDocument(
            None,
            problems=[Problem(second, "", "a policy file holds one YAML document, found several")],
        )
    doc = docs[0]
    if doc.value is None:
        doc.value = {}
    return doc
