"""The asyncio Unix-socket server: hooks and nvsharectl in, scheduler actions out.

One task per connection reads frames and turns them into core events; the core's actions are
written without awaiting the peer, so a slow or stuck reader never stalls anyone else: its
transport buffer is bounded and the connection is dropped when it overflows. Garbage (a bad
magic, an oversized frame) closes that one connection after an ERROR frame; an unknown type or
version is answered with an ERROR frame and the connection stays up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import protocol as p
from appliance.core import events as ev
from appliance.core.scheduler import Scheduler
from appliance.identity import identify, is_admin, peer_credentials
from appliance.policy.model import Limits, Mode

log = logging.getLogger("nvshare.server")

SOCKET_NAME = "scheduler.sock"
DEFAULT_SOCKET_DIR = Path("/var/run/nvshare")
MAX_WRITE_BUFFER = 1 << 20
_MODES = {p.WireMode.OFF: Mode.OFF, p.WireMode.ON: Mode.ON, p.WireMode.AUTO: Mode.AUTO}

QueryHandler = Callable[[dict[str, Any]], dict[str, Any]]


def socket_dir_from_env(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("NVSHARE_SOCKET_DIR") or DEFAULT_SOCKET_DIR)


@dataclass(slots=True)
class Connection:
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    client_id: int | None = None
    closed: bool = False
    peer: str = field(default="")

    def send(self, message: Any, seq: int = 0) -> bool:
        if self.closed:
            return False
        transport = self.writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("%s is not reading its socket; disconnecting it", self.peer)
            self.closed = True
            transport.abort()  # close() would wait to flush what it never reads
            return False
        self.writer.write(p.encode(message, seq=seq))
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class SchedulerServer:
    def __init__(
        self,
        core: Scheduler,
        *,
        socket_dir: Path,
        proc_root: Path = Path("/proc"),
        admin_group: str | None = None,
        queries: dict[str, QueryHandler] | None = None,
        status_extra: Callable[[], dict[str, Any]] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.socket_dir = socket_dir
        self.proc_root = proc_root
        self.admin_group = admin_group
        self.queries = queries or {}
        self.status_extra = status_extra or dict
        self.on_change = on_change or (lambda: None)
        self._clients: dict[int, Connection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def path(self) -> Path:
        return self.socket_dir / SOCKET_NAME

    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from a daemon that died
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o666)  # any local user may connect; identity comes from the kernel
        log.info("listening on %s", self.path)

    async def stop(self) -> None:
        if self._timer:
            self._timer.cancel()
        if self._server:
            self._server.close()
            for conn in list(self._clients.values()):
                conn.close()
            if self._tasks:  # let every connection task see its EOF and finish
                await asyncio.wait(self._tasks, timeout=5)
            await self._server.wait_closed()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ core glue

    def dispatch(self, event: ev.Event) -> None:
        """Feed one event to the core and carry out its actions (event-loop thread only)."""
        for action in self.core.handle(event, self.now()):
            conn = self._clients.get(action.client_id)
            if conn is not None:
                conn.send(action.message, action.seq)
        self._arm_timer()
        self.on_change()

    def _arm_timer(self) -> None:
        if self._timer:
            self._timer.cancel()
            self._timer = None
        deadline = self.core.next_deadline()
        if deadline is not None and self._loop is not None:
            self._timer = self._loop.call_at(deadline, self.dispatch, ev.Tick())

    # ----------------------------------------------------------------- connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        sock: socket.socket = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        conn = Connection(writer=writer, pid=pid, uid=uid, gid=gid, peer=f"pid {pid} (uid {uid})")
        decoder = p.FrameDecoder()
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                try:
                    items = decoder.feed(data)
                except p.ProtocolError as exc:
                    log.warning("%s sent garbage (%s); closing its connection", conn.peer, exc)
                    conn.send(p.Result(exc.status, exc.ref_type, str(exc)))
                    break
                for item in items:
                    if isinstance(item, p.ProtocolError):
                        conn.send(p.Result(item.status, item.ref_type, str(item)))
                        continue
                    self._on_frame(conn, item)
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection error: %s", conn.peer, exc)
        finally:
            conn.close()
            if conn.client_id is not None:
                self._clients.pop(conn.client_id, None)
                self.dispatch(ev.ClientGone(conn.client_id))

    def _on_frame(self, conn: Connection, frame: p.Frame) -> None:
        try:
            msg = p.decode_body(frame)
        except p.ProtocolError as exc:
            conn.send(p.Result(exc.status, exc.ref_type, str(exc)), frame.seq)
            return
        handler = getattr(self, f"_on_{type(msg).__name__}", None)
        if handler is None:
            conn.send(
                p.Result(
                    p.Status.UNKNOWN_TYPE,
                    frame.msg_type,
                    f"{p.MsgType(frame.msg_type).name} is not accepted by the daemon",
                ),
                frame.seq,
            )
            return
        handler(conn, msg, frame.seq)

    def _need_client(self, conn: Connection, seq: int, ref: p.MsgType) -> int | None:
        if conn.client_id is None:
            conn.send(p.Result(p.Status.NOT_REGISTERED, ref, "send REGISTER first"), seq)
        return conn.client_id

    def _need_admin(self, conn: Connection, seq: int, ref: p.MsgType, what: str) -> bool:
        if is_admin(
            conn.pid, conn.uid, conn.gid, admin_group=self.admin_group, proc_root=self.proc_root
        ):
            return True
        who = "root" + (f" or members of group {self.admin_group!r}" if self.admin_group else "")
        conn.send(
            p.Result(p.Status.PERMISSION, ref, f"only {who} may {what}; nothing changed"), seq
        )
        log.warning("refused to let %s %s", conn.peer, what)
        return False

    # hooks

    def _on_Register(self, conn: Connection, msg: p.Register, seq: int) -> None:  # noqa: N802
        if conn.client_id is not None:
            conn.send(p.Result(p.Status.INVALID, p.MsgType.REGISTER, "already registered"), seq)
            return
        ident = identify(
            conn.pid,
            conn.uid,
            conn.gid,
            proc_root=self.proc_root,
            claimed_namespace=msg.pod_namespace,
            claimed_pod=msg.pod_name,
        )
        conn.client_id = next(self._ids)
        conn.peer = f"client {conn.client_id} (pid {conn.pid}, uid {conn.uid})"
        self._clients[conn.client_id] = conn
        self.dispatch(
            ev.ClientRegistered(
                client_id=conn.client_id,
                seq=seq,
                ident=ident,
                gpu_uuid=msg.gpu_uuid,
                gpu_total_memory=msg.gpu_total_mem,
                env_memory_bytes=msg.env_mem_limit,
                env_core_percent=msg.env_core_limit,
            )
        )

    def _on_LockRequest(self, conn: Connection, msg: Any, seq: int) -> None:  # noqa: N802
        if (cid := self._need_client(conn, seq, p.MsgType.LOCK_REQUEST)) is not None:
            self.dispatch(ev.LockRequested(cid, seq))

    def _on_LockReleased(self, conn: Connection, msg: p.LockReleased, seq: int) -> None:  # noqa: N802
        if (cid := self._need_client(conn, seq, p.MsgType.LOCK_RELEASED)) is not None:
            self.dispatch(ev.LockReleased(cid, msg.reason))

    def _on_MemReserve(self, conn: Connection, msg: p.MemReserve, seq: int) -> None:  # noqa: N802
        if (cid := self._need_client(conn, seq, p.MsgType.MEM_RESERVE)) is not None:
            self.dispatch(ev.MemoryReserveRequested(cid, seq, msg.nbytes, msg.used))

    def _on_MemReturn(self, conn: Connection, msg: p.MemReturn, seq: int) -> None:  # noqa: N802
        if (cid := self._need_client(conn, seq, p.MsgType.MEM_RETURN)) is not None:
            self.dispatch(ev.MemoryReturned(cid, msg.nbytes, msg.used))

    # nvsharectl

    def _ok(self, conn: Connection, seq: int, ref: p.MsgType, message: str) -> None:
        conn.send(p.Result(p.Status.OK, ref, message), seq)

    def _on_SetTq(self, conn: Connection, msg: p.SetTq, seq: int) -> None:  # noqa: N802
        if not self._need_admin(conn, seq, p.MsgType.SET_TQ, "set the time quantum"):
            return
        if msg.seconds <= 0:
            conn.send(
                p.Result(
                    p.Status.INVALID,
                    p.MsgType.SET_TQ,
                    "the time quantum must be a positive number of seconds",
                ),
                seq,
            )
            return
        self.dispatch(ev.TimeQuantumSet(float(msg.seconds)))
        tq = self.core.tq_override
        self._ok(conn, seq, p.MsgType.SET_TQ, f"time quantum set to {tq:g} s")
        log.info("%s set the time quantum to %g s", conn.peer, tq)

    def _on_SetMode(self, conn: Connection, msg: p.SetMode, seq: int) -> None:  # noqa: N802
        if not self._need_admin(conn, seq, p.MsgType.SET_MODE, "change the scheduling mode"):
            return
        mode = _MODES[msg.mode]
        self.dispatch(ev.ModeSet(mode, msg.gpu_uuid))
        where = msg.gpu_uuid or "every GPU"
        self._ok(conn, seq, p.MsgType.SET_MODE, f"anti-thrashing mode {mode.value} on {where}")
        log.info("%s set mode %s on %s", conn.peer, mode.value, where)

    def _on_LimitSet(self, conn: Connection, msg: p.LimitSet, seq: int) -> None:  # noqa: N802
        if not self._need_admin(conn, seq, p.MsgType.LIMIT_SET, "change limits"):
            return
        if msg.pid:
            target = ("pid", str(msg.pid))
        elif msg.pod_name:
            target = ("pod", f"{msg.pod_namespace or 'default'}/{msg.pod_name}")
        else:
            conn.send(
                p.Result(p.Status.INVALID, p.MsgType.LIMIT_SET, "name a --pid or a --pod"), seq
            )
            return
        if msg.flags & p.LIMIT_SET_HAS_CORE and not 1 <= msg.core_limit <= 100:
            conn.send(
                p.Result(
                    p.Status.INVALID,
                    p.MsgType.LIMIT_SET,
                    f"core limit {msg.core_limit} is outside 1-100; nothing changed",
                ),
                seq,
            )
            return
        limits = Limits(
            memory_bytes=msg.mem_limit if msg.flags & p.LIMIT_SET_HAS_MEM else None,
            core_percent=msg.core_limit if msg.flags & p.LIMIT_SET_HAS_CORE else None,
        )
        self.dispatch(
            ev.AdminLimitSet(
                target,
                limits,
                clear_memory=bool(msg.flags & p.LIMIT_SET_CLEAR_MEM),
                clear_core=bool(msg.flags & p.LIMIT_SET_CLEAR_CORE),
            )
        )
        matched = self.core.explain(pid=msg.pid or None, pod=None if msg.pid else target[1])
        self._ok(
            conn,
            seq,
            p.MsgType.LIMIT_SET,
            f"limits for {target[0]} {target[1]} updated; {len(matched)} connected client(s)",
        )

    def _on_StatusRequest(self, conn: Connection, msg: Any, seq: int) -> None:  # noqa: N802
        doc = self.core.status(self.now())
        doc.update(self.status_extra())
        conn.send(p.JsonBody(p.MsgType.STATUS_REPLY, doc), seq)

    def _on_JsonBody(self, conn: Connection, msg: p.JsonBody, seq: int) -> None:  # noqa: N802
        if msg.msg_type is not p.MsgType.QUERY or not isinstance(msg.doc, dict):
            conn.send(p.Result(p.Status.INVALID, msg.msg_type, "expected a QUERY object"), seq)
            return
        name = msg.doc.get("query")
        handler = self.queries.get(str(name))
        if handler is None:
            known = ", ".join(sorted(self.queries))
            conn.send(
                p.Result(
                    p.Status.NOT_FOUND, p.MsgType.QUERY, f"unknown query {name!r} (known: {known})"
                ),
                seq,
            )
            return
        conn.send(p.JsonBody(p.MsgType.QUERY_REPLY, handler(msg.doc)), seq)
