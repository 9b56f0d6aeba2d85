"""The device plugin's devices: virtual devices over physical GPUs, which of them a container
gets, and what must be in place for it to share them (CDI names, the preload file).

Kubelet only counts devices; each physical GPU becomes N virtual ones (`<uuid>::<n>`). A
request for several is spread over distinct GPUs first, least-loaded first, so
`nvshare.com/gpu: 2` means "a share of two GPUs" where two exist.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from appliance.kube.kubelet_api import pb

log = logging.getLogger(__name__)

HOOK_CONTAINER_PATH = "/usr/local/nvshare/lib/libnvshare.so"
SOCKET_CONTAINER_DIR = "/var/run/nvshare"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
PRELOAD_FILE_NAME = "ld.so.preload"  # generated next to the hook on the host
NVIDIA_CDI_KIND = "nvidia.com/gpu"
_ID_SEPARATOR = "::"


@dataclass(frozen=True, slots=True)
class VirtualDevice:
    """One schedulable slice of a physical GPU, as kubelet sees it."""

    uuid: str
    replica: int
    healthy: bool

    @property
    def id(self) -> str:
        return f"{self.uuid}{_ID_SEPARATOR}{self.replica}"


def physical_uuid(device_id: str) -> str:
    """`GPU-abc::3` -> `GPU-abc`; raises ValueError for an id this plugin never advertised."""
    uuid, separator, replica = device_id.rpartition(_ID_SEPARATOR)
    if not separator or not uuid or not replica.isdigit():
        raise ValueError(f"device id {device_id!r} is not of the form <gpu-uuid>::<n>")
    return uuid


def cdi_device_names(spec_dirs: Sequence[Path]) -> dict[str, str]:
    """NVIDIA GPU device names from the node's CDI specs: {"GPU-<uuid>" or "0": "kind=name"}.

    `nvidia-ctk cdi generate` (the NVIDIA Container Toolkit, the GPU Operator) names each GPU
    by index, by UUID or both. A file that cannot be read or parsed is skipped and logged.
    """
    names: dict[str, str] = {}
    for directory in spec_dirs:
        for path in sorted(directory.glob("*")) if directory.is_dir() else []:
            if path.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                spec = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError) as exc:
                log.warning("CDI spec %s cannot be read (%s); skipped", path, exc)
                continue
            if not isinstance(spec, dict) or spec.get("kind") != NVIDIA_CDI_KIND:
                continue
            for device in spec.get("devices") or []:
                name = str((device or {}).get("name", ""))
                if name and name != "all":
                    names[name] = f"{NVIDIA_CDI_KIND}={name}"
    return names


def write_preload_file(path: Path, hook: str) -> None:
    """The `/etc/ld.so.preload` pods get: the hook's path inside the container, one line.

    Written to a temporary name and renamed, so a container starting meanwhile mounts either
    the old file or the new one, never half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(f"{hook}\n", encoding="utf-8")
    temporary.chmod(0o644)
    os.replace(temporary, path)


def preferred_devices(
    *,
    available: list[str],
    must_include: list[str],
    size: int,
    load: Mapping[str, int],
) -> list[str]:
    """Pick `size` virtual devices: the must-includes, then one per GPU, least-loaded GPU first.

    A request for several devices is spread over distinct GPUs before any GPU is used twice,
    so `nvshare.com/gpu: 2` means "a share of two GPUs" where two exist. Load is the number of
    clients the node scheduler sees per GPU; it breaks ties between GPUs, then the UUID does.
    """
    chosen = list(dict.fromkeys(must_include))[:size] if size > 0 else []
    picked_per_gpu: dict[str, int] = {}
    for device_id in chosen:
        uuid = physical_uuid(device_id)
        picked_per_gpu[uuid] = picked_per_gpu.get(uuid, 0) + 1
    free_per_gpu: dict[str, list[str]] = {}
    for device_id in available:
        if device_id not in chosen:
            free_per_gpu.setdefault(physical_uuid(device_id), []).append(device_id)
    for ids in free_per_gpu.values():
        ids.sort(key=lambda device_id: int(device_id.rpartition(_ID_SEPARATOR)[2]))
    while len(chosen) < size and free_per_gpu:
        uuid = min(
            free_per_gpu,
            key=lambda gpu: (picked_per_gpu.get(gpu, 0), load.get(gpu, 0), gpu),
        )
        chosen.append(free_per_gpu[uuid].pop(0))
        picked_per_gpu[uuid] = picked_per_gpu.get(uuid, 0) + 1
        if not free_per_gpu[uuid]:
            del free_per_gpu[uuid]
    return chosen


@dataclass(frozen=True, slots=True)
class Injection:
    """What every container that shares GPUs gets at Allocate: the hook (also named by a mounted
    /etc/ld.so.preload, so it loads even when the pod sets its own LD_PRELOAD), the socket's
    directory and the GPUs (as CDI devices where the node names them, and in the environment)."""

    hook_host_path: str
    socket_host_dir: str
    hook_container_path: str = HOOK_CONTAINER_PATH
    socket_container_dir: str = SOCKET_CONTAINER_DIR

    @property
    def preload_host_path(self) -> str:
        # The daemon sees the host's hook directory at the same path (the DaemonSet mounts it
        # there), so the file it writes is the file kubelet mounts.
        return str(Path(self.hook_host_path).with_name(PRELOAD_FILE_NAME))

    def response(self, uuids: Sequence[str], cdi_names: Sequence[str]) -> Any:
        """The ContainerAllocateResponse for a container given these GPUs."""
        return pb.ContainerAllocateResponse(
            cdi_devices=[pb.CDIDevice(name=name) for name in cdi_names],
            envs={
                "LD_PRELOAD": self.hook_container_path,
                "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
                "NVSHARE_SOCKET_DIR": self.socket_container_dir,
            },
            mounts=[
                pb.Mount(
                    container_path=self.hook_container_path,
                    host_path=self.hook_host_path,
                    read_only=True,
                ),
                # The directory, never the socket file: a daemon restart replaces the socket,
                # and a file bind mount would keep the dead one.
                pb.Mount(
                    container_path=self.socket_container_dir,
                    host_path=self.socket_host_dir,
                    read_only=True,
                ),
                pb.Mount(
                    container_path=PRELOAD_CONTAINER_PATH,
                    host_path=self.preload_host_path,
                    read_only=True,
                ),
            ],
        )
