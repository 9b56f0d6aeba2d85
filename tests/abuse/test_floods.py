"""Cheap messages that cost the daemon work, flooded from many connections of one tenant: the
honest tenant's registration and nvsharectl's status are answered in their turn, not after the
flood (issue 24, item 3).

A pod's process opens 100 connections, registers each, and then, all at once, sends on each a
few turns' worth of PRIORITY_HINTs and lock requests and releases. Turns go round the tenants
(`connection.Turns`), so the status of a user on the host and the registration of a new hook
wait for at most a turn of the flood each, never for the whole of it. The daemon runs on a loop
this test drives (`daemon.driven`): order and counts, never the clock.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import uvloop
from daemon.driven import GPU, Peer, daemon, register, until

from appliance.core import events as ev
from appliance.core.annotations import PodInfo
from appliance.core.node import NodeCore
from appliance.wire import protocol as p

from .conftest import REGISTER_MANY, FakeProc

POD = "0b1c5e5e-7777-4888-9999-f100d5f100d5"
CONNECTIONS = 100
FRAMES = 32  # four turns of a connection

# Registers N connections, waits for "go", sends each four turns of hints, requests, releases.
FLOODER = (
    REGISTER_MANY
    + """
churn = [p.PriorityHint(-1), p.PriorityHint(-2), p.LockRequest()]
churn += [p.LockReleased(p.ReleaseReason.IDLE)]
for s in conns:
    s.sendall(b"".join(framing.encode(m, seq=2 + i) for i, m in enumerate(churn * 8)))
print("sent", flush=True)
sys.stdin.readline()
"""
)


def test_a_flood_of_hints_and_lock_churn_waits_for_an_honest_tenant(tmp_path: Path) -> None:
    proc_root = FakeProc(tmp_path / "proc")

    async def main() -> None:
        async with daemon(tmp_path, proc_root=proc_root.root) as (server, engine):
            core: NodeCore = engine._core
            engine.dispatch(ev.PodSeen(PodInfo(POD, "team", "flood", "node-1")))  # listed
            flooder = subprocess.Popen(
                [sys.executable, "-c", FLOODER, str(server.path), str(CONNECTIONS), GPU],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert flooder.stdin is not None and flooder.stdout is not None
            try:
                proc_root.pod(flooder.pid, POD)
                flooder.stdin.write("placed\n")
                flooder.stdin.flush()
                await until(lambda: len(core.state.clients) == CONNECTIONS, patient=True)
                flood_ids = list(core.state.clients)
                assert core.state.pod_uid(core.state.clients[flood_ids[0]]) == POD
                assert flooder.stdout.readline() == "registered\n"
                before = engine.generation
                flooder.stdin.write("go\n")
                flooder.stdin.flush()
                assert flooder.stdout.readline() == "sent\n"  # the loop stood still meanwhile
                honest, status = Peer(server.path), Peer(server.control_path)
                register(honest)
                status.send(p.StatusRequest())
                await until(lambda: any(isinstance(m, p.Registered) for m in honest.read()))
                at_registration = engine.generation - before
                await until(lambda: any(isinstance(m, p.JsonBody) for m in status.read()))
                at_status = engine.generation - before
                flood = CONNECTIONS * FRAMES
                assert at_registration < flood // 2, (
                    f"the honest registration was answered after {at_registration} of the "
                    f"flood's {flood} frames"
                )
                assert at_status < flood // 2, (
                    f"status was answered after {at_status} of the flood's {flood} frames"
                )
                await until(lambda: engine.generation - before >= flood)  # it is all served
                honest_client = core.state.clients[max(core.state.clients)]
                assert core.state.pod_uid(honest_client) is None  # another tenant
            finally:
                flooder.kill()
                flooder.wait()
                flooder.stdin.close()
                flooder.stdout.close()

    uvloop.run(main())
