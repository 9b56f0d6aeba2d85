"""The architecture stays as docs/architecture.md draws it.

The import rules (import-linter, in pyproject.toml, run by `make lint`) cannot go stale: every
package of the appliance sits in one layer, so a new one is placed deliberately, and no module
imports, even for typing only, a module that imports it back. And every unit stays one a
newcomer can hold in their head: modules of about 400 lines at most, functions that fit on a
screen.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")
grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
# The package's own entry point, above every layer.
TOP = {"appliance", "appliance.__main__"}


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


def layered(contract_id: str) -> set[str]:
    """Every name the layers of a contract list, with its container."""
    found = contract(contract_id)
    names = {n.strip() for layer in found["layers"] for n in layer.replace(":", "|").split("|")}
    containers = found.get("containers", [""])
    return {f"{c}.{n}" if c else n for c in containers for n in names}


def test_every_package_of_the_appliance_sits_in_a_layer() -> None:
    packages = {".".join(m.split(".")[:2]) for m in modules() - TOP}
    assert packages - layered("layers") == set()


def test_the_daemons_wiring_names_every_module_under_its_composition_root() -> None:
    wiring = {m for m in modules() if m.startswith("appliance.daemon.")}
    assert wiring - layered("root") == set()


def test_the_core_contract_forbids_every_policy_module_but_the_model_and_quantities() -> None:
    allowed = {"appliance.policy", "appliance.policy.model", "appliance.policy.quantity"}
    policy = {m for m in modules() if m.split(".")[:2] == ["appliance", "policy"]}
    assert policy - allowed - set(contract("core")["forbidden_modules"]) == set()


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("appliance", cache_dir=None)
    circles = [
        (a, b)
        for a in sorted(graph.modules)
        for b in graph.find_modules_directly_imported_by(a)
        if a < b and graph.chain_exists(importer=b, imported=a)
    ]
    assert circles == []


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
