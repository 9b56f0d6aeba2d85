"""A kube-scheduler HTTP extender that filters and ranks nodes by their GPUs' real free memory.

kube-scheduler calls it for pods that ask for a managed resource (`nvshare.com/gpu`, and
HAMi's `nvidia.com/gpumem`; see the KubeSchedulerConfiguration in deploy/extender.yaml):
`POST <urlPrefix>/filter` and `POST <urlPrefix>/prioritize` with an ExtenderArgs body. The
decisions are `appliance.placement.fit`'s; this module is the wire format, the caches and the
HTTP server around them.

Wire format. kube-scheduler's types (k8s.io/kube-scheduler/extender/v1, types.go) carry no
JSON tags, so Go's encoding/json writes the Go field names: ExtenderArgs is {"Pod", "Nodes",
"NodeNames"}, ExtenderFilterResult {"Nodes", "NodeNames", "FailedNodes",
"FailedAndUnresolvableNodes", "Error"}, HostPriorityList [{"Host", "Score"}], scores 0 to
MaxExtenderPriority (10). kube-scheduler's HTTPExtender (pkg/scheduler/extender.go, `send`)
POSTs json.Marshal(args) to urlPrefix + "/" + verb, treats any status but 200 as an error,
and reads the answer with json.Decoder, which matches keys case-insensitively. Releases before
the types moved there (pkg/scheduler/api/v1/types.go) tagged them in lower case ("pod",
"nodes", "nodenames", "failedNodes", "error", "host", "score"). So keys are read here
case-insensitively, as Go does, and written with the Go names, which every version reads.

Node status is read from informer caches (the Nodes' `nvshare.com/gpu-status` annotation, and
the bound pods' needs for the cached fallback), never per request. Until both caches have
listed, and on any error of its own, the extender keeps every node: with `ignorable: true`
kube-scheduler would carry on without it anyway, and a pod must not fail to schedule because
of us.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

from appliance.kube.informer import NodesAndBoundPods
from appliance.kube.resources import pod_request
from appliance.kube.serving import CacheBackedServer, ProbedHandler
from appliance.placement.demand import HAMI_GPUS, HAMI_MEMORY, pod_demand
from appliance.placement.fit import Basis, NodeJudge, NodeVerdict, NodeView, check_mode, scores
from appliance.placement.status import ANNOTATION, NodeGpuStatus, StatusError, decode
from appliance.policy.model import Policy, RealtimeCheckMode
from appliance.policy.quantity import format_bytes

log = logging.getLogger("nvshare.extender")

Obj = Mapping[str, Any]


# ---------------------------------------------------------------- wire format


class BadRequest(ValueError):
    """A body that is not an ExtenderArgs; answered with HTTP 400 and this message."""


def _key(doc: Obj, name: str) -> Any:
    """doc[name] as Go's encoding/json finds it: the exact key, else one differing in case."""
    if name in doc:
        return doc[name]
    lowered = name.lower()
    return next((v for k, v in doc.items() if k.lower() == lowered), None)


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    pod: Obj
    node_names: tuple[str, ...]
    nodes: tuple[Obj, ...] | None  # whole Node objects, when nodeCacheCapable is false


def parse_args(body: Any) -> ExtenderArgs:
    if not isinstance(body, dict):
        raise BadRequest("the body is not a JSON object (an ExtenderArgs)")
    pod = _key(body, "Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs has no Pod object")
    names = _key(body, "NodeNames")
    node_list = _key(body, "Nodes")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("NodeNames is not a list of names")
        return ExtenderArgs(pod=pod, node_names=tuple(names), nodes=None)
    if isinstance(node_list, dict):
        items = _key(node_list, "items") or []
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise BadRequest("Nodes.items is not a list of Node objects")
        names_of = tuple(str((n.get("metadata") or {}).get("name", "")) for n in items)
        return ExtenderArgs(pod=pod, node_names=names_of, nodes=tuple(items))
    raise BadRequest("ExtenderArgs has neither NodeNames nor Nodes")


