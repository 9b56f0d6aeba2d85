"""A daemon's socket server, engine and core on an event loop the test drives itself: it writes
frames while the loop stands still, then lets the loop run a pass at a time and looks at what was
answered and how many events the core had handled by then (order and counts, never the clock).
Connections take their turns by a clock that counts turns (`TURNS_A_PASS` a pass), not by the
time they take, so a pass handles the same frames on a fast machine and on a loaded one.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from appliance.core.node import NodeCore
from appliance.daemon.engine import Engine
from appliance.daemon.queries import STATUS_SLICE_S, Answers
from appliance.policy.model import Mode, Policy, SchedulerSettings
from appliance.policy.watch import PolicyWatcher
from appliance.serve.connection import TURN_SLICE_S, Turns
from appliance.serve.server import SchedulerServer
from appliance.wire import framing
from appliance.wire import protocol as p

GPU = "GPU-00000000-0000-0000-0000-0000000000f1"
PASSES = 10_000  # bounds the loop passes a test waits for anything (never reached)
TURNS_A_PASS = 4  # connections' turns in one pass of the loop (`Turns`, by a counting clock)


OPEN: list[socket.socket] = []  # closed by `daemon` as it stops


class Peer:
    """A hook's socket, non-blocking, read and written between passes of the loop."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        OPEN.append(self.sock)
        self.sock.connect(str(path))
        self.sock.setblocking(False)
        self.decoder = framing.FrameDecoder(max_body=16 << 20)
        self.got: list[Any] = []
        self.seq = 0

    def send(self, *messages: Any) -> None:
        data = b""
        for m in messages:
            self.seq += 1
            data += framing.encode(m, seq=self.seq)
        self.sock.sendall(data)

    def read(self) -> list[Any]:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return self.got
        for frame in self.decoder.feed(data):
            assert isinstance(frame, framing.Frame)
            self.got.append(framing.decode_body(frame))
        return self.got


@asynccontextmanager
async def daemon(
    tmp_path: Path,
    *,
    proc_root: Path = Path("/proc"),
    status_slice_s: float = STATUS_SLICE_S,
    answers_out: list[Answers] | None = None,
) -> AsyncIterator[tuple[SchedulerServer, Engine]]:
    """`status_slice_s`: the status document's work per pass of the loop (0: a row a pass);
    `answers_out`: given, gets the daemon's `Answers` (what a scrape reads)."""
    loop = asyncio.get_running_loop()
    core = NodeCore(Policy(scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=3600)))
    engine = Engine(core, loop=loop)
    for d in ("run", "ctl", "policy"):
        (tmp_path / d).mkdir(mode=0o755)
    watcher = PolicyWatcher(tmp_path / "policy", on_policy=print, on_error=print)
    answers = Answers(
        core, clock=engine.now, watcher=watcher, policy_dir=tmp_path, nvml_available=False
    )
    server = SchedulerServer(
        socket_dir=tmp_path / "run",
        control_dir=tmp_path / "ctl",
        dispatch=engine.dispatch,
        status=answers.status,
        status_document=lambda: answers.status_document(slice_s=status_slice_s),
        queries=answers.queries,
        view=core.memory_view,
        generation=lambda: engine.generation,
        proc_root=proc_root,
        turns=Turns(clock=itertools.count(step=TURN_SLICE_S / TURNS_A_PASS).__next__),
    )
    server.admission.pod_known = core.state.pods.pods.__contains__  # as the daemon wires it
    engine.connect(server.send, *SchedulerServer.ACTIONS)
    await server.start()
    try:
        if answers_out is not None:
            answers_out.append(answers)
        yield server, engine
    finally:
        while OPEN:
            OPEN.pop().close()
        engine.close()
        await server.stop()


async def until(check: Any, *, patient: bool = False) -> int:
    """Let the loop run a pass at a time until `check()`; the passes it took. `patient`: for
    what another process does (it starts, it connects), the loop also sleeps between passes."""
    for passes in range(PASSES):
        if check():
            return passes
        await asyncio.sleep(0.01 if patient else 0)
    raise AssertionError("never happened")


async def connected(path: Path, n: int) -> list[Peer]:
    """n peers, connected a few at a time (the loop accepts between: the backlog is finite)."""
    peers: list[Peer] = []
    while len(peers) < n:
        peers += [Peer(path) for _ in range(min(8, n - len(peers)))]
        await asyncio.sleep(0)
    return peers


def register(peer: Peer) -> None:
    peer.send(p.Register(pid=os.getpid(), gpu_uuid=GPU, gpu_total_mem=80 << 30))


async def registered(peers: list[Peer]) -> None:
    for peer in peers:
        register(peer)
    await until(lambda: all(any(isinstance(m, p.Registered) for m in x.read()) for x in peers))
