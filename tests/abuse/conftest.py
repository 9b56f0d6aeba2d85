"""The drills' stage: a real daemon (`nvshare-scheduler`) on real sockets, a fake /proc that puts
processes on the host or in pods, raw clients that say what a hostile tenant would, and hooked
fake-driver processes (the hook tests' probe) as their victims.

Processes are placed by the fake /proc (`--proc-root`): the daemon reads `<root>/<pid>/cgroup`,
so a test decides who is a tenant of which pod; a process it never placed has no readable
cgroup, which the daemon treats as "not known to be on the host".
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from daemon.conftest import BIN
from hook.conftest import Probe, Variant, built, plain, probes, start_probe  # noqa: F401
from kube import manifests
from kube.fakeapi import FakeApiServer

from appliance.cli.client import ControlClient
from appliance.daemon.limits_file import LIMITS_NAME
from appliance.wire import protocol as p
from appliance.wire import socket_dirs

GiB = 1 << 30
MiB = 1 << 20
GPU = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"  # the fake driver's device 0
HOST_CGROUP = "0::/user.slice/user-0.slice/session-1.scope\n"
# A process of a pod (placed by the test, which then writes a line) that registers N hook
# connections on GPU, says "registered" and waits for a line; a test appends what it sends next.
REGISTER_MANY = """
import socket, sys
from appliance.wire import framing
from appliance.wire import protocol as p
path, n, gpu = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.stdin.readline()  # placed in its pod
conns = [socket.socket(socket.AF_UNIX) for _ in range(n)]
for s in conns:
    s.connect(path)
    s.sendall(framing.encode(p.Register(pid=0, gpu_uuid=gpu, gpu_total_mem=80 << 30), seq=1))
for s in conns:
    s.recv(1 << 16)  # registered
print("registered", flush=True)
sys.stdin.readline()
"""


class FakeProc:
    """/proc as the daemon reads it: each process placed here shows the cgroup it was given."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def place(self, pid: int, cgroup: str) -> None:
        entry = self.root / str(pid)
        entry.mkdir(exist_ok=True)
        (entry / "cgroup").write_text(cgroup)
        for name in ("status", "exe"):
            link = entry / name
            if not link.is_symlink():
                real = Path(f"/proc/{pid}/{name}")
                link.symlink_to(os.readlink(real) if name == "exe" else real)

    def host(self, pid: int) -> None:
        self.place(pid, HOST_CGROUP)

    def pod(self, pid: int, pod_uid: str) -> None:
        slice_uid = pod_uid.replace("-", "_")
        container = "ab" * 32
        self.place(
            pid,
            "0::/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{slice_uid}.slice/cri-containerd-{container}.scope\n",
        )