def filter_result(
    args: ExtenderArgs, kept: Sequence[str], failed: Mapping[str, str]
) -> dict[str, Any]:
    """An ExtenderFilterResult in the form the request came in (names, or Node objects)."""
    nodes: dict[str, Any] | None = None
    names: list[str] | None = list(kept)
    if args.nodes is not None:
        keep = set(kept)
        items = [n for n in args.nodes if (n.get("metadata") or {}).get("name") in keep]
        nodes, names = {"items": items}, None
    return {
        "Nodes": nodes,
        "NodeNames": names,
        "FailedNodes": dict(failed),
        "FailedAndUnresolvableNodes": {},
        "Error": "",  # a message here fails the pod's scheduling cycle: never ours to cause
    }


def priority_list(node_scores: Mapping[str, int]) -> list[dict[str, Any]]:
    return [{"Host": node, "Score": score} for node, score in node_scores.items()]


# ---------------------------------------------------------------- caches


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A Node as the extender keeps it: its published status, or why there is none."""

    status: NodeGpuStatus | None
    error: str | None


def node_record(node: Obj) -> NodeRecord:
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(ANNOTATION)
    if text is None:
        return NodeRecord(None, f"no {ANNOTATION} annotation on the node")
    try:
        return NodeRecord(decode(str(text)), None)
    except StatusError as exc:
        return NodeRecord(None, f"{ANNOTATION} is unreadable: {exc}")


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A bound, unfinished pod holding GPU resources, slimmed to what its need depends on."""

    node: str
    pod: Obj


def bound_pod(pod: Obj) -> BoundPod | None:
    node = (pod.get("spec") or {}).get("nodeName") or ""
    wanted = ("nvshare.com/gpu", HAMI_GPUS, HAMI_MEMORY)
    if not node or not any(pod_request(pod, r) for r in wanted):
        return None
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    slim = {
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta
        },
        "spec": {
            kind: [{"resources": c.get("resources") or {}} for c in spec.get(kind) or []]
            for kind in ("containers", "initContainers")
        },
    }
    return BoundPod(node=str(node), pod=slim)


class ClusterView(NodesAndBoundPods[NodeRecord, BoundPod]):
    """Nodes' published GPU status and bound GPU pods, from two informers."""

    def __init__(self, *, api_client: Any, page_size: int = 500, **informer_options: Any) -> None:
        self._lock = threading.Lock()
        self._last_good: dict[str, NodeGpuStatus] = {}
        self._pods_by_node: dict[str, dict[str, Obj]] = {}
        self._where: dict[str, str] = {}  # pod uid -> node
        super().__init__(
            api_client=api_client, name="extender", page_size=page_size, **informer_options
        )

    def convert_node(self, node: Obj) -> NodeRecord:
        return node_record(node)

    def convert_pod(self, pod: Obj) -> BoundPod | None:
        return bound_pod(pod)

    def view(self, name: str, policy: Policy) -> NodeView:
        record = self.nodes.items().get(name)
        with self._lock:
            last_good = self._last_good.get(name)
            pods = list(self._pods_by_node.get(name, {}).values())
        bound = 0
        for pod in pods:
            demand = pod_demand(pod, policy)
            bound += (demand.memory_bytes or 0) * demand.gpus
        if record is None:
            return NodeView(name, None, "the node is not in the extender's cache", last_good, bound)
        return NodeView(name, record.status, record.error, last_good, bound)

    def node_set(self, name: str, record: NodeRecord) -> None:
        if record.status is not None:
            with self._lock:
                self._last_good[name] = record.status

    def node_gone(self, name: str, record: NodeRecord) -> None:
        with self._lock:
            self._last_good.pop(name, None)

    def pod_set(self, uid: str, pod: BoundPod) -> None:
        with self._lock:
            old = self._where.get(uid)
            if old is not None and old != pod.node:
                self._pods_by_node.get(old, {}).pop(uid, None)
            self._where[uid] = pod.node
            self._pods_by_node.setdefault(pod.node, {})[uid] = pod.pod

    def pod_gone(self, uid: str, pod: BoundPod) -> None:
        with self._lock:
            self._where.pop(uid, None)
            on_node = self._pods_by_node.get(pod.node, {})
            on_node.pop(uid, None)
            if not on_node:
                self._pods_by_node.pop(pod.node, None)


