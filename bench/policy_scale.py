"""Cost of big inputs: loading a policy with many rules, and `nvsharectl status` with many clients.

- policy: a directory of YAML files holding N rules in all (at most 10,000 a file, each rule
  matching a namespace and setting a memory limit, about 57 bytes a rule), loaded by
  `load_policy_dir` in a fresh interpreter: wall time, peak RSS of that interpreter, and what
  came of it (loaded, or refused and why).
- status: a real daemon with N registered clients (Python protocol clients, registered as the
  hook registers), then `nvsharectl status --json`: wall time and what it printed.

With `--baseline DIR` (another checkout, e.g. `git worktree add /tmp/base <commit>`) every row is
measured on that tree's appliance too, in the same run, and the ratio is given.

    .venv/bin/python bench/policy_scale.py [--rules 1000 10000 60000] [--clients 1000 10000]
        [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import BenchDaemon, machine

from appliance.cli.client import ControlClient

LOAD = """
import resource, sys, time
from pathlib import Path
from appliance.policy.load import load_policy_dir, PolicyLoadError
start = time.perf_counter()
try:
    policy = load_policy_dir(Path(sys.argv[1]), environ={})
    outcome = f"loaded, {len(policy.rules)} rules"
except PolicyLoadError as e:
    outcome = "refused: " + str(e.errors[0])[:90]
elapsed = time.perf_counter() - start
print(elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, outcome, sep="\\t")
"""
CTL = (
    "import sys; from appliance.cli.nvsharectl import nvsharectl; "
    "sys.argv[0] = 'nvsharectl'; nvsharectl()"
)
PER_FILE = 10_000


def write_policy(directory: Path, rules: int) -> int:
    size = 0
    for first in range(0, rules, PER_FILE):
        lines = ["rules:"]
        for i in range(first, min(rules, first + PER_FILE)):
            lines.append(f"- {{match: {{namespace: ns-{i}}}, memoryLimit: {1 + i % 64}Gi}}")
        path = directory / f"{first // PER_FILE:02d}-rules.yaml"
        path.write_text("\n".join(lines) + "\n")
        size += path.stat().st_size
    return size


def env_for(tree: Path | None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)} if tree else dict(os.environ)


def load_once(directory: Path, tree: Path | None) -> tuple[float, float, str]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(directory)],
        capture_output=True,
        text=True,
        check=True,
        env=env_for(tree),
    ).stdout.strip()
    elapsed, rss_kb, outcome = out.split("\t")
    return float(elapsed), int(rss_kb) / 1024, outcome


def status_once(count: int, tree: Path | None) -> tuple[float, str]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env_for(tree))  # BenchDaemon's daemon inherits it
    try:
        d = BenchDaemon(f"connections: {{perUid: {count + 100}}}")  # one user, many clients
    finally:
        os.environ.clear()
        os.environ.update(saved)
    clients: list[ControlClient] = []
    try:
        for _ in range(count):
            clients.append(d.client())
        start = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-c", CTL, "--socket-dir", str(d.socket_dir), "status", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env_for(tree),
        )
        elapsed = time.perf_counter() - start
        if r.returncode == 0:
            listed = len(json.loads(r.stdout)["clients"])
            return elapsed, f"{listed:,} clients, {len(r.stdout) / (1 << 20):.1f} MiB"
        return elapsed, "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][-90:]
    finally:
        for c in clients:
            c.close()
        d.stop()


def ratio(now: float, before: float) -> str:
    return f"{before / now:.0f}x" if now > 0 else "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", type=int, nargs="*", default=[1000, 10000, 60000])
    ap.add_argument("--clients", type=int, nargs="*", default=[1000, 10000])
    ap.add_argument("--baseline", type=Path, help="another checkout to measure side by side")
    args = ap.parse_args()
    trees: list[tuple[str, Path | None]] = [("now", None)]
    if args.baseline:
        trees.append(("baseline", args.baseline.resolve()))
    print(f"machine: {machine()}")
    print("\n| policy | tree | load time | peak RSS | outcome |\n|---|---|---:|---:|---|")
    for n in args.rules:
        with tempfile.TemporaryDirectory(prefix="nvs-scale-") as tmp:
            size = write_policy(Path(tmp), n)
            for name, tree in trees:
                elapsed, rss, outcome = load_once(Path(tmp), tree)
                print(
                    f"| {n:,} rules, {size / (1 << 20):.1f} MiB | {name} | {elapsed:.2f} s "
                    f"| {rss:.0f} MiB | {outcome} |",
                    flush=True,
                )
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # daemons inherit it
    print("\n| status | tree | time | outcome |\n|---|---|---:|---|")
    for n in args.clients:
        for name, tree in trees:
            elapsed, outcome = status_once(n, tree)
            print(f"| {n:,} clients | {name} | {elapsed:.2f} s | {outcome} |", flush=True)


if __name__ == "__main__":
    main()
