"""`nvsharectl top` against a real daemon with hooked fake-driver clients: one frame for a
script (`--once`), and the live view on a real pseudo-terminal, quitting on `q`.

The fake libnvidia-ml.so.1 shows the daemon what each probe process holds, so the frame has
both memory columns: the hook's count and NVML's, with the context overhead between them.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon
from kube.extender_client import eventually

from appliance.cli.top_view import ShareHistory, size
from appliance.core.gputime import LockTime
from appliance.core.state import Phase
from appliance.core.views import ClientView, StatusView
from appliance.policy.model import Mode

from .probes import BUILD, GiB, Probe

MiB = 1 << 20
HOME = b"\x1b[H"  # a frame starts at the top left
LEAVE = b"\x1b[?1049l"  # back from the alternate screen
ROW = (  # a client's row: the pod is "-" (no pod)
    r"^\s+{id}\s+{pid}\s+-\s+{state}\s+{share}\s+{core}%\s+{quota}\s+{used}\s+{limit}\s+"
    r"{nvml}\s+{ctx}$"
)


@pytest.fixture
def node() -> Iterator[tuple[RunningDaemon, Path]]:
    subprocess.run(["make", "-s", "-C", str(BUILD.parent)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="nvs-top-"))  # short: the socket path must fit
    state = tmp / "nvml-state"
    state.write_text("")
    d = start_daemon(
        tmp,
        "scheduler: {mode: 'on'}\n",
        extra_env={
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
            "NVSHARE_FAKE_NVML_STATE": str(state),
        },
    )
    try:
        yield d, state
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def top(d: RunningDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "nvsharectl"), "top", *args],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


def test_once_prints_a_frame_of_every_gpu_and_client(node: tuple[RunningDaemon, Path]) -> None:
    d, state = node
    busy = Probe(d, NVSHARE_GPU_MEMORY_LIMIT="1Gi")
    quota = Probe(d, NVSHARE_GPU_CORE_LIMIT="30")
    for probe in (busy, quota):
        assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    assert busy.ask(f"alloc mem {512 * MiB}").startswith("ok")
    state.write_text(f"0 {2 * GiB} 2 42 {busy.pid}:{700 * MiB} {quota.pid}:{300 * MiB}\n")
    eventually(lambda: "700Mi" in top(d, "--once", "-d", "0.2").stdout, "NVML's view in top")

    # the busy probe holds the lock throughout (nobody waits for it), the other one never asks
    launching = threading.Thread(target=busy.ask, args=("launchfor 4000 1",))
    launching.start()
    eventually(lambda: " holding " in top(d, "--once", "-d", "0.2").stdout, "the lock taken")
    done = top(d, "--once", "-d", "1")
    launching.join()
    assert done.returncode == 0, done.stderr
    out = done.stdout
    gpu = re.search(
        r"^GPU 0 (GPU-\S+) NVIDIA Fake GPU  mode on  TQ 30s  util 42%  (.*)$", out, re.M
    )
    assert gpu, out
    assert gpu.group(2) == "memory 2.0Gi/16.0Gi"
    holder = re.search(r"^  holder: (\d+) \(pid (\d+)\)   queue: -$", out, re.M)
    assert holder and holder.group(2) == str(busy.pid), out
    busy_row = ROW.format(
        id=holder.group(1),
        pid=busy.pid,
        state="holding",
        used="512Mi",
        limit=r"1\.0Gi",
        nvml="700Mi",
        ctx="188Mi",  # what NVML shows beyond the hook's count: the context
        share=r"(\d+)",
        core="100",
        quota="-",
    )
    match = re.search(busy_row, out, re.M)
    assert match, out
    assert int(match.group(1)) >= 50  # held all along but for the gaps between launches
    quota_row = ROW.format(
        id=r"\d+",
        pid=quota.pid,
        state="idle",
        used="0",
        limit="-",
        nvml="300Mi",
        ctx="300Mi",
        share="0",
        core="30",
        quota="0/600ms",  # 30 % of the seed's 2 s window, nothing used
    )
    assert re.search(quota_row, out, re.M), out
    assert "GPU% over the last 1." in out


def test_once_without_a_daemon_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(BIN / "nvsharectl"), "top", "--once"],
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("nvsharectl: no nvshare scheduler is running at ")
    assert len(done.stderr.splitlines()) == 1


def test_live_view_without_a_terminal_says_what_to_do(
    node: tuple[RunningDaemon, Path],
) -> None:
    done = top(node[0])
    assert done.returncode == 1
    assert "top needs a terminal" in done.stderr and "--once" in done.stderr


def read_until(fd: int, seen: bytearray, done: Callable[[bytes], bool]) -> bytes:
    """Read what the terminal shows into `seen` until `done` says so (or the program ends)."""
    deadline = time.monotonic() + 30
    while not done(bytes(seen)):
        left = deadline - time.monotonic()
        assert left > 0, f"never happened: {bytes(seen[-2000:])!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the program ended and closed the terminal
                break
    return bytes(seen)


def test_live_view_on_a_terminal_refreshes_and_quits_on_q(
    node: tuple[RunningDaemon, Path],
) -> None:
    d, _ = node
    probe = Probe(d)
    assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    main, side = pty.openpty()
    env = {k: v for k, v in d.env.items() if k not in ("TERM", "COLUMNS", "LINES")}
    proc = subprocess.Popen(  # as `kubectl exec -it` runs it: a terminal, no TERM
        [str(BIN / "nvsharectl"), "top", "-d", "0.2"],
        env=env,
        stdin=side,
        stdout=side,
        stderr=side,
        start_new_session=True,
    )
    os.close(side)
    seen = bytearray()
    try:
        read_until(main, seen, lambda out: f" {probe.pid} ".encode() in out)
        first = seen.count(HOME)
        read_until(main, seen, lambda out: out.count(HOME) > first)  # it refreshes
        os.write(main, b"q")
        assert proc.wait(30) == 0
        read_until(main, seen, lambda out: LEAVE in out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    shown = bytes(seen)
    assert shown.startswith(b"\x1b[?1049h")  # the alternate screen, left at the end
    assert b"q quits" in shown and b"mode on" in shown and b"Traceback" not in shown


def status_at(time_s: float, held: dict[int, float]) -> StatusView:
    clients = tuple(
        ClientView(
            id=cid,
            pid=1000 + cid,
            uid=0,
            pod="-",
            pod_source=None,
            gpu="GPU-x",
            state=Phase.IDLE,
            memory_limit=None,
            core_limit=100,
            gated=True,
            memory_used=0,
            memory_reserved=0,
            memory_observed=None,
            held_for_s=None,
            waiting_for_s=None,
            limits_from={},
            lock=LockTime(held_s, 0.0, {}),
        )
        for cid, held_s in held.items()
    )
    return StatusView((), clients, {}, Mode.ON, 30.0, time=time_s)


def test_gpu_share_is_lock_time_over_the_last_window() -> None:
    history = ShareHistory(window_s=2.0)
    assert history.shares() == (0.0, {})
    history.add(status_at(10.0, {1: 5.0}))
    history.add(status_at(11.0, {1: 5.5, 2: 0.0}))
    assert history.shares() == (1.0, {1: 0.5})  # client 2 is new: no share yet
    history.add(status_at(12.0, {1: 6.5, 2: 0.25}))
    history.add(status_at(13.0, {1: 7.5, 2: 0.25}))  # the sample at 10 s is too old now
    assert history.shares() == (2.0, {1: 1.0, 2: 0.125})


def test_sizes_fit_the_columns() -> None:
    shown = [size(n) for n in (None, 0, 512, 3 << 10, 700 << 20, 188 << 20, -(3 << 29), 80 << 30)]
    assert shown == ["-", "0", "512B", "3.0Ki", "700Mi", "188Mi", "-1.5Gi", "80.0Gi"]
