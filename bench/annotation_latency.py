"""How long an annotation change takes to reach the pod watcher's on_pod callback.

DESIGN.md promises that annotation changes reach the hook in well under a second (nvshare's
seeds poll every 5 s). This measures the first leg: an HTTP PATCH of a pod annotation on the
API server until `PodWatcher` calls `on_pod` with the new value, with 1, 100 and 1,000 pods
on the node. The fake API server runs in its own process (`tests/kube/fakeapi.py`, pods
seeded directly into it) so it does not share this process's GIL with the watcher.

    .venv/bin/python bench/annotation_latency.py [--patches 300] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.core.annotations import PodInfo, PodRef  # noqa: E402
from appliance.kube.api import api_client_from_env  # noqa: E402
from appliance.kube.pod_watch import PodWatcher  # noqa: E402

KEY = "bench.nvshare.com/seq"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(pods: int, patches: int) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, str(ROOT / "tests/kube/fakeapi.py"), "--port", str(port)]
    cmd += ["--seed-node", "n1", "--seed-pods", str(pods)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            server.stdout.readline()  # "listening on ..." once seeded
            return _measure_against(port, pods, patches)
        finally:
            server.terminate()
            server.wait(timeout=10)


def _has(arrived: dict[str, float], seq: str) -> Callable[[], bool]:
    return lambda: seq in arrived


def _measure_against(port: int, pods: int, patches: int) -> dict[str, float]:
    arrived: dict[str, float] = {}
    cond = threading.Condition()

    def on_pod(info: PodInfo) -> None:
        seq = info.annotations.get(KEY)
        if seq is not None:
            with cond:
                arrived.setdefault(seq, time.perf_counter())
                cond.notify_all()

    def on_deleted(ref: PodRef) -> None:
        pass

    api = api_client_from_env(f"http://127.0.0.1:{port}")
    watcher = PodWatcher(api_client=api, node_name="n1", on_pod=on_pod, on_pod_deleted=on_deleted)
    t0 = time.perf_counter()
    watcher.start()
    if not watcher.synced.wait(60):
        raise SystemExit("the pod watcher never finished its first list")
    sync_s = time.perf_counter() - t0
    conn = http.client.HTTPConnection("127.0.0.1", port)
    latencies: list[float] = []
    rng = random.Random(1)
    try:
        for i in range(patches):
            seq = str(i)
            body = json.dumps({"metadata": {"annotations": {KEY: seq}}})
            path = f"/api/v1/namespaces/default/pods/pod-{rng.randrange(pods)}"
            sent = time.perf_counter()
            conn.request("PATCH", path, body, {"Content-Type": "application/merge-patch+json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise SystemExit(f"PATCH {path} answered {resp.status}")
            with cond:
                if not cond.wait_for(_has(arrived, seq), timeout=30):
                    raise SystemExit(f"annotation {seq} never reached on_pod")
                latencies.append(arrived[seq] - sent)
    finally:
        conn.close()
        watcher.stop()
        api.close()  # type: ignore[no-untyped-call]
    latencies.sort()
    ms = [x * 1000 for x in latencies]
    return {
        "pods": pods,
        "patches": patches,
        "sync_ms": sync_s * 1000,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patches", type=int, default=300, help="PATCHes per pod count")
    ap.add_argument("--pods", type=int, nargs="+", default=[1, 100, 1000])
    ap.add_argument("--out", type=Path, help="also write the results as Markdown here")
    args = ap.parse_args()
    rows = [measure(n, args.patches) for n in args.pods]
    lines = [
        "| pods on node | patches | first list (ms) | p50 (ms) | p99 (ms) | max (ms) | mean (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pods']:.0f} | {r['patches']:.0f} | {r['sync_ms']:.1f} | {r['p50_ms']:.2f} "
            f"| {r['p99_ms']:.2f} | {r['max_ms']:.2f} | {r['mean_ms']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = " ".join([".venv/bin/python", "bench/annotation_latency.py", *sys.argv[1:]])
        args.out.write_text(
            "# Annotation change → PodWatcher.on_pod latency\n\n"
            f"- Command: `{cmd}`\n- Machine: {machine()}\n- Date: {when}\n"
            "- Measured: from sending an HTTP merge-patch of one pod annotation to the fake API\n"
            "  server (separate process, pods seeded directly into it, all on node n1) until\n"
            "  the watcher's on_pod callback sees the new value. Patches are sequential, each to\n"
            "  a random pod; the watcher uses its production defaults.\n\n"
            f"{table}\n"
        )


if __name__ == "__main__":
    main()
