"""Accepting connections on the daemon's sockets, before asyncio makes anything of them.

One process connecting and closing in a loop keeps a listen backlog full, and the kernel gives a
freed slot to whoever asks first, seldom a program that has just started. The server therefore
accepts itself, a bounded number a turn of the event loop, and refuses at once a connection its
user or pod may not open now (`admission`): that costs an accept, SO_PEERCRED and a close, so
the backlog drains faster than one churner fills it.
"""

from __future__ import annotations

import asyncio
import enum
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.host.peer import peer_credentials, where_it_runs
from appliance.serve.admission import Admission
from appliance.wire import framing
from appliance.wire import protocol as p

ACCEPTS_PER_TURN = 256


class Role(enum.Enum):
    HOOK = "hook socket"
    CONTROL = "control socket"


class Acceptor:
    """Accepts on the listening sockets it is given and hands each admitted connection to
    asyncio with the protocol `factory(role, admission key)` makes."""

    def __init__(
        self,
        admission: Admission,
        factory: Callable[[Role, tuple[str, str]], Callable[[], Any]],
        *,
        proc_root: Path,
    ) -> None:
        self._admission = admission
        self._factory = factory
        self._proc_root = proc_root
        self._listening: list[socket.socket] = []
        self._adopting: set[asyncio.Task[None]] = set()
        self._keys: dict[int, tuple[float, tuple[str, str]]] = {}  # pid -> (until, admission key)

    def listen(self, role: Role, listener: socket.socket) -> None:
        listener.setblocking(False)
        self._listening.append(listener)
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, role, listener)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._listening:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._listening.clear()

    def _accept(self, role: Role, listener: socket.socket) -> None:
        """Accept what waits, `ACCEPTS_PER_TURN` at most (the cgroup is read once a second
        per pid)."""
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of files: say so once a minute, try again in a second
                self._admission.notes.warn(
                    "accept",
                    "cannot accept connections: %s (%d open); retrying every second",
                    exc,
                    self._admission.count,
                )
                loop.remove_reader(listener.fileno())
                loop.call_later(1.0, self._resume, role, listener)
                return
            try:
                pid, uid, _ = peer_credentials(sock)
            except OSError:
                pid = uid = -1
            key = self._admission_key(pid, uid, loop.time())
            refusal = self._admission.admit(key)
            if refusal is not None:
                _refuse(sock, refusal)
                continue
            sock.setblocking(False)
            task = loop.create_task(self._adopt(role, sock, key))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _resume(self, role: Role, listener: socket.socket) -> None:
        if listener in self._listening:
            asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, role, listener)

    def _admission_key(self, pid: int, uid: int, now: float) -> tuple[str, str]:
        """Whose connection budget a connection draws on: its pod's, if the pod watch knows
        that pod, else its user's."""
        known = self._keys.get(pid)
        if known is not None and known[0] > now:
            return known[1]
        cgroup = where_it_runs(pid, proc_root=self._proc_root) if pid > 0 else None
        pod = cgroup.pod_uid if cgroup is not None else None
        key = ("pod", pod) if pod and self._admission.pod_known(pod) else ("uid", str(uid))
        if len(self._keys) > 4096:
            self._keys = {other: k for other, k in self._keys.items() if k[0] > now}
        self._keys[pid] = (now + 1.0, key)
        return key

    async def _adopt(self, role: Role, sock: socket.socket, key: tuple[str, str]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self._factory(role, key), sock=sock)
        except OSError:
            self._admission.release(key)
            sock.close()


def _refuse(sock: socket.socket, why: str) -> None:
    """Tell a refused peer why, if its buffer takes it now, and close."""
    try:
        frame = framing.encode(p.Result(p.Status.PERMISSION, 0, f"{why}; try again later"))
        sock.send(frame, socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()
