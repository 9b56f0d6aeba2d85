"""Prometheus metrics, read from the scheduler's state at scrape time.

Names follow nvshare's quota fork (`nvshare_gpu_*`, `nvshare_client_*`, `nvshare_scheduler_*`),
with its meanings and labels where it has the metric (`nvshare_gpu_utilization_ratio`,
`nvshare_gpu_memory_used_bytes`, `nvshare_client_info`, `nvshare_client_managed_allocated_bytes`,
`nvshare_client_nvml_used_bytes`, `nvshare_scheduler_running_clients`, ...), so its dashboards
keep working; GPU time per client and per pod (`*_lock_held_seconds_total`, ...) and policy
reload health (`nvshare_policy_*`) are ours. The collector reads the same typed `StatusView` as
`nvsharectl status` (through a snapshot function that the daemon runs on the event loop), so
tests scrape a real registry without a daemon.

Cardinality is bounded: client series exist only for connected clients (a client that leaves
takes its series with it; its pod keeps the totals), pod series for pods with a client or with
retained totals (`core.state.RETAINED_PODS`), and past `max_clients`/`max_pods` series the rest
are left out and counted in `nvshare_metrics_series_omitted`. Label values are names and ids,
never free text. A value that does not exist is no sample, never a 0: a client without a memory
limit has no `nvshare_client_memory_limit_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.drops import DropReason
from appliance.core.events import ReleaseReason
from appliance.core.gputime import LockTime, PodView
from appliance.core.state import Phase
from appliance.core.views import ClientView, PolicyStatus, StatusView
from appliance.wire.protocol import wire_mode

Snapshot = Callable[[], StatusView]

MAX_CLIENT_SERIES = 1000
MAX_POD_SERIES = 1000
DROP_REASONS = tuple(DropReason)  # always exported: rate() sees them from 0

_COUNTERS = (
    ("grants", "Lock grants"),
    ("registrations", "Client registrations"),
    ("disconnects", "Client disconnections"),
    ("limit_updates", "Limit updates pushed to hooks"),
    ("realtime_warnings", "Real-time checks that would have refused (warning mode)"),
    ("realtime_refusals", "Reservations refused by the real-time check"),
    ("drops_overdue", "Holders passed over: not released within scheduler.dropDeadline"),
    ("releases_late", "Releases that arrived after the drop deadline had passed"),
)
CLIENT_LABELS = ["client_id", "namespace", "pod", "gpu_uuid"]
POD_LABELS = ["namespace", "pod"]
GPU_LABELS = ["gpu_uuid", "gpu_index"]  # nvshare's, for the metrics it has


class ApplianceCollector(Collector):
    def __init__(
        self,
        snapshot: Snapshot,
        *,
        max_clients: int = MAX_CLIENT_SERIES,
        max_pods: int = MAX_POD_SERIES,
    ) -> None:
        self._snapshot = snapshot
        self._max_clients = max_clients
        self._max_pods = max_pods

    def collect(self) -> Iterator[Metric]:
        status = self._snapshot()
        clients = status.clients[: self._max_clients]
        pods = _pods_to_show(status.pods)[: self._max_pods]
        yield from _gpus(status)
        yield from _gpu_use(status)
        yield from _unhooked(status)
        yield from _clients(status, clients)
        yield from _client_gangs(clients)
        yield from _client_time(clients)
        yield from _pods(pods)
        yield from _scheduler(status)
        yield from _backstop(status)
        if status.policy is not None:
            yield from _policy(status.policy)
        omitted = GaugeMetricFamily(
            "nvshare_metrics_series_omitted",
            "Clients or pods left out of the metrics past the series bound",
            labels=["kind"],
        )
        omitted.add_metric(["client"], len(status.clients) - len(clients))
        omitted.add_metric(["pod"], len(status.pods) - len(pods))
        yield omitted


def _pods_to_show(pods: Sequence[PodView]) -> tuple[PodView, ...]:
    """Pods with connected clients first, then the most recently departed."""
    return (*(p for p in pods if p.clients), *reversed([p for p in pods if not p.clients]))


def _index(index: int | None) -> str:
    return "" if index is None else str(index)


def _gpus(status: StatusView) -> Iterator[Metric]:
    labels = ["gpu_uuid"]
    mode = GaugeMetricFamily(
        "nvshare_gpu_mode", "Scheduling mode: 0 off, 1 on, 2 auto", labels=labels
    )
    tq = GaugeMetricFamily("nvshare_gpu_time_quantum_seconds", "Time quantum", labels=labels)
    mem = GaugeMetricFamily(
        "nvshare_gpu_memory_total_bytes",
        "GPU memory the scheduler plans with (declared or reported)",
        labels=labels,
    )
    holders = GaugeMetricFamily(
        "nvshare_gpu_lock_holders", "Clients holding the lock", labels=labels
    )
    queue = GaugeMetricFamily(
        "nvshare_gpu_queue_length", "Clients waiting for the lock", labels=labels
    )
    requested = GaugeMetricFamily(
        "nvshare_gpu_core_requested_percent",
        "Guaranteed shares (coreRequest) of the GPU's clients together; over 100 they are "
        "scaled down to fit",
        labels=labels,
    )
    running = GaugeMetricFamily(
        "nvshare_scheduler_running_clients",
        "Clients holding the lock (nvshare's running list)",
        labels=GPU_LABELS,
    )
    for g in status.gpus:
        label = [g.uuid]
        mode.add_metric(label, wire_mode(g.mode))
        tq.add_metric(label, g.time_quantum_s)
        mem.add_metric(label, g.memory_total)
        holders.add_metric(label, len(g.holders))
        queue.add_metric(label, len(g.queue))
        requested.add_metric(label, g.core_requested)
        running.add_metric([g.uuid, _index(g.index)], len(g.holders))
    yield from (mode, tq, mem, holders, queue, requested, running)


def _gpu_use(status: StatusView) -> Iterator[Metric]:
    """What NVML last showed of each GPU as a whole (every process, hooked or not)."""
    util = GaugeMetricFamily(
        "nvshare_gpu_utilization_ratio", "GPU utilization from NVML (0-1)", labels=GPU_LABELS
    )
    used = GaugeMetricFamily(
        "nvshare_gpu_memory_used_bytes",
        "GPU memory in use from NVML, every process's",
        labels=GPU_LABELS,
    )
    for u in status.use:
        label = [u.uuid, _index(u.index)]
        if u.utilization_percent is not None:
            util.add_metric(label, u.utilization_percent / 100)
        if u.memory_used is not None:
            used.add_metric(label, u.memory_used)
    yield from (util, used)


def _unhooked(status: StatusView) -> Iterator[Metric]:
    """Per GPU, so the label set stays as small as the node's GPUs whatever runs on them."""
    count = GaugeMetricFamily(
        "nvshare_gpu_unhooked_processes",
        "Compute processes NVML lists that never registered with the scheduler (unshared)",
        labels=["gpu_uuid"],
    )
    per_gpu = dict.fromkeys((g.uuid for g in status.gpus), 0)
    for process in status.unhooked:
        for gpu in process.gpus:
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    for uuid, n in sorted(per_gpu.items()):
        count.add_metric([uuid], n)
    yield count


