"""NVML, behind one small typed surface.

This is the only module that imports `pynvml` (nvidia-ml-py). Everything else asks an `Nvml`
object for an inventory, a sample or a health verdict, and gets frozen dataclasses back.
The library is injectable so that tests drive every error path with a scripted fake module,
and so that a node without a driver (CI, this project's build machines) gets a clear,
single log line and an empty inventory instead of a crash: the daemon then relies on what
the hooks report about memory use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.core.gpus import GpuFacts

log = logging.getLogger(__name__)

# XIDs caused by the application, not by the GPU: a CUDA program faulting must not take its
# GPU out of the device plugin (13 graphics engine exception, 31 MMU fault, 43 GPU stopped
# processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True, slots=True)
class GpuSample:
    """What one GPU looked like at `time` (seconds since the epoch)."""

    uuid: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization_percent: int | None  # None where NVML does not report it (MIG, some boards)
    healthy: bool
    time: float
    processes: Mapping[int, int] = field(default_factory=dict)  # pid -> bytes it holds here
    compute_processes: int | None = None  # how many, hooked or not; None: NVML cannot say
    pids: tuple[int, ...] | None = None  # every compute process's pid; None: NVML cannot say


# NVML's return codes for the memory-limit calls (nvml.h).
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
# nvmlSetMemoryLimits_v1_t's "no hard limit" (NVML_DEVICE_MEMORY_LIMIT_MAX in nvml.h and pynvml)
MEMORY_LIMIT_MAX = 0xFFFF_FFFF_FFFF_FFFF


class MemoryLimitRefused(Exception):
    """NVML did not set or read a cgroup's device-memory limit. `gpu_wide`: no cgroup on that
    GPU can have one (the driver lacks the call, no permission, not supported); `code` names
    the cause for metrics."""

    def __init__(self, message: str, *, code: str, gpu_wide: bool) -> None:
        super().__init__(message)
        self.code = code
        self.gpu_wide = gpu_wide


def _default_library() -> Any:
    import pynvml  # type: ignore[import-untyped]

    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    """A session with NVML; `available` is False when there is no driver or no library.

    `inventory()` and `sample()` never raise. Errors are logged once per distinct
    (operation, error) pair, so a GPU that keeps failing does not flood the log.
    """

    def __init__(
        self,
        *,
        library: Any | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._xid_unhealthy: dict[str, int] = {}  # uuid -> the critical XID that was seen
        self._events: Any = None
        self.available = False
        self.reason = ""
        try:
            self._lib = library if library is not None else _default_library()
        except ImportError as exc:
            self._lib = None
            self.reason = f"the pynvml module cannot be imported ({exc})"
        if self._lib is not None:
            try:
                self._lib.nvmlInit()
                self.available = True
            except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                self.reason = f"NVML did not initialise: {exc}"
        if not self.available:
            log.warning(
                "NVML is not available on this node (%s); no GPU inventory or health from NVML, "
                "GPU memory use comes from what the hooks report",
                self.reason,
            )
        else:
            self._register_xid_events()

    # -- public surface -------------------------------------------------------------------

    def inventory(self) -> list[GpuFacts]:
        """Every GPU NVML can see; a GPU that cannot be queried is left out (and logged)."""
        if not self.available:
            return []
        gpus: list[GpuFacts] = []
        for index in range(self._count()):
            try:
                handle = self._lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self._lib.nvmlDeviceGetUUID(handle))
                name = _text(self._lib.nvmlDeviceGetName(handle))
                total = int(self._lib.nvmlDeviceGetMemoryInfo(handle).total)
            except self._lib.NVMLError as exc:
                self._log_once(f"inventory of GPU {index}", exc, "left out of the inventory")
                continue
            gpus.append(
                GpuFacts(
                    uuid=uuid,
                    index=index,
                    model=name,
                    memory_total=total,
                    mig_enabled=self._mig_enabled(handle),
                )
            )
        return gpus

    def sample(self) -> list[GpuSample]:
        """Memory and utilisation of every GPU; a GPU whose memory cannot be read is unhealthy."""
        if not self.available:
            return []
        self._drain_xid_events()
        now = self._clock()
        samples: list[GpuSample] = []
        for index in range(self._count()):
            try:
                handle = self._lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self._lib.nvmlDeviceGetUUID(handle))
            except self._lib.NVMLError as exc:
                self._log_once(f"sample of GPU {index}", exc, "left out of this sample")
                continue
            try:
                memory = self._lib.nvmlDeviceGetMemoryInfo(handle)
            except self._lib.NVMLError as exc:
                self._log_once(f"memory of GPU {uuid}", exc, "reported unhealthy")
                samples.append(
                    GpuSample(
                        uuid=uuid,
                        memory_total=0,
                        memory_used=0,
                        memory_free=0,
                        utilization_percent=None,
                        healthy=False,
                        time=now,
                    )
                )
                continue
            held, pids = self._processes(handle, uuid)
            samples.append(
                GpuSample(
                    uuid=uuid,
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                    memory_free=int(memory.free),
                    utilization_percent=self._utilization(handle, uuid),
                    healthy=uuid not in self._xid_unhealthy,
                    time=now,
                    processes=held,
                    compute_processes=None if pids is None else len(pids),
                    pids=pids,
                )
            )
        return samples

    def healthy(self, uuid: str) -> bool:
        """True while the GPU answers queries and has shown no critical XID since start.

        An unknown UUID is unhealthy: the device plugin must not advertise a GPU that vanished.
        """
        if not self.available:
            return False
        self._drain_xid_events()
        if uuid in self._xid_unhealthy:
            return False
        try:
            handle = self._lib.nvmlDeviceGetHandleByUUID(uuid)
            self._lib.nvmlDeviceGetMemoryInfo(handle)
        except self._lib.NVMLError as exc:
            self._log_once(f"health of GPU {uuid}", exc, "reported unhealthy")
            return False
        return True

    def mig_enabled(self, uuid: str) -> bool:
        """MIG mode is on for this GPU (False where NVML cannot say)."""
        if not self.available:
            return False
        try:
            return self._mig_enabled(self._lib.nvmlDeviceGetHandleByUUID(uuid))
        except self._lib.NVMLError:
            return False

    def set_memory_limit(self, uuid: str, cgroup: str, hard: int | None) -> None:
        """nvmlDeviceSetMemoryLimits_v1 for the cgroup directory `cgroup` on this GPU: only a
        hard limit (the soft one stays 0: no guarantee); `hard` None clears the limit.
        Raises MemoryLimitRefused."""
        lib = self._lib
        limits = self._limits_struct(
            "c_nvmlSetMemoryLimits_v1_t",
            nameSpace=cgroup.encode(),
            softLimit=0,
            hardLimit=MEMORY_LIMIT_MAX if hard is None else hard,
        )
        try:
            lib.nvmlDeviceSetMemoryLimits_v1(lib.nvmlDeviceGetHandleByUUID(uuid), limits)
        except lib.NVMLError as exc:
            raise _refused(exc, "set", cgroup) from None

    def memory_limit(self, uuid: str, cgroup: str) -> tuple[int | None, int]:
        """(hard limit or None for none, bytes used) of a cgroup on this GPU, as NVML reads
        them back (nvmlDeviceGetMemoryLimits_v1). Raises MemoryLimitRefused."""
        lib = self._lib
        limits = self._limits_struct(
            "c_nvmlGetMemoryLimits_v1_t",
            nameSpace=cgroup.encode(),
            softLimit=0,
            hardLimit=0,
            currentUsed=0,
        )
        try:
            lib.nvmlDeviceGetMemoryLimits_v1(lib.nvmlDeviceGetHandleByUUID(uuid), limits)
        except lib.NVMLError as exc:
            raise _refused(exc, "read", cgroup) from None
        hard = int(limits.hardLimit)
        return (None if hard == MEMORY_LIMIT_MAX else hard), int(limits.currentUsed)

    def _limits_struct(self, name: str, **fields: Any) -> Any:
        if not self.available:
            raise MemoryLimitRefused(
                f"NVML is not available ({self.reason})", code="nvml", gpu_wide=True
            )
        struct = getattr(self._lib, name, None)
        if struct is None:
            raise MemoryLimitRefused(
                "the installed pynvml has no nvmlDeviceSetMemoryLimits_v1 binding "
                "(nvidia-ml-py 13.615 or newer has it)",
                code="driver",
                gpu_wide=True,
            )
        return struct(**fields)

    def close(self) -> None:
        if not self.available:
            return
        try:
            if self._events is not None:
                self._lib.nvmlEventSetFree(self._events)
            self._lib.nvmlShutdown()
        except self._lib.NVMLError as exc:
            self._log_once("shutdown", exc, "ignored")
        self.available = False

    # -- helpers --------------------------------------------------------------------------

    def _count(self) -> int:
        try:
            return int(self._lib.nvmlDeviceGetCount())
        except self._lib.NVMLError as exc:
            self._log_once("device count", exc, "no GPUs listed this time")
            return 0

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self._lib.nvmlDeviceGetMigMode(handle)
        except self._lib.NVMLError:
            return False  # boards without MIG answer NOT_SUPPORTED
        return bool(current == self._lib.NVML_DEVICE_MIG_ENABLE)

    def _utilization(self, handle: Any, uuid: str) -> int | None:
        try:
            return int(self._lib.nvmlDeviceGetUtilizationRates(handle).gpu)
        except self._lib.NVMLError as exc:
            if getattr(exc, "value", None) != self._lib.NVML_ERROR_NOT_SUPPORTED:
                self._log_once(f"utilization of GPU {uuid}", exc, "utilization unknown")
            return None

    def _processes(self, handle: Any, uuid: str) -> tuple[dict[int, int], tuple[int, ...] | None]:
        """What each compute process holds on this GPU, and every one's pid.

        A process whose memory NVML does not report is listed but not in the map; where NVML
        cannot list them at all, the map is empty and the pids None (unknown, not none).
        """
        try:
            running = self._lib.nvmlDeviceGetComputeRunningProcesses(handle)
        except self._lib.NVMLError as exc:
            self._log_once(f"processes of GPU {uuid}", exc, "per-process memory unknown")
            return {}, None
        held = {
            int(proc.pid): int(proc.usedGpuMemory)
            for proc in running
            if getattr(proc, "usedGpuMemory", None) is not None
        }
        return held, tuple(int(proc.pid) for proc in running)

    def _register_xid_events(self) -> None:
        """Ask NVML to queue critical XID errors; a board that cannot is checked by queries only."""
        try:
            self._events = self._lib.nvmlEventSetCreate()
        except (self._lib.NVMLError, AttributeError) as exc:
            self._log_once("XID event set", exc, "health from queries only")
            return
        for index in range(self._count()):
            try:
                handle = self._lib.nvmlDeviceGetHandleByIndex(index)
                self._lib.nvmlDeviceRegisterEvents(
                    handle, self._lib.nvmlEventTypeXidCriticalError, self._events
                )
            except self._lib.NVMLError as exc:
                self._log_once(f"XID events of GPU {index}", exc, "health from queries only")

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        with self._lock:
            while True:
                try:
                    event = self._lib.nvmlEventSetWait_v2(self._events, 0)
                except self._lib.NVMLError as exc:
                    if getattr(exc, "value", None) != self._lib.NVML_ERROR_TIMEOUT:
                        self._log_once("XID event wait", exc, "XIDs not read this time")
                    return
                xid = int(event.eventData)
                if xid in APPLICATION_XIDS:
                    continue
                try:
                    uuid = _text(self._lib.nvmlDeviceGetUUID(event.device))
                except self._lib.NVMLError as exc:
                    self._log_once("UUID of a GPU reporting an XID", exc, "that XID is ignored")
                    continue
                if uuid not in self._xid_unhealthy:
                    log.error("GPU %s reported critical XID %d; marking it unhealthy", uuid, xid)
                self._xid_unhealthy[uuid] = xid

    def _log_once(self, what: str, exc: BaseException, consequence: str) -> None:
        key = (what, str(exc))
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning("NVML error in %s: %s (%s; said once)", what, exc, consequence)


def _refused(exc: Any, doing: str, cgroup: str) -> MemoryLimitRefused:
    """What an NVML error from a memory-limit call means, for status and the log."""
    value = getattr(exc, "value", None)
    if value == NVML_ERROR_FUNCTION_NOT_FOUND:
        return MemoryLimitRefused(
            "the driver has no nvmlDeviceSetMemoryLimits_v1 (MPS v3 memory partitioning needs "
            "driver r615 / CUDA 13.4 or newer)",
            code="driver",
            gpu_wide=True,
        )
    if value == NVML_ERROR_NO_PERMISSION:
        return MemoryLimitRefused(
            "NVML refused to set memory limits: no permission (the daemon must run as root)",
            code="permission",
            gpu_wide=True,
        )
    if value == NVML_ERROR_NOT_SUPPORTED:
        return MemoryLimitRefused(
            "the driver does not support memory partitioning on this GPU",
            code="unsupported",
            gpu_wide=True,
        )
    return MemoryLimitRefused(
        f"NVML could not {doing} the memory limit of cgroup {cgroup}: {exc}",
        code="cgroup",
        gpu_wide=False,
    )
