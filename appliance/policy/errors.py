"""The errors a policy can have, in a form a user can act on (file, line, JSON path, message).

Kept apart from the loader so the environment parser, the watcher and the CLI can share them
without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PolicyError:
    """One problem: `10-team.yaml:12: /rules/0/memoryLimit: '4Gx' is not a size`.

    `file` is a file name (or "env NAME" for an environment override, or a manifest and its
    ConfigMap key); `line` is 1-based where the text gives one; `json_path` is a JSON pointer
    into that file's document ("" for the whole file).
    """

    file: str
    line: int | None
    json_path: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return (
            f"{where}: {self.json_path}: {self.message}"
            if self.json_path
            else f"{where}: {self.message}"
        )


class PolicyLoadError(Exception):
    """A policy that cannot be used; `errors` holds every problem found, across all files."""

    def __init__(self, errors: Sequence[PolicyError], *, where: str = "policy") -> None:
        self.errors: list[PolicyError] = list(errors)
        self.where = where
        count = len(self.errors)
        lines = "\n".join(f"  {e}" for e in self.errors)
        super().__init__(f"{where}: {count} error{'s' if count != 1 else ''}:\n{lines}")
