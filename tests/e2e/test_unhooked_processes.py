"""End to end on the CPU: a CUDA program the hook did not load into is found and reported.

The daemon reads ld_hook/tests/fake_nvml.c's libnvidia-ml.so.1 through the real pynvml, and
the fake lists the PIDs of two real probe processes on the fake GPU: one under the hook, one
without it (as a program in an image with too old a glibc would run). Only the second is
reported: in the daemon's log, in `nvsharectl status` and in /metrics, until it exits.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon
from kube.extender_client import eventually

from .probes import BUILD, GiB, Probe
from .test_realtime_scheduling import free_port


@pytest.fixture
def node() -> Iterator[tuple[RunningDaemon, Path, int]]:
    subprocess.run(["make", "-s", "-C", str(BUILD.parent)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="nvs-uh-"))  # short: the socket path must fit
    state = tmp / "nvml-state"
    state.write_text("")
    port = free_port()
    d = start_daemon(
        tmp,
        f"unhookedProcesses: {{grace: 2s}}\nmetrics: {{address: '127.0.0.1:{port}'}}\n",
        extra_env={
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
            "NVSHARE_FAKE_NVML_STATE": str(state),
        },
    )
    try:
        yield d, state, port
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def nvsharectl_status(d: RunningDaemon, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "nvsharectl"), "status", *args],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def unhooked_metric(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    [value] = re.findall(
        r'^nvshare_gpu_unhooked_processes\{gpu_uuid="GPU-[^"]+"\} (\S+)$', text, re.M
    )
    return float(value)


def test_a_gpu_process_without_the_hook_is_reported_until_it_exits(
    node: tuple[RunningDaemon, Path, int],
) -> None:
    d, state, port = node
    hooked, bare = Probe(d), Probe(d, hooked=False)
    for probe in (hooked, bare):
        assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    eventually(lambda: f" {hooked.pid} " in nvsharectl_status(d), "the hooked probe registered")
    state.write_text(f"0 {2 * GiB} 2 50 {hooked.pid}:{GiB} {bare.pid}:{GiB}\n")

    row = re.compile(rf"^  0 \w{{8}}\s+{bare.pid} probe\s+unhooked\s+1\.0Gi\s+-\s+-\s+-$", re.M)
    eventually(lambda: bool(row.search(nvsharectl_status(d))), "the bare probe in status")
    wide = re.compile(rf"^\s+-\s+{bare.pid}\s+probe\s+-\s+UNHOOKED\s+1Gi\s.*GPU-", re.M)
    assert wide.search(nvsharectl_status(d, "--wide"))
    shown = nvsharectl_status(d, "--wide")
    hooked_row = next(line for line in shown.splitlines() if f" {hooked.pid} " in line)
    assert "UNHOOKED" not in hooked_row
    # NVML shows 1Gi, the hook counts nothing: all of it is context (MEM USED, LIMIT: none)
    assert re.search(r"\s-\s+-\s+1Gi\s+1Gi\s+100%\s+\S+\s+\S+ GPU-", hooked_row), shown
    assert "1 GPU process(es) run without the hook" in shown
    eventually(lambda: unhooked_metric(port) == 1, "the metric (at most a second old)")
    log = d.output()
    assert f"GPU process pid {bare.pid} " in log and "without registering" in log
    assert "LD_PRELOAD" in log  # a host process is told how to start under the hook
    assert f"pid {hooked.pid} " not in log.split("without registering")[0].rsplit("\n", 1)[-1]

    assert bare.close() == 0
    state.write_text(f"0 {GiB} 1 50 {hooked.pid}:{GiB}\n")
    eventually(lambda: "unhooked" not in nvsharectl_status(d), "the report gone with it")
    eventually(lambda: unhooked_metric(port) == 0, "the metric gone too")
    assert hooked.close() == 0
    assert "Traceback" not in d.output()