def _client_label(c: ClientView) -> list[str]:
    return [str(c.id), c.namespace, c.pod_name or c.pod_uid, c.gpu]


def _clients(status: StatusView, clients: Sequence[ClientView]) -> Iterator[Metric]:
    index = {g.uuid: g.index for g in status.gpus}
    info = GaugeMetricFamily(
        "nvshare_client_info",
        "A connected client (value 1), with its host PID",
        labels=[*CLIENT_LABELS, "gpu_index", "host_pid"],
    )
    allocated = GaugeMetricFamily(
        "nvshare_client_managed_allocated_bytes",
        "Memory the client allocated through the hook (what its limit counts)",
        labels=CLIENT_LABELS,
    )
    nvml = GaugeMetricFamily(
        "nvshare_client_nvml_used_bytes",
        "Memory NVML shows the client's process holding, its CUDA context included",
        labels=[*CLIENT_LABELS, "host_pid"],
    )
    limit = GaugeMetricFamily(
        "nvshare_client_memory_limit_bytes",
        "Effective memory limit (no sample: no limit)",
        labels=CLIENT_LABELS,
    )
    core = GaugeMetricFamily(
        "nvshare_client_core_limit_percent", "Effective compute share", labels=CLIENT_LABELS
    )
    prio = GaugeMetricFamily(
        "nvshare_client_priority",
        "Scheduling priority (low -100, normal 0, high 100; higher is granted first)",
        labels=CLIENT_LABELS,
    )
    guaranteed = GaugeMetricFamily(
        "nvshare_client_core_guaranteed_percent",
        "Guaranteed share under contention: its coreRequest, scaled down when a GPU's requests "
        "sum to more than 100",
        labels=CLIENT_LABELS,
    )
    holding = GaugeMetricFamily(
        "nvshare_client_holding_lock", "1 while holding the lock", labels=CLIENT_LABELS
    )
    late = GaugeMetricFamily(
        "nvshare_client_late_drops",
        "Drops the client did not release within scheduler.dropDeadline",
        labels=CLIENT_LABELS,
    )
    for c in clients:
        label = _client_label(c)
        info.add_metric([*label, _index(index.get(c.gpu)), str(c.pid)], 1)
        allocated.add_metric(label, c.memory_used)
        if c.memory_observed is not None:
            nvml.add_metric([*label, str(c.pid)], c.memory_observed)
        if c.memory_limit is not None:
            limit.add_metric(label, c.memory_limit)
        core.add_metric(label, c.core_limit)
        prio.add_metric(label, c.priority)
        guaranteed.add_metric(label, c.core_guaranteed)
        holding.add_metric(label, 1 if c.state in (Phase.HOLDING, Phase.DRAINING) else 0)
        late.add_metric(label, c.late_drops)
    yield from (info, allocated, nvml, limit, core, prio, guaranteed, holding, late)


