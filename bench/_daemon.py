"""Start a real daemon process for a benchmark (shared by the bench scripts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from appliance.cli.client import ControlClient
from appliance.serve.socket_claim import answering_pid
from appliance.wire import protocol as p
from appliance.wire import socket_dirs

GPU = "GPU-bench000-0000-0000-0000-000000000000"


class BenchDaemon:
    def __init__(
        self,
        policy: str,
        *,
        args: list[str] | None = None,
        tree: Path | None = None,
        start: bool = True,
        metrics_port: int | None = None,
        under: list[str] | None = None,
    ) -> None:
        """`tree`: run the appliance of another checkout (an older commit, side by side);
        `start`: False to add policy files first (`policy_dir`), then `start()`;
        `metrics_port`: serve /metrics on 127.0.0.1 there (off otherwise);
        `under`: a command that runs the daemon's Python (valgrind and its options)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="nvs-bench-"))
        self.tmp.chmod(0o755)  # other users' clients (bench/abuse.py's uid 65534) reach its sockets
        self.policy_dir = self.tmp / "policy"
        self.policy_dir.mkdir()
        metrics = (
            f"{{enabled: true, address: '127.0.0.1:{metrics_port}'}}"
            if metrics_port
            else "{enabled: false}"
        )
        (self.policy_dir / "policy.yaml").write_text(f"{policy}\nmetrics: {metrics}\n")
        self.socket_dir = self.tmp / "run"
        self.log = self.tmp / "daemon.log"
        self.args = args or []
        self.tree = tree
        self.under = under or []
        if start:
            self.start()

    def start(self) -> None:
        env = {**os.environ, "NVSHARE_SOCKET_DIR": str(self.socket_dir)}
        if self.tree is not None:
            kept = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []  # (bench/loopwatch)
            env["PYTHONPATH"] = os.pathsep.join([str(self.tree), *kept])
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [
                    *self.under,
                    sys.executable,
                    "-m",
                    "appliance",
                    "--policy-dir",
                    str(self.policy_dir),
                    *self.args,
                ],
                env=env,
                cwd=self.tree,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + (600 if self.under else 30)
        # this daemon's, not a socket left by one killed before (`start` again after a kill)
        while answering_pid(self.socket_dir / socket_dirs.SOCKET_NAME) != self.proc.pid:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.02)

    def hook(self, *, timeout: float = 10.0) -> ControlClient:
        return ControlClient.as_hook(self.socket_dir, timeout=timeout)

    def client(self, *, timeout: float = 10.0, **register: object) -> ControlClient:
        c = self.hook(timeout=timeout)
        reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 << 30, **register))  # type: ignore[arg-type]
        assert isinstance(reply, p.Registered), reply
        return c

    def control(self) -> ControlClient:
        return ControlClient(self.socket_dir)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    """Kill the benchmark's own processes (probes, programs) and close their pipes."""
    for pr in procs:
        pr.kill()
        pr.wait()
        for f in (pr.stdin, pr.stdout):
            if f is not None:
                f.close()


def handoff_p50(d: BenchDaemon, n: int = 500) -> float:
    """Median time from one client's release to the other's grant, two clients taking turns."""
    a, b = d.client(), d.client()
    a.request(p.LockRequest())
    b.send(p.LockRequest())
    holder, waiter, lat = a, b, []
    for _ in range(n):
        t0 = time.perf_counter()
        holder.send(p.LockReleased(p.ReleaseReason.IDLE))
        while not isinstance(waiter.receive()[1], p.LockGrant):
            pass
        lat.append(time.perf_counter() - t0)
        holder.send(p.LockRequest())
        holder, waiter = waiter, holder
    a.close()
    b.close()
    return percentile(lat, 50)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def gpus() -> list[str]:
    """Each GPU's name and driver, as nvidia-smi says them (none where it cannot)."""
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return smi.stdout.splitlines()


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} CPUs, {model}"


def stamp_hook_lines(
    proc: subprocess.Popen[bytes], into: list[tuple[float, str]], clock: Callable[[], float]
) -> None:
    """Read a worker's stderr, where piped, on a thread of its own: the hook's lines
    (NVSHARE_DEBUG) go into `into` with `clock()` at the time each was read; anything else (a
    traceback) goes on to ours."""
    pipe = proc.stderr
    if pipe is None:
        return

    def read() -> None:
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            if text.startswith("nvshare["):
                into.append((clock(), text.rstrip()))
            else:
                sys.stderr.write(text)

    threading.Thread(target=read, daemon=True).start()
