"""Process IDs as another process sees them, from the kernel's word in /proc.

The daemon sees every process by its PID in the host's namespace (SO_PEERCRED); a process in a
container knows itself and its neighbours by the PIDs of its own PID namespace. What the daemon
shows a container (the process list in its nvidia-smi) must use the container's numbers, or
nvidia-smi cannot name them and a user cannot signal them. `/proc/<pid>/status` lists a
process's PID in every namespace from the one of this /proc down to its own (`NSpid`), and
`/proc/<pid>/ns/pid` names its namespace.

A process is visible to a viewer in the namespace of this /proc (bare metal, the host) by its
PID here, and to a viewer in another namespace when both are in that same namespace (one
container, or a pod that shares its process namespace). Processes in a namespace nested below
the viewer's, or in a sibling container, are reported as not visible.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def _namespace_pids(pid: int, proc_root: Path) -> list[int]:
    for line in (proc_root / str(pid) / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return [pid]  # a kernel before 4.1: no namespaces to tell apart


def pids_seen_by(viewer: int, pids: Iterable[int], *, proc_root: Path) -> dict[int, int]:
    """Each of `pids` (as this /proc numbers them) that `viewer` can see, by the number it sees;
    a process that is gone, or unreadable, is not seen."""
    try:
        if len(_namespace_pids(viewer, proc_root)) == 1:
            return {pid: pid for pid in pids}
        viewer_ns = os.readlink(proc_root / str(viewer) / "ns" / "pid")
    except (OSError, ValueError):
        return {}
    seen: dict[int, int] = {}
    for pid in pids:
        try:
            if os.readlink(proc_root / str(pid) / "ns" / "pid") == viewer_ns:
                seen[pid] = _namespace_pids(pid, proc_root)[-1]
        except (OSError, ValueError, IndexError):
            continue
    return seen
