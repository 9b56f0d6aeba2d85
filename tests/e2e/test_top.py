"""`nvsharectl top` against a real daemon with hooked fake-driver clients: one frame for a
script (`--once`), and the live view on a real pseudo-terminal, quitting on `q`.

The fake libnvidia-ml.so.1 shows the daemon what each probe process holds, so the frame has
both memory columns: the hook's count and NVML's, with the context overhead between them.
Policy rules that match copies of the probe by executable give clients priorities and
requests, and two ranks of a torch-style job on two fake GPUs make a gang: an 80-column
terminal shows them as status and the metrics do.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from daemon.conftest import BIN, RunningDaemon, start_daemon
from kube.extender_client import eventually

from appliance.cli.top_view import ShareHistory, frame, size
from appliance.core.gputime import LockTime
from appliance.core.state import DroppedOverride, Phase
from appliance.core.views import ClientView, GpuView, StatusView
from appliance.policy.model import Mode

from .probes import BUILD, GiB, Probe
from .test_metrics import Node
from .test_realtime_scheduling import free_port

MiB = 1 << 20
HOME = b"\x1b[H"  # a frame starts at the top left
LEAVE = b"\x1b[?1049l"  # back from the alternate screen
ROW = (  # a client's row: the pod is "-" (no pod)
    r"^\s+{id}\s+{pid}\s+-\s+{state}\s+{share}\s+{core}%\s+{req}\s+{prio}\s+{quota}\s+"
    r"{used}\s+{limit}\s+{nvml}\s+{ctx}\s+{gang}$"
)


@contextmanager
def running_node(policy: str, **env: str) -> Iterator[tuple[RunningDaemon, Path]]:
    """A daemon whose fake NVML shows what the NVML state file (yielded beside it) says."""
    subprocess.run(["make", "-s", "-C", str(BUILD.parent)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="nvs-top-"))  # short: the socket path must fit
    state = tmp / "nvml-state"
    state.write_text("")
    d = start_daemon(
        tmp,
        policy,
        extra_env={
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
            "NVSHARE_FAKE_NVML_STATE": str(state),
            **env,
        },
    )
    try:
        yield d, state
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[tuple[RunningDaemon, Path]]:
    with running_node("scheduler: {mode: 'on'}\n") as running:
        yield running


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
        req="0%",
        prio="normal",
        quota="-",
        gang="-",
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
        req="0%",
        prio="normal",
        quota="0/150ms",  # 30 % of the default 500 ms window, nothing used
        gang="-",
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


def on_terminal(d: RunningDaemon, shows: Callable[[bytes], bool], *, columns: int = 80) -> bytes:
    """What `nvsharectl top` shows on a terminal `columns` wide, as `kubectl exec -it` runs it
    (no TERM), until `shows` says so and one refresh more, then `q`."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in d.env.items() if k not in ("TERM", "COLUMNS", "LINES")}
    proc = subprocess.Popen(
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
        read_until(main, seen, shows)
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
    return bytes(seen)


def last_frame(shown: bytes) -> list[str]:
    """The lines of the last whole frame on the screen, as text without escapes."""
    frames = [f for f in shown.split(HOME) if b"q quits" in f]
    text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", frames[-1]).decode()
    return text.replace("\r", "").split("\n")  # the terminal's own \r before each \n too


def test_live_view_on_a_terminal_refreshes_and_quits_on_q(
    node: tuple[RunningDaemon, Path],
) -> None:
    d, _ = node
    probe = Probe(d)
    assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    shown = on_terminal(d, lambda out: f" {probe.pid} ".encode() in out)
    assert shown.startswith(b"\x1b[?1049h")  # the alternate screen, left at the end
    assert b"q quits" in shown and b"mode on" in shown and b"Traceback" not in shown


RULES = """\
scheduler: {{mode: 'on'}}
metrics: {{address: '127.0.0.1:{port}'}}
rules:
  - {{name: serving, match: {{executable: '*/serve'}}, priority: high, coreRequest: 60}}
  - {{name: training, match: {{executable: '*/train'}}, priority: low, coreRequest: 60}}
  - {{name: ranks, match: {{executable: '*/rank'}}, priority: 7}}
"""


@pytest.fixture
def ranked() -> Iterator[tuple[RunningDaemon, Path, int]]:
    """Two fake GPUs; a copy of the probe per rule, the rules matching them by executable."""
    port = free_port()
    with running_node(RULES.format(port=port), NVSHARE_FAKE_GPU_COUNT="2") as (d, state):
        for name in ("serve", "train", "rank"):
            shutil.copy(BUILD / "probe", state.parent / name)
        yield d, state.parent, port


def rows_by_pid(lines: list[str]) -> dict[int, list[dict[str, str]]]:
    """Every client row of a frame as {column title: what it shows}, by PID (a process on two
    GPUs has a row on each)."""
    rows: dict[int, list[dict[str, str]]] = {}
    header: list[str] = []
    for line in lines:
        words = line.split()
        if words[:2] == ["ID", "PID"]:
            header = words
        elif header and len(words) == len(header) and words[0].isdigit():
            row = dict(zip(header, words, strict=True))
            rows.setdefault(int(row["PID"]), []).append(row)
    return rows


def test_an_80_column_terminal_shows_each_clients_priority_request_and_gang(
    ranked: tuple[RunningDaemon, Path, int],
) -> None:
    """What status, top and the metrics say of the same clients agrees: priority, the
    guaranteed share scaled down where requests sum past 100, and the gang."""
    d, where, port = ranked
    serve, train = Probe(d, program=where / "serve"), Probe(d, program=where / "train")
    for probe in (serve, train):
        assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    torch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NVSHARE_FAKE_GPU_COUNT": "2"}
    ranks = [Probe(d, program=where / "rank", **torch) for _ in range(2)]
    for rank, probe in enumerate(ranks):
        assert probe.ask("init") == "ok" and probe.ask(f"primary {rank}") == "ok"
        assert probe.ask("launch 1") == "ok"
    key = f"uid:{os.getuid()}:torch/@127.0.0.1:29500"
    eventually(lambda: f"gang: {key}" in nvsharectl(d, "status", "-w"), "the ranks made a gang")

    frame = last_frame(on_terminal(d, lambda out: b"uid:" in out))
    assert max(map(len, frame)) <= 80
    assert "  guaranteed shares (coreRequest) sum to 120%: each scaled by 100/120" in frame
    rows = rows_by_pid(frame)
    # on 80 columns CTX, NVML, LIMIT and QUOTA gave way, and GANG narrowed (POD shows "-")
    assert list(rows[serve.pid][0]) == [
        "ID", "PID", "POD", "STATE", "GPU%", "CORE", "REQ", "PRIO", "USED", "GANG"
    ]  # fmt: skip
    shown = {pid: {(r["PRIO"], r["REQ"], r["GANG"]) for r in rows[pid]} for pid in rows}
    assert shown[serve.pid] == {("high", "60>50%", "-")}
    assert shown[train.pid] == {("low", "60>50%", "-")}
    for probe in ranks:
        ((prio, req, gang),) = shown[probe.pid]
        assert (prio, req) == ("7", "0%")
        # the key's middle gave way; its kind and its end (the rendezvous port) are kept
        assert gang.startswith("uid:") and ".." in gang and gang.endswith(":29500")
        assert len(gang) < len(key)

    # status --wide says the same, with the gang's whole key
    lines = nvsharectl(d, "status", "--wide").splitlines()
    status = {int(line.split()[1]): line for line in lines if line.split()[0].isdigit()}
    assert re.search(r" 60>50%\s+high GPU-\S+$", status[serve.pid])
    assert re.search(r" 60>50%\s+low GPU-\S+$", status[train.pid])
    for probe in ranks:
        assert re.search(rf" 0%\s+7 GPU-\S+  gang: {re.escape(key)}$", status[probe.pid])

    # and so do the metrics, by client id
    metrics = Node(d, where / "nvml-state", port).scrape()
    client_of = {
        int(dict(labels)["host_pid"]): dict(labels)["client_id"]
        for (name, labels), _ in metrics.items()
        if name == "nvshare_client_info"
    }

    def of(name: str, probe: Probe) -> dict[str, float]:
        return {
            dict(labels).get("gang", ""): value
            for (metric, labels), value in metrics.items()
            if metric == name and dict(labels)["client_id"] == client_of[probe.pid]
        }

    assert of("nvshare_client_priority", serve) == {"": 100}
    assert of("nvshare_client_priority", train) == {"": -100}
    assert of("nvshare_client_core_guaranteed_percent", serve) == {"": 50}
    assert of("nvshare_client_core_guaranteed_percent", train) == {"": 50}
    assert of("nvshare_client_gang_info", serve) == {}
    for probe in ranks:
        assert of("nvshare_client_priority", probe) == {"": 7}
        assert of("nvshare_client_gang_info", probe) == {key: 1}

    # and `policy explain` names the rule that set each
    explained = nvsharectl(d, "policy", "explain", "--pid", str(serve.pid)).splitlines()
    assert "  priority: high (from rule 'serving' (policy.yaml#/rules/0))" in explained
    assert "  request: 60% (from rule 'serving' (policy.yaml#/rules/0))" in explained
    explained = nvsharectl(d, "policy", "explain", "--pid", str(ranks[0].pid)).splitlines()
    assert "  priority: 7 (from rule 'ranks' (policy.yaml#/rules/2))" in explained
    assert "  request: 0% (from policy default (default))" in explained


def test_mode_off_says_whose_it_is_and_shows_its_clients_ungated(
    node: tuple[RunningDaemon, Path],
) -> None:
    """`-S off` then top and status: the mode in force, said to be nvsharectl's over the
    policy's; a busy client of a GPU in mode off is `ungated` with no lock share, not idle."""
    d, _ = node
    # a GPU by its index, as nvidia-smi numbers it (the fake NVML lists one GPU)
    said = nvsharectl(d, "mode", "auto", "--gpu", "0")
    assert re.fullmatch(
        r"mode set to auto for GPU 0 \(GPU-\S+\) \(was on from the policy\)\n", said
    )
    assert (
        nvsharectl(d, "-S", "off") == "mode set to off for every GPU (was auto from nvsharectl)\n"
    )
    busy = Probe(d)
    assert busy.ask("init") == "ok" and busy.ask("total").startswith("ok")
    launching = threading.Thread(target=busy.ask, args=("launchfor 3000 1",))
    launching.start()
    try:
        out = top(d, "--once", "-d", "0.5").stdout
        shown = nvsharectl(d, "status")
    finally:
        launching.join()
    assert "\ndefault: mode off (nvsharectl; policy on)  TQ 30 s (policy)\n" in out, out
    assert re.search(
        r"^GPU 0 GPU-\S+ NVIDIA Fake GPU  mode off \(nvsharectl\)  TQ 30s  ", out, re.M
    )
    row = ROW.format(
        id=r"\d+",
        pid=busy.pid,
        state="ungated",
        share="-",
        core="100",
        req="0%",
        prio="normal",
        quota="-",
        used="0",
        limit="-",
        nvml="-",
        ctx="-",
        gang="-",
    )
    assert re.search(row, out, re.M), out
    assert "ungated: runs without the lock" in out
    assert "default: mode off (nvsharectl; policy on)  TQ 30 s (policy)" in shown
    assert re.search(rf"^  0 \w{{8}}\s+{busy.pid} probe\s+ungated\s", shown, re.M), shown
    assert busy.close() == 0


def nvsharectl(d: RunningDaemon, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "nvsharectl"), *args], env=d.env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


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