# ---------------------------------------------------------------- the extender


class Extender:
    """ExtenderArgs in, answers out; every node judged by `NodeJudge` from the caches."""

    def __init__(
        self,
        *,
        cluster: ClusterView,
        policy: Callable[[], Policy],
        switch: bool | None,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cluster = cluster
        self._policy = policy
        self._switch = switch
        self._clock = clock
        self._judge = NodeJudge()
        self._judge_lock = threading.Lock()
        self._not_synced_said = False
        self._nodes = Counter(
            "nvshare_extender_filter_nodes",
            "Nodes judged by the filter, by result",
            ["result"],
            registry=registry,
        )
        self._fallbacks = Counter(
            "nvshare_extender_fallbacks",
            "Nodes judged on cached data because their real-time status was missing or stale",
            registry=registry,
        )

    def _verdicts(self, args: ExtenderArgs) -> tuple[list[NodeVerdict], RealtimeCheckMode, str]:
        """The verdict on every node, the pod's mode, and a description of its need."""
        policy = self._policy()
        demand = pod_demand(args.pod, policy)
        for problem in demand.problems:
            log.warning("%s (for scheduling)", problem)
        mode = check_mode(policy, switch=self._switch, pod_opt_in=demand.realtime_check)
        need = "unknown" if demand.memory_bytes is None else format_bytes(demand.memory_bytes)
        described = (
            f"pod={demand.pod} need={need}x{demand.gpus} ({demand.source}) mode={mode.value}"
        )
        if mode is not RealtimeCheckMode.DISABLED and not self._cluster.synced:
            if not self._not_synced_said:
                log.warning("caches still listing: keeping every node unjudged (%s)", described)
                self._not_synced_said = True
            mode = RealtimeCheckMode.DISABLED
        now = self._clock()
        with self._judge_lock:
            verdicts = [
                self._judge.judge(
                    self._cluster.view(name, policy), demand, mode=mode, policy=policy, now=now
                )
                for name in args.node_names
            ]
        return verdicts, mode, described

    def filter(self, body: Any) -> dict[str, Any]:
        args = parse_args(body)
        try:
            verdicts, mode, described = self._verdicts(args)
        except Exception:  # fail open: our bug must not keep a pod from being scheduled
            log.exception("filter failed; keeping every node")
            return filter_result(args, args.node_names, {})
        kept = [v.node for v in verdicts if v.keep]
        failed = {v.node: v.reason for v in verdicts if not v.keep}
        for v in verdicts:
            result = "unjudged" if v.basis is Basis.NONE else "fits" if v.fits else "kept"
            self._nodes.labels(result=result if v.keep else "filtered").inc()
            if v.basis is Basis.CACHED:
                self._fallbacks.inc()
        if mode is not RealtimeCheckMode.DISABLED:
            log.info("filter %s: kept %d of %d nodes", described, len(kept), len(verdicts))
        return filter_result(args, kept, failed)

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        args = parse_args(body)
        try:
            verdicts, _, _ = self._verdicts(args)
        except Exception:
            log.exception("prioritize failed; scoring every node 0")
            return priority_list(dict.fromkeys(args.node_names, 0))
        return priority_list(scores(verdicts))


# ---------------------------------------------------------------- HTTP


class _Handler(ProbedHandler):
    server: ExtenderServer
    log_as = "extender"
    log = log

    def do_GET(self) -> None:  # noqa: N802
        if self.answer_probe():
            return
        if self.path == "/metrics":
            self.send(200, generate_latest(self.server.registry), "text/plain; version=0.0.4")
        else:
            self.send(404, b"not found\n")

    def do_POST(self) -> None:  # noqa: N802
        verb = self.path.rstrip("/").rsplit("/", 1)[-1]
        extender = self.server.extender
        handlers = {"filter": extender.filter, "prioritize": extender.prioritize}
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length))
            if verb not in handlers:
                self.send(404, f"no verb {verb!r}: POST .../filter or .../prioritize\n".encode())
                return
            answer = handlers[verb](body)
        except (ValueError, UnicodeDecodeError) as exc:  # BadRequest, bad JSON, bad length
            log.warning("extender: bad %s request from %s: %s", verb, self.client_address[0], exc)
            self.send(400, f"expected an ExtenderArgs: {exc}\n".encode())
            return
        self.send(200, json.dumps(answer).encode(), "application/json")


