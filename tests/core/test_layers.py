"""Layers only point down: the sans-I/O core imports no source, sink or wiring module."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "appliance" / "core"
FORBIDDEN = (
    "appliance.protocol",
    "appliance.engine",
    "appliance.server",
    "appliance.client",
    "appliance.daemon",
    "appliance.cli",
    "appliance.metrics",
    "appliance.host",
    "appliance.kube",
    "appliance.gpu",
    "appliance.policy.watch",
    "appliance.policy.load",
)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_core_imports_no_io_module() -> None:
    offenders = {
        f"{path.name}: {name}"
        for path in CORE.glob("*.py")
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN)
    }
    assert not offenders
    io_modules = {"socket", "asyncio", "threading", "subprocess", "time", "os"}
    for path in CORE.glob("*.py"):
        assert not imported_modules(path) & io_modules, path.name
