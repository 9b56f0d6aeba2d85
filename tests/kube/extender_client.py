"""Talking to the scheduler extender as kube-scheduler does, for the tests that run it."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from typing import Any

WAIT = 20.0  # a bound for what takes milliseconds; never a measurement

# What kube-scheduler sends and reads (cited in appliance/cluster/extender.py's docstring):
# k8s.io/kube-scheduler/extender/v1/types.go declares these structs without JSON tags, so
# encoding/json uses the Go field names; pkg/scheduler/extender.go (HTTPExtender.send) POSTs
# json.Marshal(args) to urlPrefix/verb and decodes the answer case-insensitively.
EXTENDER_ARGS = {"Pod", "Nodes", "NodeNames"}
FILTER_RESULT = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
HOST_PRIORITY = {"Host", "Score"}
MAX_EXTENDER_PRIORITY = 10
# Before those types moved to k8s.io/kube-scheduler, pkg/scheduler/api/v1/types.go tagged
# ExtenderArgs as "pod", "nodes", "nodenames".
LEGACY_ARGS = {"pod", "nodes", "nodenames"}


def eventually(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def gpu_pod(
    name: str = "train",
    *,
    annotations: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    namespace: str = "team",
) -> dict[str, Any]:
    """A pod as kube-scheduler passes it: the whole v1.Pod."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "annotations": annotations or {},
        },
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [
                {
                    "name": "main",
                    "image": "pytorch/pytorch",
                    "resources": {"limits": limits or {"nvshare.com/gpu": "1"}},
                }
            ],
        },
        "status": {"phase": "Pending"},
    }


def args(pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs as json.Marshal writes it for a nodeCacheCapable extender."""
    return {"Pod": pod, "Nodes": None, "NodeNames": names}


class ExtenderClient:
    """What kube-scheduler's HTTPExtender does: POST JSON to urlPrefix/verb, keep-alive."""

    def __init__(self, port: int, prefix: str = "") -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.prefix = prefix

    def post(self, verb: str, body: Any) -> tuple[int, Any]:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.conn.request(
            "POST", f"{self.prefix}/{verb}", payload, {"Content-Type": "application/json"}
        )
        answer = self.conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            return answer.status, data.decode()
        return answer.status, json.loads(data)

    def filter(self, body: Any) -> dict[str, Any]:
        status, result = self.post("filter", body)
        assert status == 200, result
        assert set(result) == FILTER_RESULT
        return dict(result)

    def prioritize(self, body: Any) -> dict[str, int]:
        status, result = self.post("prioritize", body)
        assert status == 200, result
        assert all(set(entry) == HOST_PRIORITY for entry in result)
        assert all(0 <= entry["Score"] <= MAX_EXTENDER_PRIORITY for entry in result)
        return {entry["Host"]: entry["Score"] for entry in result}

    def get(self, path: str) -> int:
        self.conn.request("GET", path)
        answer = self.conn.getresponse()
        answer.read()
        return int(answer.status)

    def close(self) -> None:
        self.conn.close()
