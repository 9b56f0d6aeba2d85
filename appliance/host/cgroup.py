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

import os
import re
from dataclasses import dataclass
from pathlib import Path

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_QOS = ("burstable", "besteffort")
# The kubelet's own names. systemd driver: a slice per level, each named after its parent
# ("kubepods.slice" > "kubepods-burstable.slice" > "kubepods-burstable-pod<uid>.slice"), the
# root possibly under a --cgroup-root slice ("kubelet.slice/kubelet-kubepods.slice" in kind).
# cgroupfs driver: plain directories "kubepods/burstable/pod<uid>".
_POD_SLICE_RE = re.compile(rf"^(?P<parent>.+)-pod(?P<uid>{_UID})\.slice$")
_POD_DIR_RE = re.compile(rf"^pod(?P<uid>{_UID})$")
_CONTAINER_SCOPE_RE = re.compile(
    r"^(?:cri-containerd|crio|docker|containerd|libpod)-([0-9a-f]{64})\.scope$"
)
_BARE_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_UNIT_RE = re.compile(r"^[^/]+\.(?:service|scope)$")
_ANY_UNIT_RE = re.compile(r"\.(?:slice|service|scope|socket|mount|swap|target)$")


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
    """The identity that the text of a `/proc/<pid>/cgroup` file describes.

    A pod only where the path is the kubelet's own layout (`pod_in_path`); a `pod<UID>` made up
    anywhere else, such as inside a user's delegated systemd subtree, names nothing, and the
    process is what its unit says.
    """
    paths = _paths(raw)
    for path in paths:
        found = pod_in_path(path)
        if found is not None:
            pod_uid, rest = found
            return CgroupIdentity(
                pod_uid=pod_uid, container_id=_container_id(rest), systemd_unit=None
            )
    return CgroupIdentity(pod_uid=None, container_id=None, systemd_unit=_unit(paths))


def pod_in_path(path: str) -> tuple[str, list[str]] | None:
    """(pod UID, the components below the pod's cgroup) where `path` is a pod's cgroup as the
    kubelet makes it: the pod slice or directory directly under the node's kubepods root (or
    under its QoS class), the root itself reached from the top of the hierarchy through the
    kubelet's own parents only. Anything else is None: a copy of that layout nested under
    another unit (`user@1001.service/kubepods-pod<UID>.slice`) is not a pod.

    A path that begins with ".." (the reader in a cgroup namespace of its own, as the daemon
    in its pod is) starts at one of the reader's ancestors; what follows must then begin at a
    level of the layout itself.
    """
    parts = [c for c in path.split("/") if c]
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    rest = parts[up:]
    if ".." in rest:
        return None
    for i, part in enumerate(rest):
        m = _POD_SLICE_RE.match(part)
        if m and _systemd_parents(m.group("parent"), rest[:i], relative=up > 0):
            return m.group("uid").replace("_", "-"), rest[i + 1 :]
        m = _POD_DIR_RE.match(part)
        if m and _cgroupfs_parents(rest[:i], relative=up > 0):
            return m.group("uid").replace("_", "-"), rest[i + 1 :]
    return None


def _systemd_parents(stem: str, above: list[str], *, relative: bool) -> bool:
    """Whether a pod slice named "<stem>-pod<uid>.slice" sits where systemd and the kubelet put
    it: `stem` is the kubepods root ("kubepods", "kubelet-kubepods") or its QoS slice, and
    `above` is the chain of slices its name spells, one per level, nothing else."""
    root = stem
    for qos in _QOS:
        if stem.endswith(f"-{qos}"):
            root = stem[: -len(qos) - 1]
    if root != "kubepods" and not root.endswith("-kubepods"):
        return False
    levels = stem.split("-")
    chain = [f"{'-'.join(levels[: n + 1])}.slice" for n in range(len(levels))]
    if chain[0] == "user.slice":  # logged-in users' slices are never the kubelet's
        return False
    if relative:  # only the lowest levels are shown; they must still be the chain's own
        return len(above) <= len(chain) and above == chain[len(chain) - len(above) :]
    return above == chain


def _cgroupfs_parents(above: list[str], *, relative: bool) -> bool:
    """Whether a "pod<uid>" directory sits where the kubelet's cgroupfs driver puts it: under
    "kubepods" or "kubepods/<qos>", that root under plain directories only (a --cgroup-root),
    never inside a systemd unit."""
    if above and above[-1] in _QOS:
        above = above[:-1]
    if relative and not above:
        return True  # the reader is inside the QoS directory or kubepods itself
    if not above or above[-1] != "kubepods":
        return False
    return not any(_ANY_UNIT_RE.search(c) or c in _QOS or c == "kubepods" for c in above[:-1])


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


def _container_id(below: list[str]) -> str | None:
    """The container's ID from the cgroup directly under its pod's."""
    if not below:
        return None
    m = _CONTAINER_SCOPE_RE.match(below[0])
    if m:
        return m.group(1)
    return below[0] if _BARE_ID_RE.match(below[0]) else None


def _unit(paths: list[str]) -> str | None:
    """The innermost .service or .scope unit in the first path that has one."""
    for path in paths:
        units = [c for c in path.split("/") if _UNIT_RE.match(c)]
        if units:
            return units[-1]
    return None


def own_pod(proc_root: Path) -> str | None:
    """This process's own pod UID, if it runs in one (an operator's `kubectl exec` into the
    daemon's pod is the node's admin)."""
    try:
        return cgroup_identity(os.getpid(), proc_root=proc_root).pod_uid
    except (OSError, ProcessLookupError):
        return None
