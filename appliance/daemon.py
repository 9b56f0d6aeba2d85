"""The composition root: wires sources (policy dir, pod watch, NVML) and sinks (socket server,
metrics, Kubernetes Events, systemd) around the scheduler core. No scheduling logic lives here.

Sources on threads (the policy watcher, the pod watcher, the NVML sampler) hand their events
to the engine (`appliance.engine`), which feeds the core on the asyncio loop and routes its
actions to the sinks; only the loop touches the core.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from appliance import sdnotify, socket_dirs
from appliance.admission import raise_open_files
from appliance.codec import NodeGpus
from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.authority import Authority
from appliance.core.node import NodeCore
from appliance.engine import Engine
from appliance.gpu.backstop import RECORD_NAME, BackstopLoop, KernelBackstop
from appliance.gpu.nvml import Nvml
from appliance.gpu.sampler import Consumer, NvmlSampler, gpu_sampled, processes_seen
from appliance.host.cgroup import own_pod
from appliance.host.process import ProcessIdentities
from appliance.limit_log import LimitChangeLog, limit_context
from appliance.limits_file import LimitsFile
from appliance.metrics import ApplianceCollector
from appliance.metrics_endpoint import start_metrics
from appliance.policy.errors import PolicyLoadError
from appliance.policy.model import Policy
from appliance.policy.watch import PolicyWatcher
from appliance.probes import LoopProbes, start_probes
from appliance.queries import Answers
from appliance.server import SchedulerServer
from appliance.socket_claim import SocketUnavailable

if TYPE_CHECKING:
    from appliance.kube.access import Permissions
    from appliance.kube.deviceplugin import DevicePlugin
    from appliance.kube.node_status import NodeStatusPublisher
    from appliance.kube.pod_watch import PodWatcher
    from appliance.kube.recorder import EventRecorder

log = logging.getLogger("nvshare.daemon")

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    policy_dir: Path
    socket_dir: Path
    control_dir: Path | None = None  # None: the socket directory's sibling `<name>-control`
    admin_group: str | None = None
    node_name: str | None = None
    kube_api: str | None = None
    device_plugin: bool = False
    hook_host_path: str = "/var/lib/nvshare/lib/libnvshare.so"
    device_plugin_dir: Path = DEVICE_PLUGIN_DIR  # kubelet's; tests give a temp dir
    debug: bool = False
    metrics: bool = True  # tests turn the HTTP endpoint off
    probe_address: str | None = None  # /healthz and /readyz here too, with or without metrics
    open_files: int = 65536  # the soft limit of open files the daemon raises itself to
    proc_root: Path = Path("/proc")  # tests give a tree whose cgroup files say "a pod"
    cgroup_root: Path = Path("/sys/fs/cgroup")  # where the kernel backstop finds cgroups

    @property
    def control(self) -> Path:
        return self.control_dir or socket_dirs.control_dir_for(self.socket_dir, {})


class Daemon:
    def __init__(self, config: DaemonConfig, *, nvml: Nvml | None = None) -> None:
        self.config = config
        self.nvml = nvml or Nvml()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.watcher = PolicyWatcher(
            config.policy_dir,
            on_policy=self._on_policy,
            on_error=lambda errors: None,  # the watcher logs them; status and metrics show them
        )
        self.core: NodeCore | None = None
        self.engine: Engine | None = None
        self.answers: Answers | None = None
        self.server: SchedulerServer | None = None
        self.registry = CollectorRegistry()
        self._stopping: asyncio.Event | None = None
        self._ready = False
        self._threads: list[Any] = []  # started sources and sinks with a stop()
        self._tasks: list[asyncio.Task[None]] = []
        self._api: Any = None  # the Kubernetes ApiClient, with --node-name
        self.events: EventRecorder | None = None
        self.device_plugin: DevicePlugin | None = None
        self.node_status: NodeStatusPublisher | None = None
        self.pod_watcher: PodWatcher | None = None
        self.permissions: Permissions | None = None  # what RBAC refused, with --node-name
        self.backstop = KernelBackstop(  # driver-enforced limits, where the policy asks
            self.nvml,
            cgroup_root=config.cgroup_root,
            proc_root=config.proc_root,
            record=config.socket_dir / RECORD_NAME,
        )
        self._backstop_loop: BackstopLoop | None = None

    # ------------------------------------------------------------------ glue

    def _on_policy(self, policy: Policy) -> None:
        """From the watcher's thread; the first policy (at start) arrives before the engine
        exists, and the core is built with it."""
        if self.engine is not None:
            self.engine.submit(ev.PolicyChanged(policy))
        if self.node_status is not None:
            self.node_status.set_settings(policy.realtime_check.published())

    # ------------------------------------------------------------ sources and sinks

    def _start_kube(self, policy: Policy) -> None:
        from appliance.kube.access import Permissions  # only with --node-name
        from appliance.kube.pod_watch import PodWatcher
        from appliance.kube.recorder import EventRecorder

        assert self.config.node_name and self._api is not None and self.engine is not None
        api, engine = self._api, self.engine
        self.permissions = permissions = Permissions(api)
        self._threads.append(permissions)
        self.events = recorder = EventRecorder(
            api, node_name=self.config.node_name, permissions=permissions
        )
        engine.connect(lambda w: recorder.warn(w.pod, w.reason, w.message), act.PodWarning)
        self.pod_watcher = watcher = PodWatcher(
            api_client=api,
            node_name=self.config.node_name,
            on_pod=lambda pod: engine.submit(ev.PodSeen(pod)),
            on_pod_deleted=lambda ref: engine.submit(ev.PodRemoved(ref)),
            permissions=permissions,
            on_listed=lambda uids: engine.submit(ev.PodsListed(frozenset(uids))),
        )
        watcher.start()
        self._threads.append(watcher)
        log.info("watching pods of node %s", self.config.node_name)
        if self.nvml.available:
            self._start_node_status(api, policy)

    def _start_node_status(self, api: Any, policy: Policy) -> None:
        from appliance.kube.node_status import NodeStatusPublisher

        assert self.core is not None and self.config.node_name
        self.node_status = NodeStatusPublisher(
            api_client=api,
            node_name=self.config.node_name,
            inventory=self.nvml.inventory(),
            settings=policy.realtime_check.published(),
            registry=self.registry,
            permissions=self.permissions,
        )
        self.node_status.start()
        self._threads.append(self.node_status)

    def _start_device_plugin(self, policy: Policy) -> None:
        from appliance.kube.deviceplugin import DevicePlugin

        engine, core, settings = self.engine, self.core, policy.device_plugin
        assert engine is not None and core is not None
        plugin = DevicePlugin(
            gpus=self.nvml.inventory,
            health=self.nvml.healthy,
            replicas_per_gpu=settings.replicas_per_gpu,
            resource_name=settings.resource_name,
            hook_host_path=self.config.hook_host_path,
            socket_host_dir=str(self.config.socket_dir),
            load=lambda: engine.read(core.load),
            gpu_index=lambda uuid: next(
                (g.index for g in self.nvml.inventory() if g.uuid == uuid), None
            ),
            kubelet_dir=self.config.device_plugin_dir,
        )
        plugin.start()
        self._threads.append(plugin)
        self.device_plugin = plugin
        engine.connect(lambda a: plugin.set_replicas(a.replicas_per_gpu), act.ReplicasChanged)

    # ------------------------------------------------------------------- run

    def _start_nvml_sampler(self) -> None:
        assert self.engine is not None
        engine = self.engine
        identities = ProcessIdentities(proc_root=self.config.proc_root)
        consumers: list[Consumer] = [
            lambda samples: engine.submit(gpu_sampled(samples)),
            lambda samples: engine.submit(processes_seen(samples, identities)),
        ]
        if self.node_status is not None:
            consumers.append(self.node_status.offer)
        sampler = NvmlSampler(self.nvml, consumers)
        sampler.start()
        self._threads.append(sampler)

    async def _watchdog(self, interval: float) -> None:
        while True:
            sdnotify.notify("WATCHDOG=1")
            await asyncio.sleep(interval / 2)

    def _reload(self) -> None:
        sdnotify.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        result = self.watcher.reload_now()
        log.info("SIGHUP: policy reload %s", getattr(result, "value", result))
        sdnotify.notify("READY=1", "STATUS=policy reloaded")

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the exit status. Every way it cannot start is one log
        line saying why, and leaves no socket behind."""
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        problem = self._preflight()
        if problem is None:
            problem, policy = self._first_policy()
        if problem is not None:
            log.error("refusing to start: %s", problem)
            return 2
        assert policy is not None
        self._build(policy, self.loop)
        assert self.server is not None and self.engine is not None
        # Before the sockets exist: a SIGTERM as soon as they appear still ends in a clean exit
        # that removes them, not in the default action.
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopping.set)
        self.loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            await self.server.start()
        except SocketUnavailable as exc:
            log.error("refusing to start: %s", exc)
            self.watcher.stop()
            return 1
        self.engine.dispatch(ev.Tick())  # the first event: publishes the limits hooks fall back to
        try:
            return await self._serve(policy)
        finally:
            await self._shutdown()

    def _build(self, policy: Policy, loop: asyncio.AbstractEventLoop) -> None:
        """The core, the engine that feeds it, and the server and limits file it speaks through."""
        config = self.config
        open_files = raise_open_files(config.open_files)
        inventory = {g.uuid: g for g in (self.nvml.inventory() if self.nvml.available else [])}
        limits_file = LimitsFile(config.socket_dir)
        self.core = NodeCore(
            policy,
            inventory=inventory,
            watching_pods=config.node_name is not None,
            authority=Authority(
                admin_group=config.admin_group,
                own_pod_uid=own_pod(config.proc_root),
                daemon_uid=os.geteuid(),
            ),
            remembered=limits_file.read_previous(),
        )
        self.engine = Engine(self.core, loop=loop)
        self.answers = Answers(
            self.core,
            clock=self.engine.now,
            watcher=self.watcher,
            policy_dir=self.config.policy_dir,
            nvml_available=self.nvml.available,
            backstop=self.backstop.views,
            backstop_for=self.backstop.explain,
        )
        engine, core = self.engine, self.core
        self.server = SchedulerServer(
            socket_dir=config.socket_dir,
            control_dir=config.control,
            dispatch=engine.dispatch,
            status=self.answers.status,
            status_document=self.answers.status_document,
            queries=self.answers.queries,
            view=core.memory_view,
            generation=lambda: engine.generation,
            caps=lambda: core.state.policy.connections,
            open_files=open_files,
            proc_root=config.proc_root,
            gpus=lambda: NodeGpus.of(inventory.values(), core.state.policy),
        )
        narrated = LimitChangeLog(
            self.server.send,
            context=lambda client_id: limit_context(core, client_id),
            live=lambda: len(core.state.clients),
        )
        engine.connect(narrated, *LimitChangeLog.ACTIONS)
        engine.connect(
            self.server.send,
            *(a for a in SchedulerServer.ACTIONS if a not in LimitChangeLog.ACTIONS),
        )
        engine.connect(self._limits_published(limits_file), act.LimitsPublished)

    def _limits_published(self, limits_file: LimitsFile) -> Any:
        """The published limits go to the file hooks fall back to, and wake the backstop."""

        def sink(a: act.LimitsPublished) -> None:
            limits_file.write(a.limits)
            if self._backstop_loop is not None:
                self._backstop_loop.wake()

        return sink

    def _start_backstop(self) -> None:
        engine, core = self.engine, self.core
        assert engine is not None and core is not None
        self._backstop_loop = BackstopLoop.following(self.backstop, engine, core)
        self._backstop_loop.start()
        self._threads.append(self._backstop_loop)

    def _preflight(self) -> str | None:
        """What makes the configuration unusable, found before anything is claimed."""
        config = self.config
        if config.admin_group is not None:
            try:
                grp.getgrnam(config.admin_group)
            except KeyError:
                return f"--admin-group {config.admin_group!r} is not a group on this machine"
        if config.device_plugin and not config.device_plugin_dir.is_dir():
            where = config.device_plugin_dir
            return (
                f"--device-plugin: kubelet's device-plugin directory {where} does not exist; "
                "mount it from the host (kubelet creates it) or leave the plugin off"
            )
        if config.node_name:
            from appliance.kube.api import KubeConfigError, api_client_from_env

            try:
                self._api = api_client_from_env(config.kube_api)
            except KubeConfigError as exc:
                return f"--node-name {config.node_name}: {exc}"
        return None

    def _first_policy(self) -> tuple[str | None, Policy | None]:
        directory = self.config.policy_dir
        if directory.exists() and not directory.is_dir():
            return (
                f"--policy-dir {directory} is not a directory: give the directory that holds "
                "the policy files (env NVSHARE_POLICY_DIR), such as configmaps/default in the "
                "source tree; `nvsharectl policy validate FILE` checks a single file",
                None,
            )
        if not directory.is_dir():
            return (
                f"the policy directory {directory} does not exist; give one with --policy-dir "
                "DIR (env NVSHARE_POLICY_DIR), such as configmaps/default in the source tree",
                None,
            )
        try:
            return None, self.watcher.start()
        except PolicyLoadError as exc:
            errors = "\n".join(f"  {err}" for err in exc.errors)
            return f"the policy in {directory} is invalid:\n{errors}", None

    async def _serve(self, policy: Policy) -> int:
        assert self.loop is not None and self._stopping is not None and self.server is not None
        if self.config.metrics and policy.metrics.enabled:
            self._start_metrics(policy)
        if self.config.probe_address:
            self._start_probes(self.config.probe_address)
        try:
            if self.config.node_name:
                self._start_kube(policy)
            if self.config.device_plugin:
                self._start_device_plugin(policy)
            if self.nvml.available:
                self._start_nvml_sampler()
                self._start_backstop()
        except Exception as exc:
            log.error("stopping: %s", exc)
            return 1
        if (interval := sdnotify.watchdog_interval()) is not None:
            self._tasks.append(asyncio.create_task(self._watchdog(interval)))
        self._ready = True
        sdnotify.notify("READY=1", f"STATUS=serving {self.server.path}")
        log.info(
            "nvshare scheduler ready (policy %s, mode %s, TQ %gs)",
            policy.content_hash[:12],
            policy.scheduler.mode.value,
            policy.scheduler.time_quantum_s,
        )
        await self._stopping.wait()
        return 0

    def _start_metrics(self, policy: Policy) -> None:
        engine, answers = self.engine, self.answers
        assert engine is not None and answers is not None
        self.registry.register(ApplianceCollector(lambda: engine.read(answers.status)))
        probes = LoopProbes(engine.read, not_ready=self._not_ready, unhealthy=self._unhealthy)
        start_metrics(policy.metrics.address, self.registry, probes.health, probes.readiness)

    def _start_probes(self, address: str) -> None:
        assert self.engine is not None
        probes = LoopProbes(self.engine.read, not_ready=self._not_ready, unhealthy=self._unhealthy)
        start_probes(address, probes.health, probes.readiness)

    def _not_ready(self) -> list[str]:
        """Why the daemon is not doing its whole job yet (/readyz; on the event loop)."""
        reasons = [] if self._ready else ["starting"]
        watcher, plugin = self.pod_watcher, self.device_plugin
        if watcher is not None and not watcher.synced.is_set():
            reasons.append(f"the first list of node {self.config.node_name}'s pods is not in yet")
        if plugin is not None and not plugin.registered:
            reasons.append(
                f"the device plugin is not registered with kubelet ({plugin.kubelet_dir})"
            )
        if self.permissions is not None:
            reasons += [f"RBAC forbids {p}" for p in self.permissions.missing()]
        return reasons

    def _unhealthy(self) -> list[str]:
        """What only a restart mends (/healthz; on the event loop, which answering proves alive)."""
        watcher = self.pod_watcher
        if watcher is not None and self._ready and not watcher.alive:
            return ["the pod watch stopped (its thread died)"]
        return []

    async def _shutdown(self) -> None:
        sdnotify.notify("STOPPING=1")
        log.info("stopping")
        for t in self._tasks:
            t.cancel()
        for thing in self._threads:
            thing.stop()
        if self.events is not None:
            self.events.close()
        self.watcher.stop()
        if self.engine is not None:
            self.engine.close()
        if self.server is not None:
            await self.server.stop()


def run_daemon(config: DaemonConfig) -> int:
    logging.basicConfig(
        level=logging.DEBUG if config.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return asyncio.run(Daemon(config).run())