class ExtenderServer(CacheBackedServer):
    """Plain HTTP: /filter, /prioritize (POST, under any prefix), /healthz, /readyz, /metrics."""

    def __init__(
        self,
        *,
        extender: Extender,
        registry: CollectorRegistry,
        host: str = "0.0.0.0",
        port: int = 8888,
        ready: Callable[[], bool] = lambda: True,
        sources: Sequence[Any] = (),
    ) -> None:
        super().__init__((host, port), _Handler, ready=ready, sources=sources)
        self.extender = extender
        self.registry = registry


def build_extender_server(
    *,
    policy_dir: Path,
    api_client: Any,
    switch: bool | None,
    port: int,
    host: str = "0.0.0.0",
) -> ExtenderServer:
    """The production extender, bound but not serving; its caches and policy watch started.

    An invalid policy at start raises PolicyLoadError (the caller reports it); later, an
    invalid policy keeps the last good one, as in the node daemon.
    """
    from appliance.policy.watch import PolicyWatcher

    watcher = PolicyWatcher(
        Path(policy_dir),
        on_policy=lambda policy: None,  # read through `last_good`, the newest valid policy
        on_error=lambda errors: None,  # the watcher logs them
    )
    first = watcher.start()
    registry = CollectorRegistry()
    cluster = ClusterView(api_client=api_client)
    extender = Extender(
        cluster=cluster,
        policy=lambda: watcher.last_good or first,
        switch=switch,
        registry=registry,
    )
    server = ExtenderServer(
        extender=extender,
        registry=registry,
        host=host,
        port=port,
        ready=lambda: cluster.synced,
        sources=[cluster, watcher],
    )
    cluster.start()
    return server


def serve_extender(server: ExtenderServer) -> None:
    host, port = server.server_address[:2]
    log.info("scheduler extender listening on http://%s:%d", host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def run_extender(
    *, policy_dir: Path, kube_api: str | None, switch: bool | None, host: str, port: int
) -> int:
    """`nvshare-scheduler extender`: 0 when stopped by a signal, 2 on a bad policy, 1 otherwise."""
    import signal

    from appliance.kube.api import KubeConfigError, api_client_from_env
    from appliance.policy.errors import PolicyLoadError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        api_client = api_client_from_env(kube_api)
    except KubeConfigError as exc:  # it says what was tried and what to give
        log.error("refusing to start: %s", exc)
        return 1
    try:
        server = build_extender_server(
            policy_dir=policy_dir,
            api_client=api_client,
            switch=switch,
            host=host,
            port=port,
        )
    except PolicyLoadError as exc:
        log.error("refusing to start: the policy in %s is invalid:", policy_dir)
        for err in exc.errors:
            log.error("  %s", err)
        return 2
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        serve_extender(server)
    except KeyboardInterrupt:
        pass
    return 0
