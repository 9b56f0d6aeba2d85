"""The composition root: wires sources (policy dir, pod watch, NVML) and sinks (socket server,
metrics, Kubernetes Events, systemd) around the scheduler core. No scheduling logic lives here.

Sources on threads (the policy watcher, the pod watcher, the NVML sampler) hand their events
to the engine (`appliance.daemon.engine`), which feeds the core on the asyncio loop and routes its
actions to the sinks; only the loop touches the core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import grp
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop
from prometheus_client import CollectorRegistry

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.authority import Authority
from appliance.core.node import NodeCore
from appliance.daemon import sdnotify
from appliance.daemon.engine import Engine
from appliance.daemon.limit_log import LimitChangeLog, limit_context
from appliance.daemon.limits_file import LimitsFile
from appliance.daemon.queries import Answers
from appliance.gpu.backstop import RECORD_NAME, BackstopLoop, KernelBackstop
from appliance.gpu.nvml import Nvml
from appliance.gpu.sampler import Consumer, NvmlSampler, gpu_sampled, processes_seen
from appliance.host.cgroup import own_pod
from appliance.host.process import ProcessIdentities
from appliance.policy.errors import PolicyLoadError
from appliance.policy.model import Policy
from appliance.policy.watch import PolicyWatcher
from appliance.serve.admission import raise_open_files
from appliance.serve.server import SchedulerServer
from appliance.serve.socket_claim import SocketUnavailable
from appliance.web.metrics import ApplianceCollector
from appliance.web.metrics_endpoint import start_metrics
from appliance.web.probes import LoopProbes, start_probes
from appliance.wire import socket_dirs
from appliance.wire.codec import NodeGpus

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
    metrics: bool = True  # tests turn the HTTP endpoint off
    probe_address: str | None = None  # /healthz and /readyz here too, with or without metrics
    open_files: int = 65536  # the soft limit of open files the daemon raises itself to
    proc_root: Path = Path("/proc")  # tests give a tree whose cgroup files say "a pod"
    cgroup_root: Path = Path("/sys/fs/cgroup")  # where the kernel backstop finds cgroups

    @property
    def control(self) -> Path:
        return self.control_dir or socket_dirs.control_dir_for(self.socket_dir, {})


@dataclass(frozen=True, slots=True)
class Wiring:
    """The daemon once its first policy is in, built in one step (`Daemon._wire`): the event loop,
    the core, the engine that feeds it, the answers read on it, the server it speaks through, and
    the backstop's loop that follows it (started only where NVML is)."""

    loop: asyncio.AbstractEventLoop
    core: NodeCore
    engine: Engine
    answers: Answers
    server: SchedulerServer
    backstop_loop: BackstopLoop


@dataclass(frozen=True, slots=True)
class Edges:
    """The Kubernetes edges the configuration asks for, started together; None where it does not
    ask for one (no --node-name, no --device-plugin, no NVML for the node status)."""

    permissions: Permissions | None = None
    events: EventRecorder | None = None
    pod_watcher: PodWatcher | None = None
    node_status: NodeStatusPublisher | None = None
    device_plugin: DevicePlugin | None = None


