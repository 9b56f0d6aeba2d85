"""The policy JSON Schema, loaded once, and the facts other modules derive from it.

`schema/policy.schema.json` is the single definition of what a policy file may say. The loader
validates against it, the built-in defaults are read from its `default` keywords (so the schema,
the README reference and the loader cannot disagree about a default), and the README test walks
its property paths. The file lives inside the package, so every install (wheel, image) carries it;
`schema/policy.schema.json`, the path the docs name, is a link to it.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]

SCHEMA_FILE = Path(__file__).with_name("policy.schema.json")

# Arrays whose items are objects with their own properties; every other array is a value.
ITEM_ARRAYS = ("/rules", "/gpus")


@functools.cache
def policy_schema() -> dict[str, Any]:
    with SCHEMA_FILE.open(encoding="utf-8") as f:
        schema: dict[str, Any] = json.load(f)
    return schema


@functools.cache
def validator() -> jsonschema.Draft202012Validator:
    # Local $refs inlined: resolving them costs a third of validating a 10,000-rule policy.
    return jsonschema.Draft202012Validator(_inline(policy_schema()))


def _inline(node: Any) -> Any:
    if isinstance(node, list):
        return [_inline(item) for item in node]
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$ref"), str):
        node = _resolve(node)
    return {key: _inline(value) for key, value in node.items()}


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        target: dict[str, Any] = policy_schema()["$defs"][ref.removeprefix("#/$defs/")]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def iter_properties(
    node: dict[str, Any] | None = None, prefix: str = ""
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property of the schema as (path, schema), depth first; array items appear as '*'.

    Paths look like "/scheduler/timeQuantum" and "/rules/*/match/podName".
    """
    node = policy_schema() if node is None else _resolve(node)
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}/{name}"
        yield path, sub
        yield from iter_properties(sub, path)
        items = sub.get("items")
        if isinstance(items, dict) and "properties" in items:
            yield from iter_properties(items, f"{path}/*")


def value_kind(sub: dict[str, Any]) -> str | None:
    """The kind ("size" or "duration") of a property that holds one, even nullable; else None."""
    for node in (sub, *sub.get("anyOf", [])):
        title = _resolve(node).get("title")
        if title in ("size", "duration"):
            return str(title)
    return None


def default_document() -> dict[str, Any]:
    """The built-in policy: every object property's `default`, filled in recursively."""

    def fill(node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, sub in node.get("properties", {}).items():
            sub = _resolve(sub)
            if sub.get("type") == "object" and "properties" in sub:
                out[name] = fill(sub)
            elif "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
        return out

    return fill(policy_schema())


def type_label(sub: dict[str, Any]) -> str:
    """A short human type for the reference table ("size", "duration", "integer 1-100", ...)."""
    node = _resolve(sub)
    if "title" in node and node["title"] in ("size", "duration"):
        nullable = any(b.get("type") == "null" for b in node.get("anyOf", []))
        return str(node["title"]) + (" or null" if nullable else "")
    if "anyOf" in node:
        labels = [type_label(b) for b in node["anyOf"]]
        return " or ".join(lab for lab in labels if lab != "null") + " or null"
    if "enum" in node:
        return " \\| ".join(str(v) for v in node["enum"])
    if "const" in node:
        return f"const {node['const']}"
    kind = node.get("type", "")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if node.get("type") == "integer" and "minimum" in node and "maximum" in node:
        return f"integer {node['minimum']}-{node['maximum']}"
    if kind == "array" and isinstance(node.get("items"), dict):
        inner = node["items"]
        if inner.get("type") == "array":
            return "list of lists of strings"
        return "list of objects" if "properties" in inner else "list"
    if kind == "object" and "properties" not in node:
        return "map of strings"
    return str(kind)
