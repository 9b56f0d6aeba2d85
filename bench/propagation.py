"""Time for a limit change to reach a connected hook, end to end through the daemon.

- policy: kubelet's ConfigMap update (a new timestamped directory, `..data_tmp` symlink renamed
  over `..data`) -> LIMIT_UPDATE received by a registered client.
- annotation: PATCH of `nvshare.com/gpu-memory-limit` on the API server (the fake one from
  tests/kube, over HTTP) -> LIMIT_UPDATE received by the pod's client, with 1, 100 and 1,000
  pods on the node.

The client is a Python protocol client registered exactly as the hook registers; the hook
applies a LIMIT_UPDATE as soon as its reader thread has it.

    .venv/bin/python bench/propagation.py [--rounds 200] [--pods 1 100 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _daemon import BenchDaemon, machine, percentile
from kubernetes import client

from appliance.wire import protocol as p

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kube"))
from fakeapi import FakeApiServer

GiB = 1 << 30


def wait_limit(c: object, want: int) -> None:
    while True:
        _, msg = c.receive()  # type: ignore[attr-defined]
        if isinstance(msg, p.LimitUpdate) and msg.limits.mem_limit == want:
            return


def policy_rounds(rounds: int) -> list[float]:
    d = BenchDaemon("")
    pol = d.policy_dir
    for f in pol.iterdir():
        f.unlink()

    def publish(i: int, limit: str) -> None:
        ts = pol / f"..2026_11_21_00_00_{i:05d}"
        ts.mkdir()
        (ts / "policy.yaml").write_text(
            f"defaults: {{memoryLimit: {limit}}}\nmetrics: {{enabled: false}}\n"
        )
        (pol / "..data_tmp").symlink_to(ts.name)
        os.rename(pol / "..data_tmp", pol / "..data")

    publish(0, "1Gi")
    (pol / "policy.yaml").symlink_to("..data/policy.yaml")
    try:
        c = d.client()
        time.sleep(0.5)
        out = []
        for i in range(1, rounds + 1):
            limit = 2 * GiB if i % 2 else GiB
            old = os.readlink(pol / "..data")
            t0 = time.perf_counter()
            publish(i, "2Gi" if i % 2 else "1Gi")
            wait_limit(c, limit)
            out.append(time.perf_counter() - t0)
            for f in (pol / old).iterdir():
                f.unlink()
            (pol / old).rmdir()
        c.close()
        return out
    finally:
        d.stop()


def annotation_rounds(pods: int, rounds: int) -> list[float]:
    api = FakeApiServer().start()
    api.add_node("node-1")
    for i in range(pods):
        api.add_pod(
            f"pod-{i}",
            namespace="bench",
            node="node-1",
            annotations={"nvshare.com/gpu-memory-limit": "1Gi"},
        )
    # The benchmark's client names its pod; this policy trusts the claims of its user.
    trust = f"trust: {{podClaimUids: [{os.getuid()}]}}"
    d = BenchDaemon(trust, args=["--node-name", "node-1", "--kube-api", api.url])
    core = client.CoreV1Api(client.ApiClient(client.Configuration(host=api.url)))
    try:
        c = d.client(pod_namespace="bench", pod_name="pod-0")
        deadline = time.monotonic() + 30
        while True:  # until the first list has reached the daemon
            with d.control() as ctl:
                doc = ctl.request(p.StatusRequest()).doc
            if doc["clients"][0]["memory_limit"] == GiB or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out = []
        for i in range(rounds):
            value, limit = ("2Gi", 2 * GiB) if i % 2 == 0 else ("1Gi", GiB)
            t0 = time.perf_counter()
            core.patch_namespaced_pod(
                "pod-0",
                "bench",
                {"metadata": {"annotations": {"nvshare.com/gpu-memory-limit": value}}},
            )
            wait_limit(c, limit)
            out.append(time.perf_counter() - t0)
        c.close()
        return out
    finally:
        d.stop()
        api.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--pods", type=int, nargs="+", default=[1, 100, 1000])
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print("| change | pods on node | rounds | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    lat = policy_rounds(args.rounds)
    print(
        f"| policy `..data` swap | - | {len(lat)} | {percentile(lat, 50) * 1e3:.1f} | "
        f"{percentile(lat, 99) * 1e3:.1f} | {max(lat) * 1e3:.1f} |",
        flush=True,
    )
    for n in args.pods:
        lat = annotation_rounds(n, args.rounds)
        print(
            f"| annotation PATCH | {n} | {len(lat)} | {percentile(lat, 50) * 1e3:.1f} | "
            f"{percentile(lat, 99) * 1e3:.1f} | {max(lat) * 1e3:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
