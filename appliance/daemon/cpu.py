"""The daemon's CPU priority: every grant waits for the daemon to get a CPU.

A hand-off is the daemon waking twice (to read the release, to write the grant). On a node whose
CPUs are all busy (data loaders, tokenizers, a build) a daemon at nice 0 waits its turn behind
that work each time: with two CPU-bound processes on the 2-core machine a hand-off's p99 was
2.5-7 ms, and 0.2-0.36 ms in most runs with the daemon at nice -10 (`bench/busy_node.py`). So
the daemon sets its own nice value as it starts (`--nice`, -10), before it starts any thread:
every thread inherits it. It needs little CPU (a tenth of a millisecond or two per hand-off);
a tenant that floods it with messages can keep its one event-loop thread busy, and so take up
to one CPU at that priority, as it could one at nice 0.

Setting a nice value below the one a process has takes root or CAP_SYS_NICE: without either
the daemon says so and runs at the one it has. In a pod the daemon's nice value only ranks it
against its own container's processes; what ranks it against other pods is its container's CPU
request (the cgroup's weight), which deploy/ sets; there it runs with NVSHARE_NICE=0.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("nvshare.daemon")


def set_nice(nice: int) -> int:
    """Set this process's nice value to `nice` (threads started after this inherit it); the
    nice value it runs at."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == now:
        return now
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        log.warning(
            "cannot set the daemon's CPU priority to nice %d (%s: it takes root or "
            "CAP_SYS_NICE); it runs at nice %d, so on a node whose CPUs are all busy each "
            "grant waits for a CPU (--nice %d keeps it without this line)",
            nice,
            exc.strerror,
            now,
            now,
        )
        return now
    log.info("CPU priority: nice %d (was %d)", nice, now)
    return nice
