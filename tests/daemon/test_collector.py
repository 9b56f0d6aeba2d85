"""The daemon's process tunes Python's garbage collector as it starts (`tune_collector`): what
start-up made is never walked again, and a status build's rows die young instead of setting
off full collections over every client (bench/lock_handoff.py stall)."""

from __future__ import annotations

import gc
import subprocess
import sys

TUNED = """
import gc
from appliance.cli.nvshare_scheduler import YOUNG_OBJECTS, tune_collector
before = gc.get_threshold()
tune_collector()
print(gc.get_freeze_count() > 10_000, gc.get_threshold() == (YOUNG_OBJECTS, *before[1:]))
"""


def test_start_up_objects_are_frozen_and_young_passes_come_less_often() -> None:
    # (its own process: the collector's settings are the whole process's)
    out = subprocess.run([sys.executable, "-c", TUNED], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
    assert gc.get_freeze_count() == 0  # (this process is left alone)
