"""The starvation bound against a `high` tenant that lends and takes back (issue 24 item 6).

A pod allowed `high` holds the GPU, lets it go idle just short of the victim's starvation limit
and asks again 2 ms later: the victim, granted as a borrower, lost the GPU at once and asked
again with a fresh clock, so it was never counted as starved (0.018 s of 20.5 s). Its clock now
runs on through such turns, and it gets a quantum of its own within the starvation limit and a
quantum. Both tenants are raw hook connections, as a hostile tenant would write them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from appliance.wire import protocol as p

from .conftest import GPU, Stage, eventually, listed_pods

PRIORITY = "nvshare.com/gpu-priority"
LIMIT_S, TQ_S = 2.0, 1.0

# Holds the lock HOLD seconds after each grant, then releases it as idle and asks again 2 ms
# later; told to drop, it does at once (and asks again).
LENDER = """
import sys, time
from pathlib import Path
from appliance.wire import protocol as p
from appliance.cli.client import ControlClient
c = ControlClient.as_hook(Path(sys.argv[1]), timeout=60)
gpu, hold = sys.argv[2], float(sys.argv[3])
sys.stdin.readline()  # placed in its pod
c.request(p.Register(pid=0, gpu_uuid=gpu, gpu_total_mem=80 << 30))
print("registered", flush=True)
while True:
    c.send(p.LockRequest())
    while not isinstance(c.receive()[1], p.LockGrant):
        pass
    until, dropped = time.monotonic() + hold, False
    while not dropped and (left := until - time.monotonic()) > 0:
        c._sock.settimeout(left)
        try:
            dropped = isinstance(c.receive()[1], p.LockDrop)
        except TimeoutError:
            break
    c._sock.settimeout(60)
    c.send(p.LockReleased(p.ReleaseReason.DROPPED if dropped else p.ReleaseReason.IDLE))
    if not dropped:
        time.sleep(0.002)
"""


@pytest.fixture
def high(stage: Stage) -> Iterator[str]:
    stage.policy = (
        f"scheduler: {{mode: 'on', timeQuantum: {TQ_S:g}s, starvationLimit: {LIMIT_S:g}s}}\n"
        "annotations: {priorityRange: {max: high}}\n"
    )
    with listed_pods(stage, high={PRIORITY: "high"}) as uids:
        yield uids["high"]


def test_a_high_lender_taking_back_each_lend_leaves_the_victim_its_bound(
    stage: Stage, high: str
) -> None:
    stage.start()
    lender = subprocess.Popen(
        [sys.executable, "-c", LENDER, str(stage.socket_dir), GPU, str(LIMIT_S - 0.3)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stage.proc.pod(lender.pid, high)
        assert lender.stdin is not None and lender.stdout is not None
        lender.stdin.write("placed\n")
        lender.stdin.flush()
        assert lender.stdout.readline() == "registered\n"
        eventually(
            lambda: any(c["priority"] > 0 for c in stage.status()["clients"]),
            "the watch lists the high pod",
        )
        time.sleep(0.1)  # it holds the GPU
        victim = stage.registered()
        victim._sock.settimeout(30)
        lends = 0  # turns taken back at once
        own_turn = False
        while not own_turn and lends <= 5:
            victim.send(p.LockRequest())
            while not isinstance(victim.receive()[1], p.LockGrant):
                pass
            victim._sock.settimeout(TQ_S / 2)
            try:  # a turn of its own lasts its quantum: no drop within half of it
                while not isinstance(victim.receive()[1], p.LockDrop):
                    pass
            except TimeoutError:
                own_turn = True
            victim._sock.settimeout(30)
            if not own_turn:
                lends += 1
                victim.send(p.LockReleased(p.ReleaseReason.DROPPED))
        # Its clock runs from its first request: starved after 2 s, it is granted a quantum of
        # its own by the second lend (1.7 s each), or when the lender's quantum ends.
        assert own_turn and lends <= 2, f"{lends} turns taken back at once, none its own"
    finally:
        lender.kill()
        lender.wait()
        for f in (lender.stdin, lender.stdout):
            if f is not None:
                f.close()
