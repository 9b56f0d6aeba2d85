"""The kubelet device plugin: `nvshare.com/gpu` virtual devices, N per physical GPU.

Kubelet only counts devices; sharing happens in the hook and the node scheduler. This module
turns each physical GPU into `replicas_per_gpu` virtual devices (`<uuid>::<n>`) so that many
pods can be placed on one GPU, and at Allocate it injects what a container needs to take part
in sharing: the hook (mounted read-only), the scheduler's socket DIRECTORY (so a daemon restart
that recreates the socket stays visible) and the GPUs.

The hook must load whatever the pod does with its environment: a pod that sets its own
LD_PRELOAD (tcmalloc, jemalloc) would otherwise replace ours and run unshared and unlimited.
So besides LD_PRELOAD, a generated `/etc/ld.so.preload` naming the hook is mounted into the
container; glibc's loader reads that file for every program in addition to LD_PRELOAD, so the
pod's own preloads still load too. The GPUs are named as CDI devices (`nvidia.com/gpu=<uuid>`)
where the node's NVIDIA CDI spec lists them, because NVIDIA's runtime may be set to ignore
NVIDIA_VISIBLE_DEVICES from unprivileged containers; the variable stays as the fallback for
runtimes without CDI.

NVIDIA's own device plugin advertises the same GPUs as `nvidia.com/gpu`, whole. Both on one
node would book a GPU twice, so while one of its sockets is in kubelet's directory this plugin
reports all its devices unhealthy (kubelet then places no new pod on them) and says why. It
names a socket after its resource, `nvidia-<resource>.sock`: `nvidia-gpu.sock`, but also
`nvidia-gpu.shared.sock` (time-slicing with renamed resources) or `nvidia-a100.sock` (a
resource renamed by its config). Its MIG sockets (`nvidia-mig-1g.10gb.sock`) serve GPUs in MIG
mode, which this plugin never advertises, so they do not count.

Kubelet deletes every socket in its device-plugins directory when it restarts and then
recreates `kubelet.sock`; an inotify watch on the directory notices and the plugin serves
again and re-registers. Health comes from a callable (NVML in production) polled in the
background; a change is streamed to kubelet through ListAndWatch.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import inotify_simple  # type: ignore[import-untyped]

from appliance.core.gpus import GpuFacts
from appliance.kube.devices import (
    HOOK_CONTAINER_PATH,
    SOCKET_CONTAINER_DIR,
    Injection,
    VirtualDevice,
    cdi_device_names,
    physical_uuid,
    preferred_devices,
    write_preload_file,
)
from appliance.kube.kubelet_api import pb, pb_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
# Sockets of device plugins that hand out the same GPUs whole: NVIDIA's k8s-device-plugin
# (`nvidia-<resource>.sock`), except its MIG resources' sockets (GPUs we do not advertise).
FOREIGN_PLUGIN_SOCKETS = ("nvidia-*.sock",)
NOT_FOREIGN_SOCKETS = ("nvidia-mig-*.sock",)
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class DevicePlugin:
    """Serves the DevicePlugin gRPC service and keeps kubelet registered with it."""

    def __init__(
        self,
        *,
        gpus: Callable[[], list[GpuFacts]],
        health: Callable[[str], bool],
        replicas_per_gpu: int,
        resource_name: str,
        kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins"),
        hook_host_path: str,
        socket_host_dir: str,
        load: Callable[[], Mapping[str, int]],
        endpoint: str = "nvshare.sock",
        hook_container_path: str = HOOK_CONTAINER_PATH,
        socket_container_dir: str = SOCKET_CONTAINER_DIR,
        cdi_spec_dirs: Sequence[Path] = CDI_SPEC_DIRS,
        gpu_index: Callable[[str], int | None] = lambda uuid: None,
        foreign_sockets: Sequence[str] = FOREIGN_PLUGIN_SOCKETS,
        health_interval_s: float = 5.0,
        register_retry_s: float = 1.0,
    ) -> None:
        if replicas_per_gpu < 1:
            raise ValueError(f"replicas_per_gpu must be at least 1, got {replicas_per_gpu}")
        self._gpus = gpus
        self._health = health
        self._replicas = replicas_per_gpu
        self.resource_name = resource_name
        self.kubelet_dir = kubelet_dir
        self._load = load
        self.endpoint = endpoint
        self._injection = Injection(
            hook_host_path=hook_host_path,
            socket_host_dir=socket_host_dir,
            hook_container_path=hook_container_path,
            socket_container_dir=socket_container_dir,
        )
        self._cdi_spec_dirs = tuple(cdi_spec_dirs)
        self._gpu_index = gpu_index
        self._foreign_sockets = tuple(foreign_sockets)
        self._foreign_seen: str | None = None
        self._health_interval_s = health_interval_s
        self._register_retry_s = register_retry_s

        self._changed = threading.Condition()
        self._devices: tuple[VirtualDevice, ...] = ()
        self._generation = 0
        self._stopping = threading.Event()
        self._server: Any = None
        self._threads: list[threading.Thread] = []
        self._skipped_mig: set[str] = set()
        self.registered = False  # kubelet has accepted our registration and not restarted since

    @property
    def socket_path(self) -> Path:
        return self.kubelet_dir / self.endpoint

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Serve, register if kubelet is there, and watch for kubelet restarts and health."""
        if not self.kubelet_dir.is_dir():
            raise FileNotFoundError(
                f"the kubelet device-plugins directory {self.kubelet_dir} does not exist; "
                "mount it from the host (kubelet creates it) or turn the device plugin off"
            )
        self._stopping.clear()
        injection = self._injection
        write_preload_file(Path(injection.preload_host_path), injection.hook_container_path)
        self._refresh_devices()
        self._serve()
        # The watch is in place before the first registration, so a kubelet that comes up
        # in between is not missed.
        inotify = inotify_simple.INotify()
        flags = inotify_simple.flags
        inotify.add_watch(self.kubelet_dir, flags.CREATE | flags.MOVED_TO | flags.DELETE)
        self._threads = [
            threading.Thread(
                target=self._watch_kubelet, args=(inotify,), name="deviceplugin-kubelet"
            ),
            threading.Thread(target=self._watch_health, name="deviceplugin-health"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._stop_server()

    # -- what kubelet sees ----------------------------------------------------------------

    def devices(self) -> tuple[VirtualDevice, ...]:
        with self._changed:
            return self._devices

    def _is_foreign(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self._foreign_sockets) and not any(
            fnmatch.fnmatchcase(name, p) for p in NOT_FOREIGN_SOCKETS
        )

    def _foreign_plugin(self) -> str | None:
        """The socket of a plugin that hands out these GPUs whole, when one is registered."""
        try:
            names = sorted(entry.name for entry in os.scandir(self.kubelet_dir))
        except OSError:  # kubelet's directory briefly gone while it restarts
            names = []
        present = next((name for name in names if self._is_foreign(name)), None)
        if present != self._foreign_seen:
            if present:
                log.warning(
                    "another device plugin serves these GPUs whole (%s in %s; NVIDIA's plugin "
                    "for nvidia.com/gpu): every %s is reported unhealthy so that no GPU is "
                    "booked twice. On GPU nodes meant for sharing, turn NVIDIA's plugin off "
                    "(GPU Operator: label the node nvidia.com/gpu.deploy.device-plugin=false)",
                    present,
                    self.kubelet_dir,
                    self.resource_name,
                )
            else:
                log.info("%s is gone; advertising %s again", self._foreign_seen, self.resource_name)
            self._foreign_seen = present
        return present

    def _current_devices(self) -> tuple[VirtualDevice, ...]:
        devices: list[VirtualDevice] = []
        withdrawn = self._foreign_plugin() is not None
        for gpu in self._gpus():
            if gpu.mig_enabled:
                if gpu.uuid not in self._skipped_mig:
                    self._skipped_mig.add(gpu.uuid)
                    log.info(
                        "GPU %s is in MIG mode; not advertised as %s", gpu.uuid, self.resource_name
                    )
                continue
            healthy = self._health(gpu.uuid) and not withdrawn
            devices.extend(
                VirtualDevice(uuid=gpu.uuid, replica=n, healthy=healthy)
                for n in range(self._replicas)
            )
        return tuple(devices)

    def set_replicas(self, replicas_per_gpu: int) -> None:
        """A new policy's `devicePlugin.replicasPerGpu`: kubelet hears the new list at once."""
        if replicas_per_gpu < 1:
            raise ValueError(f"replicas_per_gpu must be at least 1, got {replicas_per_gpu}")
        if replicas_per_gpu != self._replicas:
            log.info(
                "advertising %d %s per GPU (was %d)",
                replicas_per_gpu,
                self.resource_name,
                self._replicas,
            )
            self._replicas = replicas_per_gpu
            self._refresh_devices()

    def _refresh_devices(self) -> None:
        try:
            devices = self._current_devices()
        except Exception:
            log.exception("listing GPUs for the device plugin failed; keeping the last list")
            return
        with self._changed:
            if devices != self._devices:
                for gpu in {d.uuid for d in devices if not d.healthy}:
                    if any(d.uuid == gpu and d.healthy for d in self._devices):
                        log.warning("GPU %s became unhealthy; kubelet is told", gpu)
                self._devices = devices
                self._generation += 1
                self._changed.notify_all()

    def list_and_watch(self, context: Any) -> Iterator[Any]:
        seen = -1
        while not self._stopping.is_set() and context.is_active():
            with self._changed:
                if self._generation == seen:
                    self._changed.wait(timeout=1.0)
                    continue
                seen, devices = self._generation, self._devices
            yield pb.ListAndWatchResponse(
                devices=[
                    pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY) for d in devices
                ]
            )

    def _cdi_devices(self, uuids: list[str]) -> list[str]:
        """CDI names for every GPU, or none at all when the node's spec lacks any of them."""
        known = cdi_device_names(self._cdi_spec_dirs)
        names = []
        for uuid in uuids:
            index = self._gpu_index(uuid)
            name = known.get(uuid) or (known.get(str(index)) if index is not None else None)
            if name is None:
                return []
            names.append(name)
        return names

    def allocate(self, request: Any, context: Any) -> Any:
        responses = []
        for container in request.container_requests:
            try:
                uuids = list(dict.fromkeys(physical_uuid(i) for i in container.devices_ids))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            responses.append(self._injection.response(uuids, self._cdi_devices(uuids)))
        return pb.AllocateResponse(container_responses=responses)

    def preferred_allocation(self, request: Any, context: Any) -> Any:
        try:
            load = dict(self._load())
        except Exception:
            log.exception("reading GPU load failed; spreading by UUID order only")
            load = {}
        responses = []
        for container in request.container_requests:
            try:
                chosen = preferred_devices(
                    available=list(container.available_deviceIDs),
                    must_include=list(container.must_include_deviceIDs),
                    size=container.allocation_size,
                    load=load,
                )
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    # -- gRPC server and registration -----------------------------------------------------

    def _serve(self) -> None:
        self._stop_server()
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        log.info("device plugin serving %s on %s", self.resource_name, self.socket_path)

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None

    def register(self) -> bool:
        """Register with kubelet once; False (and a log line) when kubelet is not answering."""
        kubelet = self.kubelet_dir / KUBELET_SOCKET
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.endpoint,
            resource_name=self.resource_name,
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=5.0)
        except grpc.RpcError as exc:
            log.warning(
                "registering %s with kubelet at %s failed (%s: %s); will retry",
                self.resource_name,
                kubelet,
                exc.code().name,
                exc.details(),
            )
            return False
        log.info("registered %s with kubelet at %s", self.resource_name, kubelet)
        self.registered = True
        return True

    def _watch_kubelet(self, inotify: inotify_simple.INotify) -> None:
        pending = (self.kubelet_dir / KUBELET_SOCKET).exists()
        try:
            while not self._stopping.is_set():
                try:
                    pending = self._watch_once(inotify, pending=pending)
                except Exception:
                    # Never let the watch die: without it a kubelet restart loses the plugin.
                    log.exception("device plugin: handling a kubelet directory change failed")
                    self._stopping.wait(self._register_retry_s)
        finally:
            inotify.close()

    def _watch_once(self, inotify: inotify_simple.INotify, *, pending: bool) -> bool:
        """Register if due, then handle one batch of directory events; returns `pending`."""
        flags = inotify_simple.flags
        if pending:
            pending = not self.register()
        timeout_ms = int(self._register_retry_s * 1000) if pending else 200
        for event in inotify.read(timeout=timeout_ms):
            if self._is_foreign(event.name):
                self._refresh_devices()
            elif event.name == KUBELET_SOCKET and event.mask & (flags.CREATE | flags.MOVED_TO):
                # A new kubelet: it has wiped the directory, so serve again if our socket is
                # gone, then register (after serving: kubelet dials back at once).
                if not self.socket_path.exists():
                    self._serve()
                pending, self.registered = True, False
            elif event.name == self.endpoint and event.mask & flags.DELETE:
                if not self._stopping.is_set():
                    log.warning("%s was deleted; serving again", self.socket_path)
                    self._serve()
                    self.registered = False
                    pending = (self.kubelet_dir / KUBELET_SOCKET).exists()
        return pending

    def _watch_health(self) -> None:
        while not self._stopping.wait(self._health_interval_s):
            self._refresh_devices()


class _Servicer:
    """The DevicePlugin service's methods, by their gRPC names, mapped onto the plugin."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self._plugin = plugin

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        return self._plugin.list_and_watch(context)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return self._plugin.preferred_allocation(request, context)

    def Allocate(self, request: Any, context: Any) -> Any:
        return self._plugin.allocate(request, context)

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()
