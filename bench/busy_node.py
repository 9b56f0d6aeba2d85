"""Lock hand-off latency on a node whose CPUs are all busy, by the daemon's CPU priority.

A hand-off is the daemon waking twice (the release read, the grant written); beside CPU-bound
work (data loaders, tokenizers, a build) it waits for a CPU each time. This starts one
CPU-bound process per CPU (`--hogs`), then runs `lock_handoff.py`'s hand-off with:

- `--nice`: the daemon at each nice value (-10 is its default and what the systemd unit gets;
  0, what it ran at before it set its own);
- `--shares`: the daemon at nice 0 in a cgroup of each CPU weight, in cpu.shares units (kubelet
  gives a container 1024 per CPU requested: 102 for 100m, 512 for 500m), the hogs in a cgroup
  of `--hog-shares` (4096: a pod of 4 CPUs) and the clients in another of the same weight, as
  kubelet places pods. cgroup v2 (cpu.weight, converted as kubelet does) or v1's cpu controller.

Rounds interleave the settings. Needs root (cgroups; a nice value below 0).

    .venv/bin/python bench/busy_node.py [--hogs 2] [--clients 128] [--handoffs 1000]
        [--nice 0 -10] [--shares 102 512 1024] [--hog-shares 4096] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from _daemon import BenchDaemon, machine, percentile
from lock_handoff import handoff

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")


def cpu_root() -> tuple[Path, bool]:
    """(the cpu controller's root, whether it is cgroup v2)."""
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2, True
    return V1, False


def home(root: Path, v2: bool) -> Path:
    """This process's cgroup under `root` (where everything runs for the nice settings)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v2 and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
            return root / path.lstrip("/")
    return root


def put(group: Path, *pids: int) -> None:
    for pid in pids:
        (group / "cgroup.procs").write_text(str(pid))


def weigh(group: Path, v2: bool, shares: int) -> None:
    if v2:  # kubelet's conversion of cpu.shares to cpu.weight
        (group / "cpu.weight").write_text(str(1 + (shares - 2) * 9999 // 262142))
    else:
        (group / "cpu.shares").write_text(str(shares))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--handoffs", type=int, default=1000)
    ap.add_argument("--nice", type=int, nargs="*", default=[0, -10])
    ap.add_argument("--shares", type=int, nargs="*", default=[])
    ap.add_argument("--hog-shares", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root, v2 = cpu_root()
    start = home(root, v2)
    groups = {k: root / f"nvshare-bench-{k}" for k in ("hogs", "clients", "daemon")}
    for g in groups.values():
        g.mkdir(exist_ok=True)
    weigh(groups["hogs"], v2, args.hog_shares)
    weigh(groups["clients"], v2, args.hog_shares)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    settings = [("nice", n) for n in args.nice] + [("shares", s) for s in args.shares]
    print(
        f"machine: {machine()}; {args.hogs} CPU-bound processes; {args.clients} clients; "
        f"cgroup {'v2' if v2 else 'v1'}"
    )
    print("| round | daemon | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---:|---|---:|---:|---:|")
    try:
        for r in range(1, args.rounds + 1):
            for kind, value in settings:
                pods = kind == "shares"  # else: everything in this process's own cgroup
                put(groups["hogs"] if pods else start, *(h.pid for h in hogs))
                put(groups["clients"] if pods else start, os.getpid())
                if pods:
                    weigh(groups["daemon"], v2, value)

                def place(d: BenchDaemon, pods: bool = pods) -> None:
                    if pods:
                        put(groups["daemon"], d.proc.pid)

                nice = 0 if pods else value
                lat, _, _ = handoff(
                    args.clients,
                    args.handoffs,
                    None,
                    False,
                    daemon_args=["--nice", str(nice)],
                    started=place,
                )
                label = f"nice 0, cpu.shares {value}" if pods else f"nice {value}"
                print(
                    f"| {r} | {label} | {percentile(lat, 50) * 1e3:.3f} | "
                    f"{percentile(lat, 99) * 1e3:.3f} | {max(lat) * 1e3:.3f} |",
                    flush=True,
                )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        put(start, os.getpid())
        for g in groups.values():
            g.rmdir()


if __name__ == "__main__":
    main()
