"""Shares per tenant, not per connection: ten connections of one pod annotated
`gpu-core-request: 10` under `annotations.maxCoreRequest: 10` are guaranteed 10 % together
(issue 24 item 5: they added up to 100 %, and the victim ran one kernel in 15 s)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import GPU, REGISTER_MANY, Stage, eventually, listed_pods, wait_listed

REQUEST = "nvshare.com/gpu-core-request"
MEMORY = "nvshare.com/gpu-memory-limit"
CONNECTIONS = 10

# Registers N hook connections from one process, says so, and keeps them until stdin closes.


@pytest.fixture
def greedy(stage: Stage) -> Iterator[dict[str, str]]:
    stage.policy = "annotations: {maxCoreRequest: 10}\n"
    with listed_pods(stage, greedy={REQUEST: "10", MEMORY: "1Gi"}) as uids:
        yield uids


def test_ten_connections_of_a_pod_share_its_capped_request(
    stage: Stage, hooked: Any, greedy: dict[str, str]
) -> None:
    stage.start()
    listed = hooked(pod=greedy["greedy"])  # a program of the pod, to see the watch list it
    listed.ok("init")
    wait_listed(stage, listed, 1 << 30)
    many = subprocess.Popen(
        [sys.executable, "-c", REGISTER_MANY, str(stage.socket_dir / "scheduler.sock"), "10", GPU],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stage.proc.pod(many.pid, greedy["greedy"])
        assert many.stdin is not None and many.stdout is not None
        many.stdin.write("placed\n")
        many.stdin.flush()
        assert many.stdout.readline() == "registered\n"
        clients = eventually(
            lambda: [c for c in stage.status()["clients"] if c["pid"] == many.pid] or None,
            "the pod's connections",
        )
        assert len(clients) == CONNECTIONS
        assert {c["core_request"] for c in clients} == {10}  # each asks the pod's 10
        pod = [c for c in stage.status()["clients"] if c["pod_uid"] == greedy["greedy"]]
        assert sum(c["core_guaranteed"] for c in pod) == pytest.approx(
            10, abs=0.1
        )  # was 100: 11 x 10, scaled
    finally:
        many.kill()
        many.wait()
        for f in (many.stdin, many.stdout):
            if f is not None:
                f.close()
