"""What a pod's processes see of the GPU, through the real pynvml and the CUDA driver, CUDA
initialised or not: its limit as the total, its pod's use as used, its pod's processes with
their usage; a process with no limit sees the real GPU. Fake API server + daemon + fake-CUDA
programs under the hook; the viewer is tests/e2e/shown_gpu.py (the same program tests/gpu runs
against a real GPU)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon.conftest import RunningDaemon, start_daemon
from hook.fake_scheduler import FakeScheduler
from kube.fakeapi import FakeApiServer

from appliance.core.published import PublishedLimits
from appliance.daemon.limits_file import render

from .probes import BUILD, Probe

GiB, MiB = 1 << 30, 1 << 20
FAKE_GPU = 16 * GiB
VIEWER = Path(__file__).with_name("shown_gpu.py")
# The viewers name their pod (test processes are in no pod's cgroup): this uid's claims count.
POLICY = f"""
scheduler: {{mode: 'off'}}
rules:
  - {{name: team, match: {{namespace: team}}, memoryLimit: 1Gi}}
trust: {{podClaimUids: [{os.getuid()}]}}
"""


@pytest.fixture
def node() -> Iterator[RunningDaemon]:
    api = FakeApiServer().start()
    api.add_node("node-1")
    api.add_pod("pod-a", namespace="team", node="node-1")
    api.add_pod("pod-b", namespace="team", node="node-1")
    tmp = Path(tempfile.mkdtemp(prefix="nvs-view-"))
    d = start_daemon(tmp, POLICY, args=["--node-name", "node-1", "--kube-api", api.url])
    try:
        yield d
    finally:
        d.stop()
        api.stop()
        shutil.rmtree(tmp, ignore_errors=True)


class Viewer:
    """tests/e2e/shown_gpu.py under the hook, in a pod (by name) or outside any."""

    def __init__(self, d: RunningDaemon, pod: str = "", *args: str) -> None:
        env = {
            **d.env,
            "LD_PRELOAD": str(BUILD / "libnvshare.so"),
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(FAKE_GPU),
            "NVSHARE_FAKE_NVML_STATE": str(d.socket_dir.parent / "nvml-state"),
        }
        if pod:
            env |= {"NVSHARE_POD_NAMESPACE": "team", "NVSHARE_POD_NAME": pod}
        self.proc = subprocess.Popen(
            [sys.executable, str(VIEWER), *args],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def shown(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.finish()[1]
        return json.loads(line)  # type: ignore[no-any-return]

    def finish(self) -> tuple[int, str]:
        _, err = self.proc.communicate("\n", timeout=30)
        return self.proc.returncode, err


def look(d: RunningDaemon, pod: str = "") -> dict[str, Any]:
    """How GPU 0 looks to a process that never initialises CUDA (nvidia-smi, a sidecar)."""
    v = Viewer(d, pod)
    shown = v.shown()
    assert v.finish() == (0, "")
    return shown


def eventually(d: RunningDaemon, pod: str, want: Any, key: str = "v1") -> dict[str, Any]:
    """The hooks report usage on their own time (a service tick): look until it shows."""
    deadline = time.monotonic() + 20
    while (shown := look(d, pod))[key] != want:
        assert time.monotonic() < deadline, f"{key} still {shown[key]}, not {want}"
        time.sleep(0.05)
    return shown


def test_a_pod_sees_its_limit_its_use_and_its_processes_cuda_or_not(node: RunningDaemon) -> None:
    a, b = Probe(node, "team", "pod-a"), Probe(node, "team", "pod-a")
    assert a.ask("init") == b.ask("init") == "ok"
    assert a.ask(f"alloc mem {300 * MiB}").startswith("ok")
    assert b.ask(f"alloc mem {100 * MiB}").startswith("ok")
    # no CUDA in the viewer: the limit from policy, what both processes hold, and who they are
    shown = eventually(node, "pod-a", [GiB, 400 * MiB, 624 * MiB])
    assert shown["v2"] == [GiB, 400 * MiB, 624 * MiB, 0]
    listed = sorted([[a.pid, 300 * MiB], [b.pid, 100 * MiB]])
    for version in ("compute_v3", "compute_v2", "compute_v1"):
        assert sorted(shown[version]) == listed, version
    assert shown["graphics"] == []

    # a process of the pod that initialised CUDA sees the same GPU, itself in it, everywhere
    v = Viewer(node, "pod-a", "--cuda", str(200 * MiB), "--hold")
    mine = v.shown()
    pod_used = 600 * MiB
    assert mine["mem_get_info"] == [GiB - pod_used, GiB]
    assert mine["device_total"] == GiB
    assert mine["v1"] == [GiB, pod_used, GiB - pod_used]
    assert mine["compute_v3"][0] == [v.proc.pid, 200 * MiB]  # itself first
    assert sorted(mine["compute_v3"][1:]) == listed
    # and the others see it too
    eventually(node, "pod-a", [GiB, pod_used, GiB - pod_used])
    assert v.finish()[0] == 0
    assert a.close() == b.close() == 0


def test_another_pod_and_the_host_see_their_own_gpu(node: RunningDaemon) -> None:
    a = Probe(node, "team", "pod-a")
    assert a.ask("init") == "ok" and a.ask(f"alloc mem {300 * MiB}").startswith("ok")
    (node.socket_dir.parent / "nvml-state").write_text(f"0 {3 * GiB} 3 0 {a.pid}:{700 * MiB}\n")
    eventually(node, "pod-a", [GiB, 300 * MiB, 724 * MiB])
    # pod-b shares the node, not pod-a's memory or processes
    other = look(node, "pod-b")
    assert other["v1"] == [GiB, 0, GiB] and other["compute_v3"] == []
    # a host process with no limit sees the real GPU, every process on it
    host = look(node)
    assert host["v1"] == [FAKE_GPU, 3 * GiB, FAKE_GPU - 3 * GiB]
    assert len(host["compute_v3"]) == 3 and [a.pid, 700 * MiB] in host["compute_v3"]
    assert a.close() == 0
    assert "Traceback" not in node.output()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A socket directory of our own (short: a socket path must fit in 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="nvs-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def look_alone(sock_dir: Path, **extra: str) -> dict[str, Any]:
    """How GPU 0 looks to a process without CUDA, with whatever serves `sock_dir` (if anyone)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("NVSHARE_")},
        "LD_PRELOAD": str(BUILD / "libnvshare.so"),
        "LD_LIBRARY_PATH": str(BUILD / "fake"),
        "NVSHARE_SOCKET_DIR": str(sock_dir),
        **extra,
    }
    out = subprocess.run(
        [sys.executable, str(VIEWER)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("daemon", ["hung", "old"])
def test_a_daemon_that_does_not_answer_leaves_the_process_its_own_view(
    daemon: str, sock_dir: Path
) -> None:
    """A scheduler that accepts but never answers (hung), or answers VIEW_REQUEST with an
    error (an older daemon): every query is answered, the wait bounded by the daemon timeout,
    with what the process knows itself."""
    with contextlib.ExitStack() as stack:
        if daemon == "hung":
            hung = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            hung.bind(str(sock_dir / "scheduler.sock"))
            hung.listen(16)  # connections wait in the backlog; nobody reads them
        else:
            stack.enter_context(FakeScheduler(str(sock_dir)))  # VIEW_REQUEST: unknown type
        shown = look_alone(
            sock_dir, NVSHARE_GPU_MEMORY_LIMIT="512Mi", NVSHARE_DAEMON_TIMEOUT_MS="300"
        )
    assert shown["v1"] == [512 * MiB, 0, 512 * MiB]
    assert shown["compute_v3"] == []


def test_without_a_daemon_a_viewer_sees_the_limit_published_for_it(sock_dir: Path) -> None:
    """The daemon restarting or gone: nvidia-smi shows the limit the pod's CUDA processes apply
    meanwhile (the one the daemon published), not the whole GPU."""
    (sock_dir / "limits").write_text(render(PublishedLimits(default=2 * GiB)))
    (sock_dir / "limits").chmod(0o644)
    assert look_alone(sock_dir)["v1"] == [2 * GiB, 0, 2 * GiB]
