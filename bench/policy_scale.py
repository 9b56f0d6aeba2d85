"""Cost of big inputs: loading a policy with many rules, and `nvsharectl status` with many clients.

- policy: a directory holding one YAML file of N rules (each matching a namespace and setting
  a memory limit, about 57 bytes a rule), loaded by `load_policy_dir` in a fresh interpreter; wall
  time and the peak RSS of that interpreter.
- status: a real daemon with N registered clients (Python protocol clients, registered as the
  hook registers), then `nvsharectl status --json`; wall time and the size of the document.

    .venv/bin/python bench/policy_scale.py [--rules 1000 10000 60000] [--clients 1000 10000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import BenchDaemon, machine

from appliance.client import ControlClient

LOAD = """
import resource, sys, time
from pathlib import Path
from appliance.policy.load import load_policy_dir, PolicyLoadError
start = time.perf_counter()
try:
    policy = load_policy_dir(Path(sys.argv[1]), environ={})
    outcome = f"loaded, {len(policy.rules)} rules"
except PolicyLoadError as e:
    outcome = "refused: " + e.errors[0].message[:100]
elapsed = time.perf_counter() - start
print(elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, outcome, sep="\\t")
"""


def write_policy(directory: Path, rules: int) -> int:
    lines = ["rules:"]
    for i in range(rules):
        lines.append(f"- {{match: {{namespace: ns-{i}}}, memoryLimit: {1 + i % 64}Gi}}")
    path = directory / "policy.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path.stat().st_size


def policy_rows(counts: list[int]) -> list[str]:
    rows = []
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="nvs-scale-") as tmp:
            size = write_policy(Path(tmp), n)
            out = subprocess.run(
                [sys.executable, "-c", LOAD, tmp], capture_output=True, text=True, check=True
            ).stdout.strip()
            elapsed, rss_kb, outcome = out.split("\t")
            rows.append(
                f"| {n:,} rules ({size / (1 << 20):.1f} MiB YAML) | {float(elapsed):.2f} s "
                f"| {int(rss_kb) / 1024:.0f} MiB | {outcome} |"
            )
            print(rows[-1], flush=True)
    return rows


def status_rows(counts: list[int]) -> list[str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the daemon inherits it
    rows = []
    for n in counts:
        d = BenchDaemon("")
        clients: list[ControlClient] = []
        try:
            for _ in range(n):
                clients.append(d.client())
            start = time.perf_counter()
            r = subprocess.run(
                [
                    str(Path(sys.executable).parent / "nvsharectl"),
                    "--socket-dir",
                    str(d.socket_dir),
                    "status",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            elapsed = time.perf_counter() - start
            if r.returncode == 0:
                doc = json.loads(r.stdout)
                outcome = (
                    f"{len(doc['clients']):,} clients listed, {len(r.stdout) / (1 << 20):.1f} MiB"
                )
            else:
                outcome = "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:100]
            rows.append(f"| {n:,} clients | {elapsed:.2f} s | {outcome} |")
            print(rows[-1], flush=True)
        finally:
            for c in clients:
                c.close()
            d.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", type=int, nargs="*", default=[1000, 10000, 60000])
    ap.add_argument("--clients", type=int, nargs="*", default=[1000, 10000])
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print("| policy | load time | peak RSS | outcome |\n|---|---:|---:|---|")
    policy_rows(args.rules)
    print("| status | time | outcome |\n|---|---:|---|")
    status_rows(args.clients)


if __name__ == "__main__":
    main()
