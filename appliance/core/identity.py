"""Who a client is, as the kernel says (SO_PEERCRED, /proc), not as the client claims."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClientIdentity:
    pid: int
    uid: int
    gid: int
    user: str | None = None
    groups: frozenset[str] = frozenset()
    executable: str | None = None
    command: str | None = None  # /proc/<pid>/comm: the name ps, top and nvidia-smi show
    systemd_unit: str | None = None
    pod_uid: str | None = None
    container_id: str | None = None
    cgroup_known: bool = True  # False: /proc/<pid>/cgroup was unreadable, where it runs unknown
    # What the client said about itself (NVSHARE_POD_NAMESPACE/NAME). Only a fallback, flagged
    # as such wherever it is shown.
    claimed_namespace: str = ""
    claimed_pod: str = ""
