"""Merging policy files with provenance: which file set each value, and where each list item
came from.

Objects merge key by key and a later file's value replaces an earlier one's; `rules` and `gpus`
concatenate (file-name order, then order inside each file); every other list
(`migFallback.chains`) is one value and is replaced whole. Environment overrides are set last.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from appliance.policy import schema
from appliance.policy.parse import escape_pointer


def _record(value: Any, path: str, source: str, sources: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _record(sub, f"{path}/{escape_pointer(str(key))}", source, sources)
    elif isinstance(value, list) and path in schema.ITEM_ARRAYS and value:
        for index, sub in enumerate(value):
            _record(sub, f"{path}/{index}", source, sources)
    else:
        sources[path] = source


class Merge:
    """The merged document, which file set each value, and where each list item came from."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = schema.default_document()
        self.sources: dict[str, str] = {}
        self.items: dict[str, tuple[str, str]] = {}  # "/rules/3" -> ("20-b.yaml", "/rules/1")
        # "/scheduler/timeQuantum" -> ["00-default.yaml"]: earlier files whose value for that
        # path a later file (or the environment) replaced, oldest first; `policy explain`.
        self.overridden: dict[str, list[str]] = {}
        _record(self.value, "", "default", self.sources)

    def _forget(self, path: str, *, by: str = "") -> None:
        for key in [k for k in self.sources if k == path or k.startswith(path + "/")]:
            earlier = self.sources.pop(key)
            inherited = self.overridden.pop(key, [])
            if by and earlier not in ("default", by):
                losers = self.overridden.setdefault(path, [])
                losers.extend(f for f in [*inherited, earlier] if f not in losers)

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
                self._forget(child, by=source)
                target[key] = copy.deepcopy(value)
                _record(value, child, source, self.sources)

    def set(self, json_path: str, value: Any, source: str) -> None:
        *parents, last = json_path.strip("/").split("/")
        node = self.value
        for part in parents:
            node = node[part]
        node[last] = value
        self._forget(json_path, by=source)
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
