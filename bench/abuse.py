"""The daemon under abuse (issue 11): each attack measured against a real daemon.

- hostage: a raw client takes the lock and ignores every drop; how long the next client waits,
  against the target (time quantum + scheduler.dropDeadline), and with a deadline of a day
  (what the daemon did before: the victim waits as long as the attacker lives);
- parked frames: 1,000 connections each parking a frame short of its last byte (1 MiB on the
  hooks' socket, as in the issue; 64 KiB, the most allowed, on the control socket): the
  daemon's RSS at its peak and after, and how long until they are all closed;
- status flood: 200 connections asking for status without reading; another client's status
  latency, against none;
- open files: 1,100 idle connections of one other user (uid 65534; needs root): how many are
  kept, status latency meanwhile, how long a new client takes to register, log lines;
- GPU entries: 5,000 register-and-leave clients naming made-up GPUs, then lock hand-off p50;
- recovery: 100 hooked programs (the fake driver) when the daemon is killed and restarted:
  how many die, and how long after the restart until all are registered again.

    .venv/bin/python bench/abuse.py [--out bench/results/abuse.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from _daemon import GPU, BenchDaemon, handoff_p50, machine, percentile, stop_all

from appliance.wire import protocol as p
from appliance.wire import socket_dirs

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "ld_hook" / "build"
MiB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def status_latencies(d: BenchDaemon, n: int) -> list[float]:
    out = []
    with d.control() as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.request(p.StatusRequest())
            out.append(time.perf_counter() - t0)
    return out


def ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:.1f}"


# ------------------------------------------------------------------ hostage


def victim_wait(tq: float, deadline: float, attacker_life: float = 0) -> float:
    d = BenchDaemon(f"scheduler: {{mode: 'on', timeQuantum: {tq}s, dropDeadline: {deadline}s}}")
    try:
        # the victim may wait the whole quantum and deadline, or the attacker's life
        attacker, victim = d.client(), d.client(timeout=tq + deadline + attacker_life + 30)
        attacker.request(p.LockRequest())  # granted; the victim asks at once: the worst case
        t0 = time.perf_counter()
        victim.send(p.LockRequest())
        if attacker_life:
            ready, _, _ = select.select([victim._sock], [], [], attacker_life)
            if not ready:
                attacker.close()  # before: only the attacker's exit freed the lock
        while not isinstance(victim.receive()[1], p.LockGrant):
            pass
        return time.perf_counter() - t0
    finally:
        d.stop()


def hostage() -> list[str]:
    rows = ["| quantum | drop deadline | victim waited (s) | target: quantum + deadline (s) |"]
    rows.append("|---:|---:|---:|---:|")
    for tq, deadline in ((1, 1), (2, 3), (5, 5), (30, 5)):
        waited = victim_wait(tq, deadline)
        rows.append(f"| {tq} s | {deadline} s | {waited:.2f} | {tq + deadline} |")
    before = victim_wait(1, 86400, attacker_life=10)
    rows.append(f"| 1 s | 24 h (as before: none) | {before:.2f} (the attacker lived 10 s) | - |")
    return rows


# ------------------------------------------------------------------ parked frames


def park(path: Path, n: int, body: int) -> tuple[list[socket.socket], int]:
    header = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.QUERY, 0, body, 1)
    conns, refused = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        s.setblocking(False)
        try:
            s.send(header + b"{" * (body - 1))
        except OSError:
            refused += 1
        conns.append(s)
    return conns, refused


def still_open(conns: list[socket.socket]) -> int:
    alive = 0
    for s in conns:
        try:
            while s.recv(1 << 16):
                pass
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    return alive


def parked(label: str, path_of: Callable[[BenchDaemon], Path], body: int) -> str:
    d = BenchDaemon("connections: {perUid: 2000}")
    try:
        before = rss(d.proc.pid)
        t0 = time.monotonic()
        conns, _ = park(path_of(d), 1000, body)
        peak = rss(d.proc.pid)
        kept = still_open(conns)
        while still_open(conns) and time.monotonic() - t0 < 30:
            peak = max(peak, rss(d.proc.pid))
            time.sleep(0.2)
        closed_after = time.monotonic() - t0
        after = rss(d.proc.pid)
        for s in conns:
            s.close()
        return (
            f"| {label} | {kept} | {before / MiB:.0f} | {peak / MiB:.0f} | {after / MiB:.0f} | "
            f"{closed_after:.1f} |"
        )
    finally:
        d.stop()


def parked_frames() -> list[str]:
    return [
        "| 1,000 connections, each parks | kept open at first | RSS before (MiB) | peak (MiB) | "
        "after (MiB) | all closed after (s) |",
        "|---|---:|---:|---:|---:|---:|",
        parked(
            "1 MiB frame on the hooks' socket",
            lambda d: d.socket_dir / socket_dirs.SOCKET_NAME,
            1 << 20,
        ),
        parked(
            "64 KiB frame on the control socket",
            lambda d: socket_dirs.control_dir_for(d.socket_dir) / socket_dirs.CONTROL_SOCKET_NAME,
            64 << 10,
        ),
    ]


# ------------------------------------------------------------------ status flood


def flooded_status(flooders: int) -> list[float]:
    """Another client's status latencies while `flooders` connections send status requests as
    fast as the socket takes them and never read the answers."""
    d = BenchDaemon("connections: {perUid: 2000}")
    try:
        for _ in range(8):
            d.client().close()
        request = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.STATUS_REQUEST, 0, 0, 1)
        path = socket_dirs.control_dir_for(d.socket_dir) / socket_dirs.CONTROL_SOCKET_NAME
        flood = []
        for _ in range(flooders):
            s = socket.socket(socket.AF_UNIX)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(str(path))
            s.setblocking(False)
            try:
                s.send(request * 20000)
            except BlockingIOError:
                pass
            flood.append(s)
        time.sleep(0.5)
        latencies = status_latencies(d, 300)
        for s in flood:
            s.close()
        return latencies
    finally:
        d.stop()


def status_flood() -> list[str]:
    rows = [
        "| another client's status | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---:|---:|---:|",
    ]
    for flooders in (0, 1, 200):
        lat = flooded_status(flooders)
        what = f"{flooders} connection(s) flooding, never reading" if flooders else "no flood"
        rows.append(f"| {what} | {ms(lat, 50)} | {ms(lat, 99)} | {max(lat) * 1e3:.1f} |")
    return rows


# ------------------------------------------------------------------ open files

IDLE = """
import socket, sys, time
conns = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    conns.append(s)
time.sleep(0.5)
def open_(s):
    s.setblocking(False)
    try:
        while s.recv(4096):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
