"""Who a process is, from the kernel's point of view: its pod, container or systemd unit.

A hook may claim any pod name; the daemon trusts only what `SO_PEERCRED` gives (the pid) and
what the kernel says about that pid in `/proc/<pid>/cgroup`. Kubelet puts every container in a
cgroup whose path carries the pod UID, and the container runtime names the leaf after the
container ID. The spelling differs by cgroup driver and runtime:

    systemd driver   /kubepods.slice/kubepods-burstable.slice/
                     kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope
                     (crio-<id>.scope for CRI-O, docker-<id>.scope for dockershim/cri-dockerd)
    cgroupfs driver  /kubepods/burstable/pod<uid>/<id>
    bare metal       /system.slice/foo.service, /user.slice/.../app.slice/x.scope

cgroup v1 lists one line per hierarchy ("4:memory:/kubepods/..."), v2 one line ("0::/...").
`proc_root` is injectable so tests read checked-in fake /proc trees.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# "pod<uid>" as a path component (cgroupfs) or inside a systemd slice name.
_POD_RE = re.compile(rf"(?:^|/|-)pod({_UID})(?:\.slice)?(?=/|$)")
_CONTAINER_SCOPE_RE = re.compile(
    r"^(?:cri-containerd|crio|docker|containerd|libpod)-([0-9a-f]{64})\.scope$"
)
_BARE_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_UNIT_RE = re.compile(r"^[^/]+\.(?:service|scope)$")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """The pod UID and container ID of a pod's process, or the systemd unit of a host one."""

    pod_uid: str | None
    container_id: str | None  # the bare 64-hex ID, as in a pod status containerID suffix
    systemd_unit: str | None  # only for processes outside pods, e.g. "train.service"


def cgroup_identity(pid: int, *, proc_root: Path = Path("/proc")) -> CgroupIdentity:
    """Read `/proc/<pid>/cgroup`; ProcessLookupError if the process is gone."""
    path = proc_root / str(pid) / "cgroup"
    try:
        raw = path.read_text()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}: {path} does not exist") from None
    return parse_cgroup(raw)


def parse_cgroup(raw: str) -> CgroupIdentity:
    """The identity that the text of a `/proc/<pid>/cgroup` file describes."""
    paths = _paths(raw)
    for path in paths:
        m = _POD_RE.search(path)
        if m:
            return CgroupIdentity(
                pod_uid=m.group(1).replace("_", "-"),
                container_id=_container_id(path),
                systemd_unit=None,
            )
    return CgroupIdentity(pod_uid=None, container_id=None, systemd_unit=_unit(paths))


def _paths(raw: str) -> list[str]:
    """Cgroup paths, most telling first: the v2 unified line, then systemd's, then the rest."""
    ranked: list[tuple[int, str]] = []
    for line in raw.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            rank = 0
        elif "name=systemd" in controllers.split(","):
            rank = 1
        else:
            rank = 2
        ranked.append((rank, path))
    return [p for _, p in sorted(ranked, key=lambda rp: rp[0])]


def _container_id(path: str) -> str | None:
    leaf = path.rstrip("/").rsplit("/", 1)[-1]
    m = _CONTAINER_SCOPE_RE.match(leaf)
    if m:
        return m.group(1)
    return leaf if _BARE_ID_RE.match(leaf) else None


def _unit(paths: list[str]) -> str | None:
    """The innermost .service or .scope unit in the first path that has one."""
    for path in paths:
        units = [c for c in path.split("/") if _UNIT_RE.match(c)]
        if units:
            return units[-1]
    return None
