"""Fake-CUDA programs for the end-to-end tests: ld_hook/tests/probe.c on the fake libcuda.so.1,
with or without the hook, answering one command per line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.conftest import RunningDaemon

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "ld_hook" / "build"
GiB = 1 << 30


class Probe:
    """A probe process; `hooked=False` is a CUDA program the hook did not load into, `program`
    a copy of the probe under another name (for policy rules that match the executable)."""

    def __init__(
        self,
        daemon: RunningDaemon,
        namespace: str = "",
        name: str = "",
        *,
        hooked: bool = True,
        program: Path = BUILD / "probe",
        **extra_env: str,
    ) -> None:
        env = {
            **daemon.env,
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
            **extra_env,
        }
        if hooked:
            env["LD_PRELOAD"] = str(BUILD / "libnvshare.so")
        if name:
            env |= {"NVSHARE_POD_NAMESPACE": namespace, "NVSHARE_POD_NAME": name}
        self.proc = subprocess.Popen(
            [str(program), "run"],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        PROBES.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def try_alloc(self, n: int) -> str:
        """Allocate and free at once; "ok" or "err 2" (CUDA_ERROR_OUT_OF_MEMORY)."""
        got = self.ask(f"alloc mem {n}")
        if got.startswith("ok"):
            assert self.ask(f"free {got.split()[1]}") == "ok"
            return "ok"
        return got

    def close(self) -> int:
        assert self.proc.stdin and self.proc.stdout
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(10)
        finally:
            self.proc.stdout.close()


PROBES: list[Probe] = []


@pytest.fixture(autouse=True)
def _reap_probes() -> Iterator[None]:
    """Every probe a test started is gone when it ends."""
    yield
    while PROBES:
        probe = PROBES.pop()
        if probe.proc.poll() is None:
            probe.proc.kill()
        probe.close()
