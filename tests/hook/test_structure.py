"""The hook's files by concern: each module includes only the headers of modules below it (no
include cycle, so no call cycle through headers), and the real driver is reached one way only
(NVS_CALL through the dispatch table)."""

from __future__ import annotations

import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

LD_HOOK = Path(__file__).resolve().parents[2] / "ld_hook"
# Shared definitions, not modules: every layer may include them.
DEFINITIONS = {"nvshare", "nvshare_proto", "cuda_api", "cuda_min", "copies"}


def module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted([*LD_HOOK.glob("*.c"), *LD_HOOK.glob("*.h")]):
        module = path.stem
        included = set(re.findall(r'^#include "(\w+)\.h"', path.read_text(), re.M))
        graph.setdefault(module, set()).update(included - DEFINITIONS - {module})
    return graph


def test_modules_form_layers_without_cycles() -> None:
    graph = module_graph()
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"include cycle between hook modules: {exc.args[1]}") from None
    # the layers the design names, bottom to top
    for low, high in [
        ("log", "config"),
        ("dispatch", "gpus"),
        ("gpus", "contexts"),
        ("contexts", "capture"),
        ("conn", "gate"),
        ("frames", "conn"),
        ("dial", "conn"),
        ("marks", "gate"),
        ("conn", "ledger"),
        ("ledger", "pools"),
        ("pools", "alloc"),
        ("gate", "session"),
        ("session", "lifecycle"),
    ]:
        assert order.index(low) < order.index(high), (low, high)
    assert "session" not in graph["conn"] and "gate" not in graph["conn"]
    assert "ledger" not in graph["gate"] and "gate" not in graph["ledger"]


def test_the_real_driver_is_called_one_way() -> None:
    for path in LD_HOOK.glob("*.c"):
        if path.name == "dispatch.c":
            continue
        text = path.read_text()
        for banned in ("dlsym(", "dlopen(", "nvs_resolve(", "NVS_REAL("):
            assert banned not in text, f"{path.name} calls {banned} instead of NVS_CALL"
