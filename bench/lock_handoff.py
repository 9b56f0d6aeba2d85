"""Lock hand-off latency through the daemon: release sent -> next client's grant received.

N clients on one GPU in mode `on` keep the queue full: the holder releases, the next in line
receives its grant, the old holder asks again. Measured on the client side over the real Unix
socket, so it includes both socket hops and the daemon's event loop.

    .venv/bin/python bench/lock_handoff.py [--clients 2 16 128] [--handoffs 2000]
"""

from __future__ import annotations

import argparse
import select
import time

from _daemon import BenchDaemon, machine, percentile

from appliance import protocol as p


def run(n: int, handoffs: int) -> list[float]:
    d = BenchDaemon("scheduler: {mode: 'on', timeQuantum: 3600s}")
    try:
        clients = [d.client() for _ in range(n)]
        holder = clients[0]
        assert isinstance(holder.request(p.LockRequest()), p.LockGrant)
        for c in clients[1:]:
            c.send(p.LockRequest())
        by_fd = {c._sock.fileno(): c for c in clients}
        latencies = []
        for _ in range(handoffs):
            t0 = time.perf_counter()
            holder.send(p.LockReleased(p.ReleaseReason.IDLE))
            granted = None
            while granted is None:
                ready, _, _ = select.select(list(by_fd), [], [], 5)
                assert ready, "no grant within 5 s"
                for fd in ready:
                    _, msg = by_fd[fd].receive()
                    if isinstance(msg, p.LockGrant):
                        granted = by_fd[fd]
            latencies.append(time.perf_counter() - t0)
            holder.send(p.LockRequest())  # back of the queue
            holder = granted
        for c in clients:
            c.close()
        return latencies
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 16, 128])
    ap.add_argument("--handoffs", type=int, default=2000)
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print("| clients | hand-offs | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.clients:
        lat = run(n, args.handoffs)
        print(
            f"| {n} | {len(lat)} | {percentile(lat, 50) * 1e3:.3f} | "
            f"{percentile(lat, 99) * 1e3:.3f} | {max(lat) * 1e3:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