class Daemon:
    def __init__(self, config: DaemonConfig, *, nvml: Nvml | None = None) -> None:
        self.config = config
        self.nvml = nvml or Nvml()
        self.watcher = PolicyWatcher(
            config.policy_dir,
            on_policy=self._on_policy,
            on_error=lambda errors: None,  # the watcher logs them; status and metrics show them
        )
        self.registry = CollectorRegistry()
        record = config.socket_dir / RECORD_NAME  # what it set, for a later daemon to clear
        self.backstop = KernelBackstop(  # driver-enforced limits, where the policy asks
            self.nvml, cgroup_root=config.cgroup_root, proc_root=config.proc_root, record=record
        )
        self._stopping = asyncio.Event()
        self._ready = False
        self._threads: list[Any] = []  # started sources and sinks with a stop()
        self._tasks: list[asyncio.Task[None]] = []
        # The wiring, once the first policy is in and the loop runs (for tests and the watcher's
        # thread: a promise, never a half-built daemon); the edges, once they are all started.
        self.serving: concurrent.futures.Future[Wiring] = concurrent.futures.Future()
        self.edges = Edges()

    def _on_policy(self, policy: Policy) -> None:
        """From the watcher's thread; the first policy (at start) arrives before the engine
        exists, and the core is built with it."""
        if self.serving.done():
            self.serving.result().engine.submit(ev.PolicyChanged(policy))
        if self.edges.node_status is not None:
            self.edges.node_status.set_settings(policy.realtime_check.published())

    # ------------------------------------------------------------ sources and sinks

    def _start_kube(self, w: Wiring, policy: Policy, node: str, api: Any) -> Edges:
        from appliance.kube.access import Permissions  # only with --node-name
        from appliance.kube.pod_watch import PodWatcher
        from appliance.kube.recorder import EventRecorder

        engine = w.engine
        permissions = Permissions(api)
        self._threads.append(permissions)
        recorder = EventRecorder(api, node_name=node, permissions=permissions)
        engine.connect(lambda w: recorder.warn(w.pod, w.reason, w.message), act.PodWarning)
        watcher = PodWatcher(
            api_client=api,
            node_name=node,
            on_pod=lambda pod: engine.submit(ev.PodSeen(pod)),
            on_pod_deleted=lambda ref: engine.submit(ev.PodRemoved(ref)),
            permissions=permissions,
            on_listed=lambda uids: engine.submit(ev.PodsListed(frozenset(uids))),
        )
        watcher.start()
        self._threads.append(watcher)
        log.info("watching pods of node %s", node)
        status = (
            self._start_node_status(api, policy, node, permissions) if self.nvml.available else None
        )
        return Edges(permissions, recorder, watcher, status)

    def _start_node_status(
        self, api: Any, policy: Policy, node: str, permissions: Permissions
    ) -> NodeStatusPublisher:
        from appliance.kube.node_status import NodeStatusPublisher

        publisher = NodeStatusPublisher(
            api_client=api,
            node_name=node,
            inventory=self.nvml.inventory(),
            settings=policy.realtime_check.published(),
            registry=self.registry,
            permissions=permissions,
        )
        publisher.start()
        self._threads.append(publisher)
        return publisher

    def _start_device_plugin(self, w: Wiring, policy: Policy) -> DevicePlugin:
        from appliance.kube.deviceplugin import DevicePlugin

        engine, core, settings = w.engine, w.core, policy.device_plugin
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
        engine.connect(lambda a: plugin.set_replicas(a.replicas_per_gpu), act.ReplicasChanged)
        return plugin

    # ------------------------------------------------------------------- run

    def _start_nvml_sampler(self, engine: Engine, status: NodeStatusPublisher | None) -> None:
        identities = ProcessIdentities(proc_root=self.config.proc_root)
        consumers: list[Consumer] = [
            lambda samples: engine.submit(gpu_sampled(samples)),
            lambda samples: engine.submit(processes_seen(samples, identities)),
        ]
        if status is not None:
            consumers.append(status.offer)
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
        loop = asyncio.get_running_loop()
        api = self._preflight()
        policy = api if isinstance(api, str) else self._first_policy()
        if isinstance(policy, str):
            log.error("refusing to start: %s", policy)
            return 2
        w = self._wire(policy, loop)
        self.serving.set_result(w)
        # Before the sockets exist: a SIGTERM as soon as they appear still ends in a clean exit
        # that removes them, not in the default action.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            await w.server.start()
        except SocketUnavailable as exc:
            log.error("refusing to start: %s", exc)
            self.watcher.stop()
            return 1
        w.engine.dispatch(ev.Tick())  # the first event: publishes the limits hooks fall back to
        try:
            return await self._serve(w, policy, api)
        finally:
            await self._shutdown(w)

    def _wire(self, policy: Policy, loop: asyncio.AbstractEventLoop) -> Wiring:
        """The core, the engine that feeds it, and the server and limits file it speaks through."""
        config = self.config
        open_files = raise_open_files(config.open_files)
        inventory = {g.uuid: g for g in (self.nvml.inventory() if self.nvml.available else [])}
        limits_file = LimitsFile(config.socket_dir)
        # who may change state: root, the admin group, the daemon's own user and pod
        authority = Authority(config.admin_group, own_pod(config.proc_root), os.geteuid())
        core = NodeCore(
            policy,
            inventory=inventory,
            watching_pods=config.node_name is not None,
            authority=authority,
            remembered=limits_file.read_previous(),
        )
        engine = Engine(core, loop=loop)
        answers = Answers(
            core,
            clock=engine.now,
            watcher=self.watcher,
            policy_dir=self.config.policy_dir,
            nvml_available=self.nvml.available,
            backstop=self.backstop.views,
            backstop_for=self.backstop.explain,
        )
        server = SchedulerServer(
            socket_dir=config.socket_dir,
            control_dir=config.control,
            dispatch=engine.dispatch,
            status=answers.status,
            status_document=answers.status_document,
            queries=answers.queries,
            view=core.memory_view,
            generation=lambda: engine.generation,
            caps=lambda: core.state.policy.connections,
            open_files=open_files,
            proc_root=config.proc_root,
            gpus=lambda: NodeGpus.of(inventory.values(), core.state.policy),
        )
        server.admission.pod_known = core.state.pods.pods.__contains__
        narrated = LimitChangeLog(
            server.send,
            context=lambda client_id: limit_context(core, client_id),
            live=lambda: len(core.state.clients),
        )
        engine.connect(narrated, *LimitChangeLog.ACTIONS)
        engine.connect(server.reply, act.Reply)
        engine.connect(  # (every hand-off's grant and drop: straight to the hooks' socket)
            server.hooks.send,
            *(a for a in act.HOOK_ACTIONS if a not in LimitChangeLog.ACTIONS),
        )
        backstop_loop = BackstopLoop.following(self.backstop, engine, core)

        def published(a: act.LimitsPublished) -> None:
            """To the file hooks fall back to, and a wake-up for the backstop."""
            limits_file.write(a.limits)
            backstop_loop.wake()

        engine.connect(published, act.LimitsPublished)
        return Wiring(loop, core, engine, answers, server, backstop_loop)

    def _preflight(self) -> str | Any:
        """What makes the configuration unusable, found before anything is claimed; else the
        Kubernetes ApiClient with --node-name (None without)."""
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
                return api_client_from_env(config.kube_api)
            except KubeConfigError as exc:
                return f"--node-name {config.node_name}: {exc}"
        return None

    def _first_policy(self) -> str | Policy:
        """The policy at start, or why there is none."""
        directory = self.config.policy_dir
        if directory.exists() and not directory.is_dir():
            return (
                f"--policy-dir {directory} is not a directory: give the directory that holds "
                "the policy files (env NVSHARE_POLICY_DIR), such as configmaps/default in the "
                "source tree; `nvsharectl policy validate FILE` checks a single file"
            )
        if not directory.is_dir():
            return (
                f"the policy directory {directory} does not exist; give one with --policy-dir "
                "DIR (env NVSHARE_POLICY_DIR), such as configmaps/default in the source tree"
            )
        try:
            return self.watcher.start()
        except PolicyLoadError as exc:
            errors = "\n".join(f"  {err}" for err in exc.errors)
            return f"the policy in {directory} is invalid:\n{errors}"

    async def _serve(self, w: Wiring, policy: Policy, api: Any) -> int:
        if self.config.metrics and policy.metrics.enabled:
            self._start_metrics(w, policy)
        if self.config.probe_address:
            self._start_probes(w, self.config.probe_address)
        try:
            self.edges = self._start_edges(w, policy, api)
        except Exception as exc:
            log.error("stopping: %s", exc)
            return 1
        if (interval := sdnotify.watchdog_interval()) is not None:
            self._tasks.append(asyncio.create_task(self._watchdog(interval)))
        self._ready = True
        sdnotify.notify("READY=1", f"STATUS=serving {w.server.path}")
        log.info(
            "nvshare scheduler ready (policy %s, mode %s, TQ %gs)",
            policy.content_hash[:12],
            policy.scheduler.mode.value,
            policy.scheduler.time_quantum_s,
        )
        await self._stopping.wait()
        return 0

    def _start_edges(self, w: Wiring, policy: Policy, api: Any) -> Edges:
        """The Kubernetes edges asked for, then the NVML sampler and the backstop where NVML is."""
        node = self.config.node_name
        edges = self._start_kube(w, policy, node, api) if node else Edges()
        if self.config.device_plugin:
            edges = dataclasses.replace(edges, device_plugin=self._start_device_plugin(w, policy))
        if self.nvml.available:
            self._start_nvml_sampler(w.engine, edges.node_status)
            w.backstop_loop.start()
            self._threads.append(w.backstop_loop)
        return edges

    def _start_metrics(self, w: Wiring, policy: Policy) -> None:
        engine, answers = w.engine, w.answers
        self.registry.register(ApplianceCollector(lambda: engine.read_steps(answers.status_slices)))
        probes = LoopProbes(engine.read, not_ready=self._not_ready, unhealthy=self._unhealthy)
        start_metrics(policy.metrics.address, self.registry, probes.health, probes.readiness)

    def _start_probes(self, w: Wiring, address: str) -> None:
        probes = LoopProbes(w.engine.read, not_ready=self._not_ready, unhealthy=self._unhealthy)
        start_probes(address, probes.health, probes.readiness)

    def _not_ready(self) -> list[str]:
        """Why the daemon is not doing its whole job yet (/readyz; on the event loop)."""
        reasons = [] if self._ready else ["starting"]
        watcher, plugin = self.edges.pod_watcher, self.edges.device_plugin
        if watcher is not None and not watcher.synced.is_set():
            reasons.append(f"the first list of node {self.config.node_name}'s pods is not in yet")
        if plugin is not None and not plugin.registered:
            reasons.append(
                f"the device plugin is not registered with kubelet ({plugin.kubelet_dir})"
            )
        if self.edges.permissions is not None:
            reasons += [f"RBAC forbids {p}" for p in self.edges.permissions.missing()]
        return reasons

    def _unhealthy(self) -> list[str]:
        """What only a restart mends (/healthz; on the event loop, which answering proves alive)."""
        watcher = self.edges.pod_watcher
        if watcher is not None and self._ready and not watcher.alive:
            return ["the pod watch stopped (its thread died)"]
        return []

    async def _shutdown(self, w: Wiring) -> None:
        sdnotify.notify("STOPPING=1")
        log.info("stopping")
        for t in self._tasks:
            t.cancel()
        for thing in self._threads:
            thing.stop()
        if self.edges.events is not None:
            self.edges.events.close()
        self.watcher.stop()
        w.engine.close()
        await w.server.stop()


def run_daemon(config: DaemonConfig) -> int:
    # On uvloop's event loop (libuv), not asyncio's: a hand-off's reads and writes cost less
    return uvloop.run(Daemon(config).run())
