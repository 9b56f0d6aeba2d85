"""For a daemon run under valgrind by `bench/daemon_cost.py`: everything runs some 50 times
slower there, so the time slice the daemon gives turns in one pass of its loop
(`appliance.serve.connection.Turns`) is made as much longer (NVSHARE_BENCH_TURN_SLICE_S).
Without it every frame's turn would outlast the slice and be put off to a later pass, which
the daemon never does at native speed, and the count would be of that instead.
"""

from __future__ import annotations

import os

SLICE = os.environ.get("NVSHARE_BENCH_TURN_SLICE_S")

if SLICE:
    from appliance.serve import connection

    defaults = connection.Turns.__init__.__kwdefaults__
    assert defaults is not None and "slice_s" in defaults, "Turns takes no slice_s any more"
    defaults["slice_s"] = float(SLICE)
