"""Client identity from the kernel: SO_PEERCRED, then /proc/<pid> for groups, exe, comm and
cgroup.

What a client says about itself (pod name hints in REGISTER) is kept apart; the core decides
whether it counts (`trust.podClaimUids`) and who may change state (`core.authority`).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from pathlib import Path

from appliance.core.identity import ClientIdentity
from appliance.host.cgroup import CgroupIdentity, cgroup_identity

_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def _group_ids(pid: int, gid: int, proc_root: Path) -> set[int]:
    ids = {gid}
    try:
        for line in (proc_root / str(pid) / "status").read_text().splitlines():
            if line.startswith("Groups:"):
                ids.update(int(x) for x in line.split()[1:])
    except OSError:
        pass
    return ids


def _group_names(ids: set[int]) -> frozenset[str]:
    names = set()
    for gid in ids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            names.add(str(gid))
    return frozenset(names)


def where_it_runs(pid: int, *, proc_root: Path = Path("/proc")) -> CgroupIdentity | None:
    """What /proc/<pid>/cgroup says, or None where it cannot be read (gone, no file to spare):
    where it runs is then unknown, not "the host"."""
    try:
        return cgroup_identity(pid, proc_root=proc_root)
    except (OSError, ProcessLookupError):
        return None


def identify(
    pid: int,
    uid: int,
    gid: int,
    *,
    proc_root: Path = Path("/proc"),
    cgroup: CgroupIdentity | bool | None = True,
    claimed_namespace: str = "",
    claimed_pod: str = "",
) -> ClientIdentity:
    """The identity of a process. `cgroup` is what `where_it_runs` gave where the caller read
    it already (None: unreadable); True reads it here."""
    try:
        user: str | None = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = None
    try:
        exe: str | None = os.readlink(proc_root / str(pid) / "exe")
    except OSError:
        exe = None
    try:
        command: str | None = (proc_root / str(pid) / "comm").read_text().rstrip("\n") or None
    except (OSError, UnicodeDecodeError):
        command = None
    cg = where_it_runs(pid, proc_root=proc_root) if cgroup is True else cgroup
    if isinstance(cg, CgroupIdentity):
        pod_uid, container, unit, known = cg.pod_uid, cg.container_id, cg.systemd_unit, True
    else:  # where it runs is unknown, not "the host"
        pod_uid = container = unit = None
        known = False
    return ClientIdentity(
        pid=pid,
        uid=uid,
        gid=gid,
        user=user,
        groups=_group_names(_group_ids(pid, gid, proc_root)),
        executable=exe,
        command=command,
        systemd_unit=unit,
        pod_uid=pod_uid,
        container_id=container,
        cgroup_known=known,
        claimed_namespace=claimed_namespace,
        claimed_pod=claimed_pod,
    )
