"""The scheduler extender as a plain HTTP server: /filter and /prioritize under any prefix,
probes and /metrics, the caches and the policy (the same `PolicyWatcher` as the node daemon),
and `nvshare-scheduler extender`'s start and stop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from appliance.cluster.cluster_view import ClusterView
from appliance.cluster.extender import Extender
from appliance.cluster.serving import (
    BadBody,
    CacheBackedServer,
    ProbedHandler,
    Refused,
    run_until_stopped,
)
from appliance.web.listen import EVERY_ADDRESS, bind

log = logging.getLogger("nvshare.extender")  # one logger for the extender program

Obj = Mapping[str, Any]

# ExtenderArgs with nodeCacheCapable (deploy/extender.yaml): a pod and the node names, about
# 1 MiB for a pod and 15,000 nodes; anything past this is not one.
MAX_BODY_BYTES = 4 << 20


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
        handler = {"filter": extender.filter, "prioritize": extender.prioritize}.get(verb)
        try:
            with self.server.in_flight():
                body = self.read_json(MAX_BODY_BYTES)
                if handler is None:
                    self.send(
                        404, f"no verb {verb!r}: POST .../filter or .../prioritize\n".encode()
                    )
                    return
                answer = handler(body)
        except BadBody as refusal:
            self.refuse_body(refusal, "an ExtenderArgs")
            return
        except ValueError as exc:  # BadRequest: not an ExtenderArgs
            self.refuse_body(BadBody(400, str(exc)), "an ExtenderArgs")
            return
        self.send(200, json.dumps(answer).encode(), "application/json")


class ExtenderServer(CacheBackedServer):
    """Plain HTTP: /filter, /prioritize (POST, under any prefix), /healthz, /readyz, /metrics."""

    def __init__(
        self,
        *,
        extender: Extender,
        registry: CollectorRegistry,
        host: str = EVERY_ADDRESS,
        port: int = 8888,
        **serving: Any,  # CacheBackedServer's: not_ready, unhealthy, sources
    ) -> None:
        super().__init__((host, port), _Handler, **serving)
        self.extender = extender
        self.registry = registry


def build_extender_server(
    *,
    policy_dir: Path,
    api_client: Any,
    switch: bool | None,
    port: int,
    host: str = EVERY_ADDRESS,
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
    server = bind(
        lambda at: ExtenderServer(
            extender=extender,
            registry=registry,
            host=at[0],
            port=at[1],
            not_ready=cluster.not_ready,
            unhealthy=cluster.unhealthy,
            sources=[cluster, watcher],
        ),
        host,
        port,
        what="scheduler extender",
    )
    cluster.start()
    return server


def run_extender(
    *, policy_dir: Path, kube_api: str | None, switch: bool | None, host: str, port: int
) -> int:
    """`nvshare-scheduler extender`: 0 when stopped by a signal, 2 on a bad policy, 1 otherwise."""

    def build() -> ExtenderServer:
        from appliance.kube.api import KubeConfigError, api_client_from_env
        from appliance.policy.errors import PolicyLoadError

        try:
            return build_extender_server(
                policy_dir=policy_dir,
                api_client=api_client_from_env(kube_api),
                switch=switch,
                host=host,
                port=port,
            )
        except KubeConfigError as exc:  # it says what was tried and what to give
            raise Refused(str(exc)) from None
        except PolicyLoadError as exc:
            raise Refused(
                f"the policy in {policy_dir} is invalid:", *map(str, exc.errors), status=2
            ) from None
        except OSError as exc:
            raise Refused(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None

    return run_until_stopped(build, "scheduler extender", log)
