"""The kernel-enforced backstop: a hard device-memory limit per cgroup and GPU that the driver
enforces for every allocation of every process in that cgroup, hooked or not.

NVIDIA's MPS v3 memory partitioning (driver r615 / CUDA 13.4) sets it through NVML
(`nvmlDeviceSetMemoryLimits_v1(device, {nameSpace: the cgroup directory, softLimit,
hardLimit})`, read back with `nvmlDeviceGetMemoryLimits_v1`); it needs cgroup v2 at
/sys/fs/cgroup and a GPU not in MIG mode, uses the kernel's dmem controller where the kernel
has one (`dmem.max` is the hard limit) and the driver's own accounting otherwise. It counts what
the hook cannot see: a static binary, a process that sheds the preload, the driver's own
allocations. The hook stays the first line (what a program is shown, quotas, pod-wide
reservations, managed-memory oversubscription); this only catches what bypasses it.

With `memory.kernelBackstop: on`, every reconcile (each NVML sample, and whenever limits are
published) turns the clients the daemon knows into the limits that should be set: a pod's cgroup
(`kubepods*/.../*pod<uid>*`) gets its memory limit on that GPU plus `kernelBackstopAllowance`
per process of it the daemon knows there; outside pods, the cgroup a process runs in gets the
sum over its processes of their limit plus the allowance. Only the hard limit is set (the soft
one stays 0: no guarantee, as without the backstop). A limit is set when it appears or
changes, and cleared when its pod or cgroup has no client left on that GPU, or the policy turns
the backstop off. Nothing here decides anything the core decides: it only mirrors the limits
the core resolved.

What is set is also written to `backstop.json` in the socket directory (a tmpfs: limits and
record both end with the boot). Limits stay set while the daemon restarts; the next daemon
takes the record over and, once its clients had `ADOPT_GRACE_S` to reconnect, clears those no
client asks for any more (a workstation cgroup whose processes ended meanwhile would otherwise
keep its limit for good). A daemon stopped for good leaves them set: `nvshare-scheduler
clear-backstop` clears what the record names (`clear_recorded`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from appliance.core.gpus import GpuFacts
from appliance.core.views import BackstopView, StatusView
from appliance.gpu.nvml import MemoryLimitRefused, Nvml

if TYPE_CHECKING:
    from appliance.core.node import NodeCore

T = TypeVar("T")


class Reader(Protocol):
    """What the backstop needs of the engine (`appliance.daemon.engine`), which sits above it:
    its clock, and a read of the core on the event loop."""

    def now(self) -> float: ...

    def read(self, fn: Callable[[], T], *, timeout_s: float = ...) -> T: ...


log = logging.getLogger(__name__)

_OFF = "off in policy (memory.kernelBackstop: off)"
RECORD_NAME = "backstop.json"
ADOPT_GRACE_S = 30.0  # what a restarted daemon's clients have to reconnect


@dataclass(frozen=True, slots=True)
class Holder:
    """A client as the backstop needs it: where it runs and the limit the core resolved."""

    gpu: str
    pid: int
    pod_uid: str  # "" outside pods
    memory_limit: int | None


def holders(status: StatusView) -> list[Holder]:
    return [
        Holder(gpu=c.gpu, pid=c.pid, pod_uid=c.pod_uid, memory_limit=c.memory_limit)
        for c in status.clients
    ]


class KernelBackstop:
    """Keeps NVML's per-cgroup hard limits equal to what the clients' limits ask for."""

    def __init__(
        self,
        nvml: Nvml,
        *,
        gpus: Callable[[], list[GpuFacts]] | None = None,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        proc_root: Path = Path("/proc"),
        record: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._gpus = gpus or nvml.inventory
        self._root = cgroup_root
        self._proc = proc_root
        self._record = record
        self._clock = clock
        self._lock = threading.Lock()
        # (gpu, cgroup dir) -> hard limit set, by this daemon or the one before it (adopted)
        self._set: dict[tuple[str, str], int] = read_record(record) if record else {}
        self._adopted = set(self._set)  # kept until the grace ends unless a client wants them
        self._grace_ends = clock() + ADOPT_GRACE_S
        self._refused: dict[str, MemoryLimitRefused] = {}  # gpu -> why none can be set there
        self._views: tuple[BackstopView, ...] = ()
        self._where: dict[tuple[str, int], str] = {}  # (gpu, pid) -> what explain says

    # -- the reconcile -------------------------------------------------------------------

    def reconcile(self, *, enabled: bool, allowance: int, clients: Iterable[Holder]) -> None:
        """Sets, changes and clears limits so that they match `clients`; never raises."""
        with self._lock:
            if not enabled:
                self._refused.clear()  # turned on again later: everything is tried afresh
            gpus = {g.uuid: g for g in self._gpus()} if self._nvml.available else {}
            why_not = {uuid: self._why_not(enabled, g) for uuid, g in gpus.items()}
            want, where = self._wanted(clients, allowance)
            before = dict(self._set)
            for (gpu, cgroup), hard in sorted(want.items()):
                usable = why_not.get(gpu, "unknown GPU") is None and gpu not in self._refused
                if usable and self._set.get((gpu, cgroup)) != hard:
                    self._apply(gpu, cgroup, hard)
            self._adopted -= set(want)
            if self._adopted and self._clock() >= self._grace_ends:
                self._adopted.clear()  # no client came back for them
            for gpu, cgroup in sorted(set(self._set) - set(want) - self._adopted):
                self._clear(gpu, cgroup)
            if not enabled or not self._nvml.available:
                for gpu, cgroup in sorted(self._set):
                    self._clear(gpu, cgroup)
                self._adopted.clear()
            if self._set != before:
                self._save()
            why_not = {uuid: self._why_not(enabled, g) for uuid, g in gpus.items()}  # refusals
            self._views = tuple(self._view(uuid, why_not[uuid]) for uuid in sorted(gpus))
            self._where = {
                key: self._explain(key[0], cgroup, why_not.get(key[0]))
                for key, cgroup in where.items()
            }

    def _why_not(self, enabled: bool, gpu: GpuFacts) -> str | None:
        if not enabled:
            return _OFF
        if gpu.uuid in self._refused:
            return str(self._refused[gpu.uuid])
        if not (self._root / "cgroup.controllers").is_file():
            return f"no cgroup v2 at {self._root} (MPS memory partitioning needs it)"
        if gpu.mig_enabled or self._nvml.mig_enabled(gpu.uuid):
            return "MIG is enabled on this GPU (MPS memory partitioning does not support MIG)"
        return None

    def _wanted(
        self, clients: Iterable[Holder], allowance: int
    ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, int], str]]:
        """The hard limit each (GPU, cgroup) should have, and each client's cgroup ("" none)."""
        pods: dict[tuple[str, str], dict[int, int]] = {}  # (gpu, cgroup) -> pid -> limit
        groups: dict[tuple[str, str], dict[int, int]] = {}
        where: dict[tuple[str, int], str] = {}
        for c in clients:
            cgroup = self._pod_cgroup(c.pod_uid) if c.pod_uid else self._own_cgroup(c.pid)
            where[(c.gpu, c.pid)] = cgroup or ""
            if c.memory_limit is None or not cgroup:
                continue
            into = pods if c.pod_uid else groups
            into.setdefault((c.gpu, cgroup), {})[c.pid] = c.memory_limit
        want = {key: max(limits.values()) + allowance * len(limits) for key, limits in pods.items()}
        for key, limits in groups.items():
            want[key] = sum(limits.values()) + allowance * len(limits)
        return want, where

    def _apply(self, gpu: str, cgroup: str, hard: int) -> None:
        try:
            self._nvml.set_memory_limit(gpu, cgroup, hard)
        except MemoryLimitRefused as exc:
            self._note_refusal(gpu, exc)
            return
        log.info("kernel backstop: %s on GPU %s limited to %d MiB", cgroup, gpu, hard >> 20)
        self._set[(gpu, cgroup)] = hard

    def _clear(self, gpu: str, cgroup: str) -> None:
        del self._set[(gpu, cgroup)]
        if not Path(cgroup).is_dir():
            return  # removing the cgroup cleared its limit
        try:
            self._nvml.set_memory_limit(gpu, cgroup, None)
        except MemoryLimitRefused as exc:
            log.warning("kernel backstop: clearing %s on GPU %s failed: %s", cgroup, gpu, exc)
            return
        log.info("kernel backstop: %s on GPU %s no longer limited", cgroup, gpu)

    def _save(self) -> None:
        if self._record is None:
            return
        entries = [{"gpu": g, "cgroup": c, "hard": h} for (g, c), h in sorted(self._set.items())]
        try:
            part = self._record.with_name(self._record.name + ".part")
            part.write_text(json.dumps(entries, indent=1) + "\n")
            os.replace(part, self._record)
        except OSError as exc:
            log.warning(
                "kernel backstop: cannot record the limits set in %s (%s); after this daemon "
                "stops for good, clear-backstop will not know them",
                self._record,
                exc.strerror or exc,
            )

    def _note_refusal(self, gpu: str, exc: MemoryLimitRefused) -> None:
        if exc.gpu_wide:
            if gpu not in self._refused:
                log.warning(
                    "kernel backstop inactive on GPU %s: %s (the hook still limits)", gpu, exc
                )
            self._refused[gpu] = exc
        else:
            log.warning("kernel backstop: %s (the hook still limits that tenant)", exc)

    # -- where a client's cgroup is --------------------------------------------------------

    def _pod_cgroup(self, pod_uid: str) -> str | None:
        """The pod's cgroup directory: kubelet's `kubepods[.slice]/[qos]/...pod<uid>...`."""
        names = {f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}"}
        for top in ("kubepods.slice", "kubepods"):
            base = self._root / top
            if not base.is_dir():
                continue
            for candidate in (
                *base.iterdir(),
                *(p for d in base.iterdir() if d.is_dir() for p in d.iterdir()),
            ):
                if candidate.is_dir() and any(
                    candidate.name == n or candidate.name.endswith(f"-{n}.slice") for n in names
                ):
                    return str(candidate)
        return None

    def _own_cgroup(self, pid: int) -> str | None:
        """The cgroup v2 directory a host process runs in; None for the root cgroup."""
        try:
            lines = (self._proc / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            if line.startswith("0::/") and line.strip() != "0::/":
                return str(self._root / line.strip()[4:])
        return None

    # -- what status, metrics and explain show ----------------------------------------------

    def _view(self, gpu: str, why_not: str | None) -> BackstopView:
        limits = {cgroup: hard for (g, cgroup), hard in sorted(self._set.items()) if g == gpu}
        if why_not is None:
            return BackstopView(gpu=gpu, active=True, code="active", reason="", limits=limits)
        code = self._refused[gpu].code if gpu in self._refused else _code(why_not)
        return BackstopView(gpu=gpu, active=False, code=code, reason=why_not, limits=limits)

    def _explain(self, gpu: str, cgroup: str, why_not: str | None) -> str:
        if why_not is not None:
            return f"none: {why_not}"
        if not cgroup:
            return "none: its cgroup is not known (or is the root cgroup)"
        hard = self._set.get((gpu, cgroup))
        if hard is None:
            return f"none on {cgroup} (no memory limit applies)"
        return f"{hard >> 20} MiB hard limit on {cgroup} (kernel-enforced)"

    def views(self) -> tuple[BackstopView, ...]:
        with self._lock:
            return self._views

    def explain(self, gpu: str, pid: int) -> str:
        with self._lock:
            return self._where.get((gpu, pid), "")

    def limits(self) -> Mapping[tuple[str, str], int]:
        with self._lock:
            return dict(self._set)


def read_record(record: Path) -> dict[tuple[str, str], int]:
    """The limits a daemon recorded as set: (gpu, cgroup) -> hard limit; {} when none."""
    try:
        entries = json.loads(record.read_text())
        return {(str(e["gpu"]), str(e["cgroup"])): int(e["hard"]) for e in entries}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kernel backstop: %s is not a record of limits (%s); ignored", record, exc)
        return {}


def clear_recorded(nvml: Nvml, record: Path) -> list[str]:
    """Clears every limit `record` names (a daemon stopped for good left them set) and removes
    the record; one line per limit, saying what became of it."""
    said = []
    for (gpu, cgroup), hard in sorted(read_record(record).items()):
        if not Path(cgroup).is_dir():
            said.append(f"{cgroup} on GPU {gpu}: gone (its limit went with it)")
            continue
        try:
            nvml.set_memory_limit(gpu, cgroup, None)
        except MemoryLimitRefused as exc:
            said.append(f"{cgroup} on GPU {gpu}: still limited to {hard >> 20} MiB: {exc}")
            continue
        said.append(f"{cgroup} on GPU {gpu}: {hard >> 20} MiB limit cleared")
    if all("still limited" not in line for line in said):
        record.unlink(missing_ok=True)
    return said


def _code(why_not: str) -> str:
    for prefix, code in (("off in policy", "off"), ("no cgroup v2", "cgroup"), ("MIG", "mig")):
        if why_not.startswith(prefix):
            return code
    return "nvml"


class BackstopLoop:
    """Reconciles every `interval_s` on a thread, and at once when woken (limits published).

    `snapshot` returns (enabled, allowance, clients) as the core has them now. Limits stay set
    when the daemon stops: they keep protecting while it restarts (the next daemon takes them
    over from the record; a pod's go with its cgroup; `clear_recorded` after a stop for good).
    """

    def __init__(
        self,
        backstop: KernelBackstop,
        snapshot: Callable[[], tuple[bool, int, list[Holder]]],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self._backstop = backstop
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._woken = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def following(cls, backstop: KernelBackstop, engine: Reader, core: NodeCore) -> BackstopLoop:
        """A loop that reads the policy and the clients from the core, on the event loop."""

        def snapshot() -> tuple[bool, int, list[Holder]]:
            def read() -> tuple[bool, int, list[Holder]]:
                memory = core.state.policy.memory
                clients = holders(core.status(engine.now()))
                return memory.kernel_backstop, memory.backstop_allowance_bytes, clients

            return engine.read(read, timeout_s=1.0)  # never holds up a shutdown for long

        return cls(backstop, snapshot)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kernel-backstop", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._woken.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._woken.clear()
            try:
                enabled, allowance, clients = self._snapshot()
                self._backstop.reconcile(enabled=enabled, allowance=allowance, clients=clients)
            except Exception:  # a failed round must not end the backstop
                log.exception("kernel backstop: a reconcile failed; the next one tries again")
            self._woken.wait(self._interval_s)
