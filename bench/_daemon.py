"""Start a real daemon process for a benchmark (shared by the bench scripts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance import protocol as p
from appliance.client import ControlClient

GPU = "GPU-bench000-0000-0000-0000-000000000000"


class BenchDaemon:
    def __init__(
        self, policy: str, *, args: list[str] | None = None, tree: Path | None = None
    ) -> None:
        """`tree`: run the appliance of another checkout (an older commit, side by side)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="nvs-bench-"))
        self.policy_dir = self.tmp / "policy"
        self.policy_dir.mkdir()
        (self.policy_dir / "policy.yaml").write_text(policy + "\nmetrics: {enabled: false}\n")
        self.socket_dir = self.tmp / "run"
        self.log = self.tmp / "daemon.log"
        env = {**os.environ, "NVSHARE_SOCKET_DIR": str(self.socket_dir)}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "appliance",
                    "--policy-dir",
                    str(self.policy_dir),
                    *(args or []),
                ],
                env=env,
                cwd=tree,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while not (self.socket_dir / "scheduler.sock").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.02)

    def client(self, **register: object) -> ControlClient:
        c = ControlClient(self.socket_dir)
        reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 << 30, **register))  # type: ignore[arg-type]
        assert isinstance(reply, p.Registered), reply
        return c

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} CPUs, {model}"
