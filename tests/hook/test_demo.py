"""`make demo` (scripts/demo.py) does what the README's "Try it without a GPU" says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import ROOT


def test_the_demo_shows_two_programs_taking_turns(built: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--seconds", "3", "--quantum", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "holding" in out and "waiting" in out  # status while both compute
    assert "they overlapped 0 times" in out
    bars = [line for line in out.splitlines() if line.startswith(("  A |", "  B |"))]
    assert len(bars) == 2 and all("#" in bar for bar in bars)