print(sum(open_(s) for s in conns), flush=True)
sys.stdin.readline()
"""


def open_files() -> list[str]:
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        return ["(skipped: needs root and /usr/bin/python3 to act as uid 65534)"]
    d = BenchDaemon("")
    try:
        path = socket_dirs.control_dir_for(d.socket_dir) / socket_dirs.CONTROL_SOCKET_NAME
        idle = subprocess.Popen(
            ["/usr/bin/python3", "-c", IDLE, str(path), "1100"],
            user=65534,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert idle.stdout is not None and idle.stdin is not None
        kept = int(idle.stdout.readline())
        lat = status_latencies(d, 100)
        t0 = time.perf_counter()
        d.client().close()
        register = time.perf_counter() - t0
        idle.stdin.close()
        idle.wait()
        idle.stdout.close()
        lines = d.log.read_text().count("refusing connections")
        return [
            "| 1,100 idle connections of uid 65534 (cap perUid 1024) | value |",
            "|---|---:|",
            f"| kept open | {kept} |",
            f"| status latency meanwhile, p50 / max (ms) | {ms(lat, 50)} / {max(lat) * 1e3:.1f} |",
            f"| a new client's registration (ms) | {register * 1e3:.1f} |",
            f"| log lines about it | {lines} |",
        ]
    finally:
        d.stop()


# ------------------------------------------------------------------ GPU entries


def gpu_entries() -> list[str]:
    d = BenchDaemon("scheduler: {mode: 'on', timeQuantum: 3600s}\nconnections: {perUid: 9000}")
    try:
        fresh = handoff_p50(d)
        for _ in range(5000):
            c = p.Register(pid=0, gpu_uuid=f"GPU-{uuid.uuid4()}", gpu_total_mem=1)
            conn = d.hook()
            conn.request(c)
            conn.close()
        after = handoff_p50(d)
        with d.control() as ctl:
            gpus = len(ctl.request(p.StatusRequest()).doc["gpus"])
        return [
            "| lock hand-off p50 (ms) | before | after 5,000 register-and-leave GPUs |",
            "|---|---:|---:|",
            f"| 2 clients, mode on | {fresh * 1e3:.2f} | {after * 1e3:.2f} (GPU entries left: "
            f"{gpus}) |",
        ]
    finally:
        d.stop()


# ------------------------------------------------------------------ recovery


def recovery(programs: int = 100) -> list[str]:
    d = BenchDaemon("")
    env = {
        **os.environ,
        "NVSHARE_SOCKET_DIR": str(d.socket_dir),
        "LD_PRELOAD": str(BUILD / "libnvshare.so"),
        "LD_LIBRARY_PATH": str(BUILD / "fake"),
        "NVSHARE_FAKE_GPU_UUID": GPU,
    }
    procs = [
        subprocess.Popen(
            [str(BUILD / "probe"), "run"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(programs)
    ]
    try:
        for pr in procs:
            assert pr.stdin is not None and pr.stdout is not None
            pr.stdin.write("init\ninfo\n")
            pr.stdin.flush()
            pr.stdout.readline()
            pr.stdout.readline()

        def registered() -> int:
            with d.control() as c:
                return len(c.request(p.StatusRequest()).doc["clients"])

        while registered() < programs:
            time.sleep(0.05)
        d.proc.kill()
        d.proc.wait()
        time.sleep(1.0)
        d.start()
        t0 = time.monotonic()
        while registered() < programs and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        back = time.monotonic() - t0
        died = sum(pr.poll() is not None for pr in procs)
        return [
            f"| {programs} hooked programs, daemon killed (-9) and restarted 1 s later | value |",
            "|---|---:|",
            f"| programs that died | {died} |",
            f"| all registered again, after the new daemon listened (s) | {back:.2f} |",
        ]
    finally:
        stop_all(procs)
        d.stop()


SECTIONS: dict[str, Callable[[], list[str]]] = {
    "Victim wait with a hostile holder": hostage,
    "RSS under parked frames": parked_frames,
    "Status latency under flood": status_flood,
    "Open files": open_files,
    "GPU entries": gpu_entries,
    "Time to recover": recovery,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    lines = [
        "# The daemon under abuse (issue 11)",
        "",
        "- command: `.venv/bin/python bench/abuse.py --out bench/results/abuse.md`",
        f"- machine: {machine()}, Python {sys.version.split()[0]}, shared and noisy",
        f"- date: {datetime.date.today().isoformat()}",
        "",
    ]
    for title, section in SECTIONS.items():
        print(f"## {title}", flush=True)
        rows = section()
        print("\n".join(rows), flush=True)
        lines += [f"## {title}", "", *rows, ""]
    if args.out is not None:
        args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
