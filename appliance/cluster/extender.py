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

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from appliance.cluster.cluster_view import ClusterView
from appliance.placement.demand import pod_demand
from appliance.placement.fit import Basis, NodeJudge, NodeVerdict, check_mode, scores
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


# ---------------------------------------------------------------- decisions


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