def _client_gangs(clients: Sequence[ClientView]) -> Iterator[Metric]:
    """The gang each client of a multi-GPU job takes its locks with (`core.gang`)."""
    gang = GaugeMetricFamily(
        "nvshare_client_gang_info",
        "A client that takes its GPUs' locks with its job's other clients (value 1)",
        labels=[*CLIENT_LABELS, "gang"],
    )
    for c in clients:
        if c.gang:
            gang.add_metric([*_client_label(c), c.gang], 1)
    yield gang


def _client_time(clients: Sequence[ClientView]) -> Iterator[Metric]:
    """GPU time as the lock accounts it, exactly; and where each quota window stands."""
    families = _time_families("client", CLIENT_LABELS)
    refusals = CounterMetricFamily(
        "nvshare_client_memory_refusals",
        "Allocations refused, by the scheduler or by the client's hook",
        labels=CLIENT_LABELS,
    )
    window_used = GaugeMetricFamily(
        "nvshare_client_core_window_usage_ms",
        "Compute-quota time billed in the current window, debt included",
        labels=CLIENT_LABELS,
    )
    window_limit = GaugeMetricFamily(
        "nvshare_client_core_window_limit_ms",
        "Compute-quota budget of a window",
        labels=CLIENT_LABELS,
    )
    for c in clients:
        label = _client_label(c)
        _add_time(families, label, c.lock)
        refusals.add_metric(label, c.memory_refusals)
        if c.quota is not None:
            window_used.add_metric(label, c.quota.used_s * 1000)
            window_limit.add_metric(label, c.quota.budget_s * 1000)
    yield from (*families, refusals, window_used, window_limit)


def _pods(pods: Sequence[PodView]) -> Iterator[Metric]:
    """A pod's clients together, with what its departed clients used."""
    families = _time_families("pod", POD_LABELS)
    clients = GaugeMetricFamily(
        "nvshare_pod_clients", "Connected clients of the pod", labels=POD_LABELS
    )
    used = GaugeMetricFamily(
        "nvshare_pod_memory_used_bytes",
        "Memory the pod's clients allocated through the hook",
        labels=POD_LABELS,
    )
    nvml = GaugeMetricFamily(
        "nvshare_pod_nvml_used_bytes",
        "Memory NVML shows the pod's processes holding, CUDA contexts included",
        labels=POD_LABELS,
    )
    for pod in pods:
        label = [pod.namespace, pod.name or pod.uid]
        _add_time(families, label, pod.lock)
        clients.add_metric(label, len(pod.clients))
        used.add_metric(label, pod.memory_used)
        if pod.memory_observed is not None:
            nvml.add_metric(label, pod.memory_observed)
    yield from (*families, clients, used, nvml)


