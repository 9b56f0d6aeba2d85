"""The asyncio Unix-socket server: frames from hooks and nvsharectl in, the core's actions out.

It only translates: one task per connection reads frames and turns them into core events for
`dispatch` (the engine); the engine routes the core's actions for peers back to `send`. It knows
nothing of pods, policy or NVML. Actions are written without awaiting the peer, so a slow or
stuck reader never stalls anyone else: its transport buffer is bounded and the connection is
dropped when it overflows. Garbage (a bad magic, an oversized frame) closes that one connection
after an ERROR frame; an unknown type or version, a malformed body or a query with bad arguments
is answered with an ERROR frame and the connection stays up. Every request gets an answer, even
one that meets a bug here (logged with its traceback, answered with an ERROR). Replies larger
than a frame (status with thousands of clients) are streamed as JSON_PART frames.

The socket is claimed through `appliance.socket_claim`: one daemon per socket directory.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pwd
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import codec, framing
from appliance import protocol as p
from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import views
from appliance.core.identity import ClientIdentity
from appliance.core.shown import MemoryView
from appliance.host.peer import identify, is_admin, peer_credentials
from appliance.host.pidns import pids_seen_by
from appliance.socket_claim import SocketClaim, claim_socket

log = logging.getLogger("nvshare.server")

MAX_WRITE_BUFFER = 1 << 20

QueryHandler = Callable[[Mapping[str, Any]], Any]  # a request -> a view; raises QueryError
ViewHandler = Callable[[ClientIdentity, str, int], MemoryView]  # (who, GPU uuid, its size)


@dataclass(slots=True, eq=False)  # compared and hashed by identity: kept in a set
class Connection:
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    number: int  # for replies to control requests
    client_id: int | None = None  # once registered as a hook
    asked: dict[int, int] = field(default_factory=dict)  # seq -> type of a pending request
    closed: bool = False
    peer: str = field(default="")
    flush: bool = False  # a large reply was written: let it drain before reading on

    def send(self, message: Any, seq: int = 0) -> bool:
        if self.closed:
            return False
        transport = self.writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("%s is not reading its socket; disconnecting it", self.peer)
            self.closed = True
            transport.abort()  # close() would wait to flush what it never reads
            return False
        self.writer.write(framing.encode(message, seq=seq))
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class SchedulerServer:
    """Frames in, events out (to `dispatch`); actions in (`send`), frames out."""

    def __init__(
        self,
        *,
        socket_dir: Path,
        dispatch: Callable[[ev.Event], None],
        status: Callable[[], views.StatusView],
        queries: Mapping[str, QueryHandler],
        view: ViewHandler,
        proc_root: Path = Path("/proc"),
        admin_group: str | None = None,
    ) -> None:
        self.socket_dir = socket_dir
        self.proc_root = proc_root
        self.admin_group = admin_group
        self._dispatch = dispatch
        self._status = status
        self.queries = queries
        self._view = view
        self._clients: dict[int, Connection] = {}  # registered hooks, by client id
        self._connections: dict[int, Connection] = {}  # every open one, by its number
        self._claim: SocketClaim | None = None
        self._ids = itertools.count(1)
        self._numbers = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # What each message a peer may send is turned into: greppable, no names built at run time.
        self._handlers: dict[type, Callable[[Connection, Any, int], None]] = {
            p.Register: self._on_register,
            **{kind: self._on_hook_message for kind in codec.HOOK_EVENTS},
            p.Heartbeat: self._on_heartbeat,
            p.ViewRequest: self._on_view_request,
            **{kind: self._on_control for kind in codec.CONTROL},
            p.StatusRequest: self._on_status_request,
            p.JsonBody: self._on_query,
        }

    # The actions this server turns into frames (`send`).
    ACTIONS: tuple[type, ...] = (*codec.TO_HOOKS, act.Reply)

    @property
    def path(self) -> Path:
        return self.socket_dir / p.SOCKET_NAME

    async def start(self) -> None:
        """Claim the socket and serve; raises `SocketUnavailable` saying why it cannot."""
        self._claim = claim_socket(self.socket_dir)
        try:
            self._server = await asyncio.start_unix_server(self._serve, sock=self._claim.sock)
        except BaseException:
            self._claim.release()
            raise
        log.info("listening on %s", self.path)

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            for conn in list(self._connections.values()):  # registered or not: nobody waits
                conn.close()
            if self._tasks:  # let every connection task see its EOF and finish
                await asyncio.wait(self._tasks, timeout=5)
            await self._server.wait_closed()
        if self._claim is not None:
            self._claim.release()  # only if the socket at the path is still ours
            self._claim = None

    def send(self, action: act.Action) -> None:
        """An action of the core, to the peer it names; one that is gone is skipped."""
        if isinstance(action, act.Reply):
            conn = self._connections.get(action.to.connection)
            if conn is not None:
                ref = conn.asked.pop(action.to.seq, 0)
                conn.send(codec.result(action, ref), action.to.seq)
            return
        client_id, message, seq = codec.TO_HOOKS[type(action)](action)
        if (conn := self._clients.get(client_id)) is not None:
            conn.send(message, seq)

    # ----------------------------------------------------------------- connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        sock: socket.socket = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        conn = Connection(
            writer=writer,
            pid=pid,
            uid=uid,
            gid=gid,
            number=next(self._numbers),
            peer=_who(pid, uid),
        )
        self._connections[conn.number] = conn
        decoder = framing.FrameDecoder()
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                try:
                    items = decoder.feed(data)
                except framing.ProtocolError as exc:
                    log.warning("%s sent garbage (%s); closing its connection", conn.peer, exc)
                    conn.send(p.Result(exc.status, exc.ref_type, str(exc)))
                    break
                for item in items:
                    if isinstance(item, framing.ProtocolError):
                        conn.send(p.Result(item.status, item.ref_type, str(item)))
                        continue
                    self._on_frame(conn, item)
                if conn.flush:
                    conn.flush = False
                    await writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection error: %s", conn.peer, exc)
        finally:
            conn.close()
            self._connections.pop(conn.number, None)
            if conn.client_id is not None:
                self._clients.pop(conn.client_id, None)
                self._dispatch(ev.ClientGone(conn.client_id))

    def _on_frame(self, conn: Connection, frame: framing.Frame) -> None:
        """Handle one frame; whatever happens, the peer gets an answer and the loop goes on."""
        try:
            self._handle_frame(conn, frame)
        except Exception as exc:  # a bug of ours: say so to the peer and in the log, go on
            log.exception("handling a frame of type %d from %s failed", frame.msg_type, conn.peer)
            conn.send(
                p.Result(p.Status.INVALID, frame.msg_type, f"the scheduler failed: {exc!r}"),
                frame.seq,
            )

    def _handle_frame(self, conn: Connection, frame: framing.Frame) -> None:
        try:
            msg = framing.decode_body(frame)
        except framing.ProtocolError as exc:
            conn.send(p.Result(exc.status, exc.ref_type, str(exc)), frame.seq)
            return
        handler = self._handlers.get(type(msg))
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

    def _identify(self, conn: Connection, msg: p.Register | p.ViewRequest) -> ClientIdentity:
        """Who the peer is, from the kernel; the pod it names is only a flagged hint."""
        return identify(
            conn.pid,
            conn.uid,
            conn.gid,
            proc_root=self.proc_root,
            claimed_namespace=msg.pod_namespace,
            claimed_pod=msg.pod_name,
        )

    def _on_register(self, conn: Connection, msg: p.Register, seq: int) -> None:
        if conn.client_id is not None:
            conn.send(p.Result(p.Status.INVALID, p.MsgType.REGISTER, "already registered"), seq)
            return
        ident = self._identify(conn, msg)
        conn.client_id = next(self._ids)
        conn.peer = f"client {conn.client_id} (pid {conn.pid}, uid {conn.uid})"
        self._clients[conn.client_id] = conn
        self._dispatch(
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

    def _on_hook_message(self, conn: Connection, msg: Any, seq: int) -> None:
        if (cid := self._need_client(conn, seq, msg.TYPE)) is not None:
            self._dispatch(codec.HOOK_EVENTS[type(msg)](msg, cid, seq))

    def _on_view_request(self, conn: Connection, msg: p.ViewRequest, seq: int) -> None:
        """How a GPU looks to the asker, registered or not (nvidia-smi never registers), with
        the PIDs of its pod's processes as its own PID namespace numbers them."""
        ident = self._identify(conn, msg)
        view = self._view(ident, msg.gpu_uuid, msg.gpu_total_mem)
        seen = pids_seen_by(conn.pid, [h.pid for h in view.processes], proc_root=self.proc_root)
        listed = tuple(
            p.ViewProcess(seen[h.pid], p.VIEW_SELF if h.asker else 0, h.used)
            for h in view.processes
            if h.pid in seen
        )
        reply = p.View(
            mem_limit=view.limit or 0,
            used=view.used,
            processes=listed,
            unlisted=len(view.processes) - len(listed),
        )
        conn.send(reply, seq)

    def _on_heartbeat(self, conn: Connection, msg: Any, seq: int) -> None:
        # Liveness only: the hook treats a daemon that stops answering as gone.
        conn.send(p.HeartbeatAck(), seq)

    # nvsharectl

    def _on_control(self, conn: Connection, msg: Any, seq: int) -> None:
        control = codec.CONTROL[type(msg)]
        if not self._need_admin(conn, seq, msg.TYPE, control.what):
            return
        conn.asked[seq] = msg.TYPE  # the reply names the request it answers
        self._dispatch(control.event(msg, conn.peer, ev.Requester(conn.number, seq)))

    def _on_status_request(self, conn: Connection, msg: Any, seq: int) -> None:
        status = views.to_json(self._status())
        self._send_document(conn, p.JsonBody(p.MsgType.STATUS_REPLY, status), seq)

    def _on_query(self, conn: Connection, msg: p.JsonBody, seq: int) -> None:
        if msg.msg_type is not p.MsgType.QUERY or not isinstance(msg.doc, dict):
            conn.send(p.Result(p.Status.INVALID, msg.msg_type, "expected a QUERY object"), seq)
            return
        name = msg.doc.get("query")
        handler = self.queries.get(name) if isinstance(name, str) else None
        if handler is None:
            known = ", ".join(sorted(self.queries))
            problem = f"unknown query {str(name)[:60]!r} (known: {known})"
            conn.send(p.Result(p.Status.NOT_FOUND, p.MsgType.QUERY, problem), seq)
            return
        try:
            answer = handler(msg.doc)
        except views.QueryError as exc:
            conn.send(p.Result(p.Status.INVALID, p.MsgType.QUERY, str(exc)), seq)
            return
        self._send_document(conn, p.JsonBody(p.MsgType.QUERY_REPLY, views.to_json(answer)), seq)

    def _send_document(self, conn: Connection, reply: p.JsonBody, seq: int) -> None:
        """A JSON reply of any size up to MAX_DOCUMENT, streamed in frames."""
        if conn.closed:
            return
        conn.writer.write(framing.encode(reply, seq=seq))
        conn.flush = True


def _who(pid: int, uid: int) -> str:
    """How logs name a peer: its pid, uid and user."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"pid {pid} (uid {uid})"
    return f"pid {pid} (uid {uid}, {user})"
