"""What a lock hand-off costs the whole daemon, in instructions: the core and the path around
it (socket reads, frame decoding, the engine, frame encoding, socket writes, asyncio's loop).

`bench/core_cost.py` counts the core alone. This runs the daemon itself under
`valgrind --tool=callgrind`, counting only around the hand-offs (`callgrind_control -i on`,
then `off`), with N clients waiting on one GPU in mode `on` as in `lock_handoff.py handoff`:
the holder releases, the next in line is granted, the old holder asks again at once. Whether
the daemon reads that request and the next release in one pass of its loop or in two, and
whether the request finds the lock still lent (and the new holder is told to drop), depends on
how the two processes ran: repeated runs differ by 1-2 %, against some 30 % for wall-clock
hand-off times on the shared 2-core machine.

Under valgrind the daemon runs some 50 times slower; `valgrind_site/sitecustomize.py` makes
the time slice for turns as much longer, so that it takes its turns as it does natively.

    .venv/bin/python bench/daemon_cost.py [--clients 16 512 2000] [--handoffs 300] [--tree /tmp/old]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import selectors
import subprocess
import tempfile
import time
from pathlib import Path

from _daemon import BenchDaemon, machine

from appliance.cli.client import ControlClient
from appliance.wire import protocol as p

HERE = Path(__file__).resolve().parent
POLICY = "scheduler: {mode: 'on', timeQuantum: 3600s}\nconnections: {perUid: 8192}"
SLOWER = 100  # the turn slice under valgrind, in native slices (it runs 30-100x slower)
ANSWER_S = 600  # what the daemon under valgrind may take to answer one frame


class Line:
    """N hooks in line for one GPU, read on epoll."""

    def __init__(self, d: BenchDaemon, n: int) -> None:
        self.clients = [d.client(timeout=ANSWER_S) for _ in range(n)]
        self.holder = self.clients[0]
        assert isinstance(self.holder.request(p.LockRequest()), p.LockGrant)
        for c in self.clients[1:]:
            c.send(p.LockRequest())
        self.sel = selectors.DefaultSelector()
        for c in self.clients:
            self.sel.register(c._sock, selectors.EVENT_READ, c)

    def answers(self) -> list[tuple[ControlClient, object]]:
        """What the daemon sent next (waits for it)."""
        ready = self.sel.select(ANSWER_S)
        assert ready, f"no answer within {ANSWER_S} s"
        return [(key.data, msg) for key, _ in ready for msg in key.data.receive_read()]

    def hand_off(self) -> None:
        """The holder releases; wait for the grant; the old holder asks again."""
        old = self.holder
        old.send(p.LockReleased(p.ReleaseReason.IDLE))
        while True:
            granted = [c for c, msg in self.answers() if isinstance(msg, p.LockGrant)]
            if granted:
                self.holder = granted[0]
                break
        old.send(p.LockRequest())

    def close(self) -> None:
        for c in self.clients:
            c.close()


def per_handoff(n: int, handoffs: int, tree: Path | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        site = str(HERE / "valgrind_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
        )
        os.environ["NVSHARE_BENCH_TURN_SLICE_S"] = str(0.002 * SLOWER)
        os.environ["PYTHONHASHSEED"] = "0"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        d = BenchDaemon(POLICY, tree=tree, under=[*valgrind, f"--callgrind-out-file={out}"])
        try:
            line = Line(d, n)
            for _ in range(20):  # warm: every path taken once before counting
                line.hand_off()
            _control(d, "-i", "on")
            for _ in range(handoffs):
                line.hand_off()
            time.sleep(1)  # the last request handled, counted
            _control(d, "-i", "off")
            _control(d, "-d")
            line.close()
        finally:
            d.stop()
        counted = [f for f in Path(tmp).iterdir() if f.name.startswith("callgrind.out")]
        totals = [_total(f.read_text()) for f in counted]
        return max(totals) / handoffs


def _control(d: BenchDaemon, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(d.proc.pid)], check=True, capture_output=True)


def _total(dump: str) -> int:
    """The instructions a dump counted (its summary line can say 0: `totals` has them)."""
    return max((int(n) for n in re.findall(r"^(?:summary|totals):\s+(\d+)", dump, re.M)), default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[16, 512, 2000])
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--tree", type=Path, help="the checkout whose daemon to run")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"machine: {machine()}; tree: {args.tree or 'this one'}")
    print("| waiting clients | instructions per hand-off, whole daemon |")
    print("|---:|---:|")
    for n in args.clients:
        print(f"| {n} | {per_handoff(n, args.handoffs, args.tree):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
