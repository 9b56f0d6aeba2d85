"""Who a process that NVML lists is, from /proc: its owner, executable and pod.

A hook's process introduces itself over the socket (`peer.identify`, from SO_PEERCRED); a
process that never loaded the hook does not, and all the daemon has is the PID in NVML's
list of a GPU's compute processes. Its kernel identity is read the same way, from
`/proc/<pid>/status` (uid and gid) and the rest of `/proc/<pid>`, so the core can tell whose
it is: a pod's (by the cgroup's pod UID), or a user's on the host.

NVML is sampled every second and its processes live for minutes or days, so identities are
kept while a PID stays listed and read again only for a new PID, or one whose start time
changed (the PID was reused).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from appliance.core.identity import ClientIdentity
from appliance.host.peer import identify


def identify_process(pid: int, *, proc_root: Path = Path("/proc")) -> ClientIdentity | None:
    """The identity of `pid`, or None when it is gone (or in a PID namespace we cannot see)."""
    try:
        status = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    ids = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Uid", "Gid") and rest.split():
            ids[key] = int(rest.split()[0])  # the real id, as SO_PEERCRED would give
    if len(ids) != 2:
        return None
    return identify(pid, ids["Uid"], ids["Gid"], proc_root=proc_root)


def start_time(pid: int, *, proc_root: Path = Path("/proc")) -> int | None:
    """When `pid` started (clock ticks since boot, field 22 of /proc/<pid>/stat), or None."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parens
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


class ProcessIdentities:
    """Identities of the PIDs asked for, read once per process while it keeps being asked for."""

    def __init__(self, *, proc_root: Path = Path("/proc")) -> None:
        self._proc_root = proc_root
        self._known: dict[int, tuple[int | None, ClientIdentity]] = {}

    def __call__(self, pids: Collection[int]) -> dict[int, ClientIdentity]:
        """The identities of `pids` that could be read; PIDs not asked for are forgotten."""
        known: dict[int, tuple[int | None, ClientIdentity]] = {}
        for pid in pids:
            started = start_time(pid, proc_root=self._proc_root)
            cached = self._known.get(pid)
            if cached is not None and cached[0] == started:
                known[pid] = cached
            elif (ident := identify_process(pid, proc_root=self._proc_root)) is not None:
                known[pid] = (started, ident)
        self._known = known
        return {pid: ident for pid, (_, ident) in known.items()}
