"""The architecture stays as docs/architecture.md draws it.

The layer contracts (import-linter, in pyproject.toml, run by `make test`) cannot go stale:
their module lists name every module of the package, so a new one is placed deliberately. And
every unit stays one a newcomer can hold in their head: modules of about 400 lines at most,
functions that fit on a screen.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
# The composition roots and the package's own entry points: the only places above every layer.
TOP = {"appliance", "appliance.__main__", "appliance.cli", "appliance.cli.nvshare_scheduler"}


def sources() -> list[Path]:
    return [p for p in (ROOT / "appliance").rglob("*.py") if "_generated" not in p.parts]


def modules() -> set[str]:
    names = set()
    for path in sources():
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def contract(contract_id: str) -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (found,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == contract_id]
    return dict(found)


def covered(name: str, listed: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in listed)


def test_the_core_contract_forbids_every_module_outside_the_core() -> None:
    allowed = ["appliance.core", "appliance.policy.model", "appliance.policy.quantity"]
    forbidden = contract("core")["forbidden_modules"]
    outside = {m for m in modules() - TOP if not covered(m, allowed) and m != "appliance.policy"}
    assert {m for m in outside if not covered(m, forbidden)} == set()
    assert "appliance.daemon" in forbidden


def test_every_module_but_the_program_is_kept_from_the_daemon() -> None:
    sources = contract("root")["source_modules"]
    assert {
        m
        for m in modules() - TOP - {"appliance.daemon", "appliance.daemon.daemon"}
        if not covered(m, sources)
    } == set()


def test_modules_and_functions_fit_in_a_head() -> None:
    long_modules, long_functions = [], []
    for path in sources():
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.name}")
    assert long_modules == [] and long_functions == []