@dataclass
class Stage:
    """One daemon and its directories; `start`, `stop` and `start` again like a restart."""

    base: Path
    proc: FakeProc
    policy: str = ""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    daemon: subprocess.Popen[bytes] | None = None
    opened: list[Any] = field(default_factory=list)
    open_files: int | None = None  # the daemon's hard (and soft) limit of open files

    @property
    def socket_dir(self) -> Path:
        return self.base / "run"

    @property
    def control_dir(self) -> Path:
        return self.base / "run-control"

    @property
    def policy_dir(self) -> Path:
        return self.base / "policy"

    @property
    def log(self) -> Path:
        return self.base / "daemon.log"

    def hook_env(self, **extra: str) -> dict[str, str]:
        return {"NVSHARE_SOCKET_DIR": str(self.socket_dir), "NVSHARE_FAKE_GPU_UUID": GPU, **extra}

    def start(self) -> Stage:
        self.policy_dir.mkdir(exist_ok=True)
        (self.policy_dir / "policy.yaml").write_text(self.policy + "\nmetrics: {enabled: false}\n")
        command = [str(BIN / "nvshare-scheduler"), "--policy-dir", str(self.policy_dir)]
        command += ["--socket-dir", str(self.socket_dir), "--proc-root", str(self.proc.root)]
        env = {**os.environ, **self.env}
        env.pop("NVSHARE_CONTROL_DIR", None)
        if self.open_files is not None:
            command = ["prlimit", f"--nofile={self.open_files}:{self.open_files}", "--", *command]
        with self.log.open("ab") as out:
            self.daemon = subprocess.Popen([*command, *self.args], env=env, stdout=out, stderr=out)
        ready = self.socket_dir / LIMITS_NAME  # published once it serves
        deadline = time.monotonic() + 20
        while not (
            ready.exists() and (self.control_dir / socket_dirs.CONTROL_SOCKET_NAME).exists()
        ):
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start:\n{self.output()}")
            time.sleep(0.02)
        self.proc.host(self.daemon.pid)
        return self

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(10)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def hook(self, timeout: float = 5.0) -> ControlClient:
        """A raw connection to the hook socket, as a hostile client would open one."""
        c = ControlClient.as_hook(self.socket_dir, timeout=timeout)
        self.opened.append(c)
        return c

    def control(self, timeout: float = 5.0) -> ControlClient:
        c = ControlClient(control_dir=self.control_dir, timeout=timeout)
        self.opened.append(c)
        return c

    def status(self) -> dict[str, Any]:
        self.proc.host(os.getpid())
        with ControlClient(control_dir=self.control_dir, timeout=10) as c:
            doc: dict[str, Any] = c.request(p.StatusRequest()).doc
        return doc

    def registered(self, **kw: Any) -> ControlClient:
        """A raw client registered on the fake GPU."""
        c = self.hook()
        reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=16 * GiB, **kw))
        assert isinstance(reply, p.Registered), reply
        return c


@pytest.fixture
def stage() -> Iterator[Stage]:
    base = Path(tempfile.mkdtemp(prefix="nvs-ab-"))  # short: socket paths have 108 bytes
    base.chmod(0o755)
    s = Stage(base=base, proc=FakeProc(base / "proc"))
    s.proc.host(os.getpid())
    yield s
    for c in s.opened:
        c.close()
    s.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def hooked(start_probe: Any, plain: Variant, stage: Stage) -> Any:  # noqa: F811
    """Start a hooked fake-CUDA process, placed on the host or in `pod` before it connects."""

    def start(*, pod: str | None = None, **env: str) -> Probe:
        started: Probe = start_probe(plain, plain.env(**stage.hook_env(**env)))
        if pod is None:
            stage.proc.host(started.proc.pid)
        else:
            stage.proc.pod(started.proc.pid, pod)
        return started

    return start


@contextmanager
def listed_pods(stage: Stage, **pods: dict[str, str]) -> Iterator[dict[str, str]]:
    """Pods of node-1 in a fake API server (name -> annotations) that the stage's daemon
    watches; their UIDs by name. A cgroup naming a pod counts only once the watch lists it."""
    api = FakeApiServer().start()
    api.add_node("node-1")
    made = {
        name: api.add_pod(name, namespace="team", node="node-1", annotations=annotations)
        for name, annotations in pods.items()
    }
    api.load_rbac(list(manifests.rendered()))
    kubeconfig = api.write_kubeconfig(
        stage.base / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
    )
    stage.args = ["--node-name", "node-1"]
    stage.env = {"KUBECONFIG": kubeconfig}
    try:
        yield {name: str(pod["metadata"]["uid"]) for name, pod in made.items()}
    finally:
        stage.stop()
        api.stop()


def wait_listed(stage: Stage, probe: Probe, memory: int) -> None:
    """Wait until a probe of a listed pod has that pod's annotated memory limit."""
    probe.ok("info")  # its first use of the GPU registers it
    eventually(
        lambda: any(
            c["pid"] == probe.proc.pid and c["memory_limit"] == memory
            for c in stage.status()["clients"]
        ),
        "the pod watch lists the pod",
    )


def eventually(check: Any, what: str, timeout: float = 20.0) -> Any:
    """Wait for `check()` to be truthy (bounded generously: a loaded CI machine)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: still {got!r}"
        time.sleep(0.05)
    return got
