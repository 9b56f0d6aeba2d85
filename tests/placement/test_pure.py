"""The placement decisions are pure: no client, socket, thread, clock or file behind them."""

from __future__ import annotations

from pathlib import Path

from core.test_layers import imported_modules

PLACEMENT = Path(__file__).resolve().parents[2] / "appliance" / "placement"
PURE_KUBE = {"appliance.kube.resources", "appliance.kube.resources.pod_request"}


def test_placement_imports_nothing_that_does_io() -> None:
    forbidden = ("appliance.kube", "appliance.gpu", "appliance.server", "appliance.daemon")
    io_modules = {"socket", "asyncio", "threading", "subprocess", "time", "os", "kubernetes"}
    for path in PLACEMENT.glob("*.py"):
        names = imported_modules(path)
        assert not {n for n in names if n.startswith(forbidden)} - PURE_KUBE, path.name
        assert not {n.split(".")[0] for n in names} & io_modules, path.name