def _time_families(
    kind: str, labels: list[str]
) -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
    return (
        CounterMetricFamily(
            f"nvshare_{kind}_lock_held_seconds",
            "Time holding the GPU lock, from grant to release (the drain after a drop included)",
            labels=labels,
        ),
        CounterMetricFamily(
            f"nvshare_{kind}_lock_wait_seconds",
            "Time waiting for the GPU lock, from request to grant",
            labels=labels,
        ),
        CounterMetricFamily(
            f"nvshare_{kind}_drops",
            "Times told to drop the lock, by reason",
            labels=[*labels, "reason"],
        ),
    )


def _add_time(
    families: tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily],
    label: list[str],
    lock: LockTime,
) -> None:
    held, waited, drops = families
    held.add_metric(label, lock.held_s)
    waited.add_metric(label, lock.waited_s)
    for reason in sorted({*DROP_REASONS, *lock.drops}):
        drops.add_metric([*label, reason], lock.drops.get(reason, 0))


def _scheduler(status: StatusView) -> Iterator[Metric]:
    counters = status.counters
    clients = GaugeMetricFamily("nvshare_scheduler_clients", "Connected clients")
    clients.add_metric([], len(status.clients))
    yield clients
    for name, help_text in _COUNTERS:
        fam = CounterMetricFamily(f"nvshare_scheduler_{name}", help_text)
        fam.add_metric([], counters.get(name, 0))
        yield fam
    refusals = CounterMetricFamily(
        "nvshare_scheduler_memory_refusals",
        "Allocations refused: by the scheduler (a reservation) or by a hook on its own (over "
        "the limit it knows)",
        labels=["decided_by"],
    )
    refusals.add_metric(["scheduler"], counters.get("memory_refusals", 0))
    refusals.add_metric(["hook"], counters.get("memory_refusals_hook", 0))
    yield refusals
    drops = CounterMetricFamily(
        "nvshare_scheduler_drops", "Lock drops by reason", labels=["reason"]
    )
    for reason in DROP_REASONS:
        drops.add_metric([reason], counters.get(f"drops_{reason}", 0))
    yield drops
    releases = CounterMetricFamily(
        "nvshare_scheduler_releases", "Lock releases by reason", labels=["reason"]
    )
    for release in ReleaseReason:
        releases.add_metric([release.value], counters.get(f"releases_{release.value}", 0))
    yield releases


def _backstop(status: StatusView) -> Iterator[Metric]:
    active = GaugeMetricFamily(
        "nvshare_gpu_kernel_backstop_active",
        "1 where the driver enforces hard per-cgroup memory limits the daemon set (MPS v3 "
        "memory partitioning); 0 with the reason: off, nvml, driver, cgroup, mig, permission, "
        "unsupported",
        labels=["gpu_uuid", "reason"],
    )
    limits = GaugeMetricFamily(
        "nvshare_gpu_kernel_backstop_cgroups",
        "Cgroups with a kernel-enforced hard memory limit on this GPU",
        labels=["gpu_uuid"],
    )
    for b in status.backstop:
        active.add_metric([b.gpu, b.code], 1 if b.active else 0)
        limits.add_metric([b.gpu], len(b.limits))
    yield active
    yield limits


def _policy(policy: PolicyStatus) -> Iterator[Metric]:
    valid = GaugeMetricFamily("nvshare_policy_valid", "1 if the last reload attempt was valid")
    valid.add_metric([], 1 if policy.valid else 0)
    yield valid
    last = GaugeMetricFamily(
        "nvshare_policy_last_reload_timestamp_seconds",
        "Wall time of the last reload attempt",
    )
    last.add_metric([], policy.last_reload_time or 0)
    yield last
    reloads = CounterMetricFamily(
        "nvshare_policy_reloads", "Policy reloads by result", labels=["result"]
    )
    for result, n in sorted(policy.reload_counts.items()):
        reloads.add_metric([result], n)
    yield reloads
