"""Authority from the node: root in a pod is a tenant; the hooks' socket takes no orders; pods get
a directory with only what hooks need, and nvsharectl's socket is out of their reach."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from appliance.kube.devices import Injection
from appliance.wire import protocol as p
from appliance.wire import socket_dirs

from .conftest import Stage

POD = "0b1c5e5e-1111-4222-8333-444455556666"

# A root process that asks the control socket for a state change once it is told to go (after
# the test has placed it in a pod), and prints the answer.
ASKER = """
import sys
from pathlib import Path
from appliance.wire import protocol as p
from appliance.cli.client import ControlClient
sys.stdin.readline()
with ControlClient(control_dir=Path(sys.argv[1]), timeout=10) as c:
    answer = c.request(p.SetTq(5))
    print(answer.status.name, answer.message)
    print(type(c.request(p.StatusRequest())).__name__)
"""


def ask_from(stage: Stage, place: str) -> list[str]:
    asker = subprocess.Popen(
        [sys.executable, "-c", ASKER, str(stage.control_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if place == "pod":
        stage.proc.pod(asker.pid, POD)
    else:
        stage.proc.host(asker.pid)
    out, _ = asker.communicate("go\n", timeout=30)
    return out.splitlines()


def test_root_in_a_pod_is_a_tenant_and_root_on_the_host_is_not(stage: Stage) -> None:
    stage.start()
    refused, status = ask_from(stage, "pod")
    assert refused.startswith("PERMISSION") and "a process in a pod is a tenant" in refused
    assert status == "JsonBody"  # status stays readable to anyone who reaches the socket
    assert stage.status()["default_time_quantum_s"] == 30  # nothing changed
    assert "refused to let" in stage.output()
    allowed, _ = ask_from(stage, "host")
    assert allowed.startswith("OK") and stage.status()["default_time_quantum_s"] == 5


def test_the_hook_socket_takes_no_orders_even_from_root(stage: Stage) -> None:
    stage.start()
    c = stage.hook()
    for ask in (p.SetTq(5), p.StatusRequest(), p.SetMode(p.WireMode.OFF)):
        answer = c.request(ask)
        assert isinstance(answer, p.Result) and answer.status is p.Status.PERMISSION
        assert "control.sock" in answer.message
    assert stage.status()["default_time_quantum_s"] == 30


def test_pods_get_a_directory_with_only_what_hooks_need(stage: Stage) -> None:
    stage.start()
    assert sorted(os.listdir(stage.socket_dir)) == ["limits", "scheduler.sock"]
    response = Injection(
        hook_host_path="/var/lib/nvshare/lib/libnvshare.so", socket_host_dir=str(stage.socket_dir)
    ).response(["GPU-x"], [])
    mounted = [Path(m.host_path) for m in response.mounts]
    control = stage.control_dir / socket_dirs.CONTROL_SOCKET_NAME
    assert control.exists()
    assert not any(control.is_relative_to(m) for m in mounted)
    assert all(m.read_only for m in response.mounts)
