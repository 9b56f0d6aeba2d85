"""Where an event loop's time goes in a process of a benchmark: the longest callbacks and the
garbage collector's pauses, as the process itself saw them (not the machine's scheduling).

Put this directory on PYTHONPATH with NVSHARE_LOOPWATCH=PREFIX set: every Python process
started so (the daemon a bench starts inherits both) lists each callback over 3 ms and each
collection over 2 ms (by generation): in PREFIX.<pid>.asked on SIGUSR2, in PREFIX.<pid>.exit
when it exits. SIGUSR1 forgets what was seen so far, so a bench can watch only its measurement
(`lock_handoff.py stall` signals its daemon so).

    NVSHARE_LOOPWATCH=/tmp/lw PYTHONPATH=bench/loopwatch \\
        .venv/bin/python bench/lock_handoff.py stall --clients 2000
"""

from __future__ import annotations

import asyncio.events
import atexit
import gc
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

PREFIX = os.environ.get("NVSHARE_LOOPWATCH")
CALLBACK_MS = 3
COLLECTION_MS = 2

if PREFIX:
    collections: Counter[tuple[int, int]] = Counter()  # (generation, ms) -> times
    callbacks: Counter[tuple[str, int]] = Counter()  # (callback, ms) -> times
    started = [0.0]

    def _collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
            return
        ms = int((time.thread_time() - started[0]) * 1e3)
        if ms >= COLLECTION_MS:
            collections[(info["generation"], ms)] += 1

    gc.callbacks.append(_collected)
    _run = asyncio.events.Handle._run

    def _timed(self: asyncio.events.Handle) -> None:
        t0 = time.thread_time()
        _run(self)
        ms = int((time.thread_time() - t0) * 1e3)
        if ms >= CALLBACK_MS:
            callback = getattr(self, "_callback", None)
            callbacks[(getattr(callback, "__qualname__", type(callback).__name__), ms)] += 1

    asyncio.events.Handle._run = _timed  # type: ignore[method-assign]

    def _write(what: str) -> None:
        with open(f"{PREFIX}.{os.getpid()}.{what}", "w") as out:
            out.write(f"argv: {' '.join(sys.argv)}\n")
            out.write(f"collections (generation, ms): {sorted(collections.items())}\n")
            slow = sorted(callbacks.items(), key=lambda kv: -kv[0][1])
            out.write(f"callbacks (name, ms), longest first: {slow}\n")

    def _forget() -> None:
        collections.clear()
        callbacks.clear()

    atexit.register(_write, "exit")
    signal.signal(signal.SIGUSR1, lambda signum, frame: _forget())
    signal.signal(signal.SIGUSR2, lambda signum, frame: _write("asked"))
