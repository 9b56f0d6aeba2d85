"""The new features under abuse (issue 24), measured before and after, side by side.

- churn: a process of another user (uid 65534; needs root) connecting and closing in a loop
  while N hooked programs (the fake driver) start: how many register, how many run unshared;
- extender: two loopback clients announcing 1.5 GiB bodies and sending 200 MiB each: the
  extender's RSS; a 100,000-deep JSON body; 200 idle connections: its threads; SIGTERM with
  those peers connected: how long until it exits;
- metrics: 300 idle connections to the node daemon's metrics endpoint: its threads; 32
  scrapers in a loop: the lock hand-off p50 against none.

"Before" runs the appliance and hook of another checkout (`--before DIR`: e.g. `git archive
78bee76 | tar -x -C DIR`, `make -C DIR hook`), with this checkout's virtual environment.

    .venv/bin/python bench/abuse_tenants.py --before DIR [--out bench/results/abuse.md]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _daemon import GPU, BenchDaemon, handoff_p50, machine

ROOT = Path(__file__).resolve().parents[1]
OTHER_PYTHON = "/usr/bin/python3"
MiB = 1 << 20

CHURN = """
import socket, sys, threading
path = sys.argv[1]
def churn():
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            pass
        s.close()
threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
threads[0].join()
"""


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ churn


def churn(tree: Path, programs: int) -> tuple[int, int, float]:
    """(registered, ran unshared, seconds until the last answered) under connection churn."""
    d = BenchDaemon("", tree=tree)
    build = tree / "ld_hook" / "build"
    churner = subprocess.Popen(
        [OTHER_PYTHON, "-c", CHURN, str(d.socket_dir / "scheduler.sock")], user=65534
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        time.sleep(1.0)
        env = {
            **os.environ,
            "NVSHARE_SOCKET_DIR": str(d.socket_dir),
            "LD_PRELOAD": str(build / "libnvshare.so"),
            "LD_LIBRARY_PATH": str(build / "fake"),
            "NVSHARE_FAKE_GPU_UUID": GPU,
            "NVSHARE_FAKE_LAUNCH_US": "1000",
        }
        for _ in range(programs):
            procs.append(
                subprocess.Popen(
                    [str(build / "probe"), "run"],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        t0 = time.monotonic()
        for pr in procs:
            assert pr.stdin is not None
            pr.stdin.write("init\nlaunch 1\nquit\n")
            pr.stdin.flush()
        unshared, why = 0, ""
        for pr in procs:
            assert pr.stderr is not None
            pr.wait(timeout=120)
            err = pr.stderr.read()
            if "without sharing" in err:
                unshared += 1
                why = err.strip().splitlines()[-1]
        took = time.monotonic() - t0
        if why:
            print(f"unshared: {why}", file=sys.stderr)
        return programs - unshared, unshared, took
    finally:
        churner.kill()
        churner.wait()
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
            for f in (pr.stdin, pr.stdout, pr.stderr):
                if f is not None:
                    f.close()
        d.stop()


def churn_section(before: Path, programs: int = 15, rounds: int = 3) -> list[str]:
    lines = [
        f"| {programs} hooked programs start while uid 65534 churns connections | registered "
        "| ran unshared | all answered (s) |",
        "|---|---:|---:|---:|",
    ]
    for label, tree in (("before", before), ("after", ROOT)):
        for n in range(rounds):
            ok, bad, took = churn(tree, programs)
            lines.append(f"| {label}, round {n + 1} | {ok} | {bad} | {took:.1f} |")
    return lines


# ------------------------------------------------------------------ extender


def start_extender(tree: Path, port: int, policy_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "NVSHARE_KUBE_API": "http://127.0.0.1:9"}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "appliance", "extender", f"--policy-dir={policy_dir}"),
            *("--host=127.0.0.1", f"--port={port}"),
        ],
        env=env,
        cwd=tree,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    while "listening" not in proc.stderr.readline():
        assert proc.poll() is None, "the extender did not start"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deep_json(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/filter", b"[" * 100_000 + b"]" * 100_000)
        answer = conn.getresponse()
        return f"{answer.status}"
    except (OSError, http.client.HTTPException) as exc:
        return f"no answer ({type(exc).__name__})"
    finally:
        conn.close()


def extender(tree: Path, policy_dir: Path) -> list[str]:
    port = free_port()
    proc = start_extender(tree, port, policy_dir)
    peers: list[socket.socket] = []
    try:
        time.sleep(1.0)
        rss0 = rss_mib(proc.pid)
        chunk = b" " * MiB
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1610612736\r\n\r\n")
            peers.append(s)
        for s in peers:
            try:
                for _ in range(200):
                    s.sendall(chunk)
            except OSError:
                pass  # refused and closed: nothing more is read
        time.sleep(2.0)
        rss1 = rss_mib(proc.pid)
        deep = deep_json(port)
        t0 = threads_of(proc.pid)
        for _ in range(200):
            peers.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        time.sleep(2.0)
        t1 = threads_of(proc.pid)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
            stopped = f"{time.monotonic() - start:.2f}"
        except subprocess.TimeoutExpired:
            stopped = "not within 30"
        return [f"{rss0:.0f}", f"{rss1:.0f}", deep, f"{t1 - t0}", stopped]
    finally:
        for s in peers:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def extender_section(before: Path, policy_dir: Path) -> list[str]:
    lines = [
        "| extender | RSS idle (MiB) | RSS, 2 x 1.5 GiB announced, 200 MiB sent each (MiB) "
        "| 100,000-deep JSON: status | threads added by 200 idle connections "
        "| SIGTERM to exit, those peers connected (s) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for label, tree in (("before", before), ("after", ROOT)):
        lines.append(f"| {label} | " + " | ".join(extender(tree, policy_dir)) + " |")
    return lines


# ------------------------------------------------------------------ metrics


def scrapers(port: int, n: int, stop: threading.Event) -> list[threading.Thread]:
    def loop() -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("GET", "/metrics")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                time.sleep(0.01)
            finally:
                conn.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def metrics(tree: Path) -> list[str]:
    port = free_port()
    d = BenchDaemon("scheduler: {mode: 'on', timeQuantum: 3600s}", tree=tree, start=False)
    (d.policy_dir / "zz-metrics.yaml").write_text(
        f"metrics: {{enabled: true, address: '127.0.0.1:{port}'}}\n"
    )
    d.start()
    idle: list[socket.socket] = []
    try:
        for _ in range(20):
            d.client().close()  # a few clients came and went: a status worth reading
        quiet = handoff_p50(d, 300)
        stop = threading.Event()
        running = scrapers(port, 32, stop)
        time.sleep(1.0)
        busy = handoff_p50(d, 300)
        stop.set()
        for t in running:
            t.join(30)
        t0 = threads_of(d.proc.pid)
        for _ in range(300):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            except OSError:
                break
        time.sleep(2.0)
        t1 = threads_of(d.proc.pid)
        time.sleep(10.0)
        t2 = threads_of(d.proc.pid)
        return [f"{quiet * 1e3:.2f}", f"{busy * 1e3:.2f}", f"{t1 - t0}", f"{t2 - t0}"]
    finally:
        for s in idle:
            s.close()
        d.stop()


def metrics_section(before: Path) -> list[str]:
    lines = [
        "| node daemon metrics | hand-off p50, no scraper (ms) | with 32 scrapers looping (ms) "
        "| threads added by 300 idle connections, after 2 s | after 12 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, tree in (("before", before), ("after", ROOT)):
        lines.append(f"| {label} | " + " | ".join(metrics(tree)) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the old commit")
    ap.add_argument("--out", type=Path, default=None, help="append the results here")
    args = ap.parse_args()
    policy_dir = Path(tempfile.mkdtemp(prefix="nvs-ext-policy-"))
    sections: dict[str, Callable[[], list[str]]] = {
        "Connection churn": lambda: churn_section(args.before),
        "Scheduler extender": lambda: extender_section(args.before, policy_dir),
        "Metrics endpoint": lambda: metrics_section(args.before),
    }
    lines = [
        "",
        "# The new features under abuse (issue 24)",
        "",
        "- command: `.venv/bin/python bench/abuse_tenants.py --before DIR --out "
        "bench/results/abuse.md` (DIR: `git archive 78bee76`, its hook built)",
        f"- machine: {machine()}, Python {sys.version.split()[0]}, shared and noisy",
        f"- date: {datetime.date.today().isoformat()}",
    ]
    for title, section in sections.items():
        lines += ["", f"## {title}", "", *section()]
        print("\n".join(lines[-3:]), flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(text)


if __name__ == "__main__":
    main()