def test_a_narrow_terminal_drops_the_least_useful_columns_and_keeps_the_ends_of_keys() -> None:
    served = replace(
        status_at(1.0, {1: 0.0}).clients[0],
        pod="ml-team/vllm-serve-7d9f8c-x2x4z",
        gang="pod:1b4e28ba-2fa1-11d2-883f-0016d3cca427",
        priority=-100,
        core_request=60,
        core_guaranteed=100 * 60 / 130,
    )
    gpu = GpuView("GPU-x", 0, "H100", Mode.ON, "policy", 30.0, "policy", 80 << 30, (1,), (), 130)
    status = StatusView((gpu,), (served,), {}, Mode.ON, 30.0, time=1.0)
    header, row = frame(status, ShareHistory(), 80)[-2:]
    assert header.split() == ["ID", "PID", "POD", "STATE", "GPU%", "CORE", "REQ", "PRIO", "GANG"]
    shown = "1 1001 ml-team/vllm-se idle - 100% 60>46% low pod:1b4..cca427"
    assert row.split() == shown.split()  # POD cut at its end, the gang key in its middle
    assert len(row) == 80
    header, row = frame(status, ShareHistory(), None)[-2:]  # --once: every column, keys whole
    assert header.split()[8:] == ["QUOTA", "USED", "LIMIT", "NVML", "CTX", "GANG"]
    assert row.split()[2] == "ml-team/vllm-serve-7d9f8"  # POD is 24 wide at most
    assert row.endswith(" pod:1b4e28ba-2fa1-11d2-883f-0016d3cca427")


def test_top_says_which_operator_setting_a_policy_reload_dropped() -> None:
    why = "a policy reload changed the policy's mode (scheduler.mode on -> auto)"
    dropped = DroppedOverride(what="mode off on every GPU", why=why, time=40.0)
    status = StatusView((), (), {}, Mode.AUTO, 30.0, time=100.0, dropped=(dropped,))
    shown = [line for line in frame(status, ShareHistory(), 80) if line.startswith("  ")]
    assert shown and max(map(len, shown)) <= 80  # wrapped, not cut at the terminal's edge
    text = " ".join(" ".join(shown).split())
    assert f"nvsharectl's mode off on every GPU was dropped 1 min ago: {why}" in text
