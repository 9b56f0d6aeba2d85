"""The daemon's two Unix sockets: frames from hooks and nvsharectl in, the core's actions out.

- `scheduler.sock`, in the directory pods mount: hooks only (REGISTER, the lock, memory,
  heartbeats). A field out of range, or a body that does not parse, closes that hook alone.
- `control.sock`, in a directory of its own that is never mounted into pods: nvsharectl's
  status, questions and state changes. Whether the asker may change state is the core's
  decision (`core.authority`), from who the kernel says it is.

It only translates: each connection (`connection.PeerConnection`, which keeps every per-peer
I/O bound) hands complete frames here; they become core events for `dispatch` (the engine),
and the engine routes the core's actions for peers back to `send`. It knows nothing of pods,
policy or NVML. Actions are written without awaiting the peer, so a slow or stuck reader never
stalls anyone else. Garbage (a bad magic, an oversized frame) closes that one connection after
an ERROR frame; an unknown type or version is answered with an ERROR frame and the connection
stays up. Every request gets an answer, even one that meets a bug here (logged with its
traceback, answered with an ERROR). Status is encoded once and shared by every request until
something changes (or for at most `STATUS_REUSE_S`), so a flood of status requests costs one
encoding, not one each. Replies larger than a frame are streamed as JSON_PART frames.

Who may connect at all, and how many, is `admission`; the sockets are claimed through
`socket_claim`: one daemon per socket directory, in directories that are its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import pwd
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import views
from appliance.core.identity import ClientIdentity
from appliance.core.shown import MemoryView
from appliance.host.peer import identify
from appliance.host.pidns import pids_seen_by
from appliance.policy.model import ConnectionSettings
from appliance.serve.accept import Acceptor, Role
from appliance.serve.admission import FILES_IN_RESERVE, Admission
from appliance.serve.connection import Bounds, Budget, PeerConnection, Turns
from appliance.serve.socket_claim import SocketClaim, claim_sockets
from appliance.wire import codec, framing, socket_dirs
from appliance.wire import protocol as p
from appliance.wire import protocol_view as pv

log = logging.getLogger("nvshare.server")

STATUS_REUSE_S = 0.1
SWEEP_S = 1.0

QueryHandler = Callable[[Mapping[str, Any]], Any]  # a request -> a view; raises QueryError
ViewHandler = Callable[[ClientIdentity, str, int], MemoryView]  # (who, GPU uuid, its size)
Handler = Callable[[PeerConnection, Any, int], None]


BOUNDS = {Role.HOOK: Bounds(max_body=512), Role.CONTROL: Bounds(max_body=64 << 10)}


class SchedulerServer:
    """Frames in, events out (to `dispatch`); actions in (`send`), frames out."""

    def __init__(
        self,
        *,
        socket_dir: Path,
        control_dir: Path,
        dispatch: Callable[[ev.Event], None],
        status: Callable[[], views.StatusView],
        queries: Mapping[str, QueryHandler],
        view: ViewHandler,
        generation: Callable[[], int] = lambda: 0,
        status_document: Callable[[], Iterator[bytes | None]] | None = None,
        caps: Callable[[], ConnectionSettings] = ConnectionSettings,
        open_files: int = 1024,
        proc_root: Path = Path("/proc"),
        gpus: Callable[[], codec.NodeGpus] = codec.NodeGpus,
    ) -> None:
        self.socket_dir = socket_dir
        self._gpus = gpus
        self.control_dir = control_dir
        self.proc_root = proc_root
        self._dispatch = dispatch
        self._status = status
        self._generation = generation
        self.queries = queries
        self._view = view
        self.admission = Admission(total=max(16, open_files - FILES_IN_RESERVE), caps=caps)
        self._budget = Budget()
        self._turns = Turns()  # every connection's frames take turns here
        self._clients: dict[int, PeerConnection] = {}  # registered hooks, by client id
        self._connections: dict[int, PeerConnection] = {}  # every open one, by its number
        self._claim: SocketClaim | None = None
        self._ids = itertools.count(1)
        self._numbers = itertools.count(1)
        self._acceptor = Acceptor(self.admission, self._factory, proc_root=proc_root)
        self._sweeper: asyncio.TimerHandle | None = None
        self._status_cache: tuple[int, float, bytes] | None = None
        self._status_document = status_document  # built a slice at a time, if given
        self._status_build: tuple[int, float, Iterator[bytes | None]] | None = None
        self._status_asked: list[tuple[PeerConnection, int]] = []
        # What each message a peer may send is turned into: greppable, no names built at run time.
        self._handlers: dict[Role, dict[type, Handler]] = {
            Role.HOOK: {
                p.Register: self._on_register,
                **{kind: self._on_hook_message for kind in codec.HOOK_EVENTS},
                p.Heartbeat: self._on_heartbeat,
                pv.ViewRequest: self._on_view_request,
            },
            Role.CONTROL: {
                **{kind: self._on_control for kind in codec.CONTROL},
                p.StatusRequest: self._on_status_request,
                p.JsonBody: self._on_query,
                p.Heartbeat: self._on_heartbeat,
            },
        }

    # The actions this server turns into frames (`send`).
    ACTIONS: tuple[type, ...] = (*codec.TO_HOOKS, act.Reply)

    @property
    def path(self) -> Path:
        return self.socket_dir / socket_dirs.SOCKET_NAME

    @property
    def control_path(self) -> Path:
        return self.control_dir / socket_dirs.CONTROL_SOCKET_NAME

    async def start(self) -> None:
        """Claim the sockets and serve; raises `SocketUnavailable` saying why it cannot."""
        self._claim = claim_sockets(self.socket_dir, self.control_dir)
        loop = asyncio.get_running_loop()
        try:
            for role, bound in ((Role.HOOK, self._claim.hook), (Role.CONTROL, self._claim.control)):
                self._acceptor.listen(role, bound.sock)
        except BaseException:
            self._claim.release()
            raise
        self._sweeper = loop.call_later(SWEEP_S, self._sweep)
        log.info("listening on %s (hooks) and %s (nvsharectl)", self.path, self.control_path)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._acceptor.close()
        for conn in list(self._connections.values()):  # registered or not: nobody waits
            conn.close()
        await asyncio.sleep(0)  # their transports close on the loop's next turn
        if self._claim is not None:
            self._claim.release()  # only if the sockets at the paths are still ours
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

    def _factory(self, role: Role, key: tuple[str, str]) -> Callable[[], PeerConnection]:
        def make() -> PeerConnection:
            conn = PeerConnection(
                role=role,
                bounds=BOUNDS[role],
                budget=self._budget,
                number=next(self._numbers),
                on_open=self._opened,
                on_frame=self._on_frame,
                on_close=self._closed,
                turns=self._turns,
            )
            conn.admission_key = key  # admitted (`Acceptor`): released when it closes
            return conn

        return make

    def _opened(self, conn: PeerConnection) -> bool:
        """Who it is: the kernel's word, read again now that it is admitted."""
        conn.peer = _who(conn.pid, conn.uid)
        conn.ident = identify(conn.pid, conn.uid, conn.gid, proc_root=self.proc_root)
        self._connections[conn.number] = conn
        return True

    def _closed(self, conn: PeerConnection) -> None:
        if self._connections.pop(conn.number, None) is not None and conn.admission_key:
            self.admission.release(conn.admission_key)
        if conn.client_id is not None:
            self._clients.pop(conn.client_id, None)
            self._dispatch(ev.ClientGone(conn.client_id))

    def _sweep(self) -> None:
        """Close connections that began a frame (or their first) and did not finish it."""
        now = asyncio.get_running_loop().time()
        for conn in list(self._connections.values()):
            if conn.overdue(now):
                self.admission.notes.warn(
                    "read deadline",
                    "%s sent no complete frame within the read deadline; closing it",
                    conn.peer,
                )
                conn.abort()
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _on_frame(self, conn: PeerConnection, frame: framing.Frame) -> None:
        """Handle one frame; whatever happens, the peer gets an answer and the loop goes on."""
        try:
            self._handle_frame(conn, frame)
        except Exception as exc:  # a bug of ours: say so to the peer and in the log, go on
            log.exception("handling a frame of type %d from %s failed", frame.msg_type, conn.peer)
            conn.send(
                p.Result(p.Status.INVALID, frame.msg_type, f"the scheduler failed: {exc!r}"),
                frame.seq,
            )

    def _handle_frame(self, conn: PeerConnection, frame: framing.Frame) -> None:
        role: Role = conn.role
        try:
            msg = framing.decode_body(frame)
        except framing.ProtocolError as exc:
            answer = p.Result(exc.status, exc.ref_type, str(exc))
            if role is Role.HOOK and exc.status is p.Status.BAD_BODY:
                conn.refuse(answer, f"sent a malformed frame ({exc})", frame.seq)
            else:
                conn.send(answer, frame.seq)
            return
        handler = self._handlers[role].get(type(msg))
        if handler is not None:
            handler(conn, msg, frame.seq)
            return
        other = Role.CONTROL if role is Role.HOOK else Role.HOOK
        name = p.MsgType(frame.msg_type).name
        if type(msg) in self._handlers[other]:
            where = self.control_path if other is Role.CONTROL else self.path
            problem = f"{name} is not accepted on the {role.value}; it belongs on {where}"
            conn.send(p.Result(p.Status.PERMISSION, frame.msg_type, problem), frame.seq)
            return
        problem = f"{name} is not accepted by the daemon"
        conn.send(p.Result(p.Status.UNKNOWN_TYPE, frame.msg_type, problem), frame.seq)

    # hooks

    def _claiming(self, conn: PeerConnection, msg: p.Register | pv.ViewRequest) -> ClientIdentity:
        """Who the peer is, from the kernel (at connect); the pod it names is only a hint, which
        the core weighs (`trust.podClaimUids`)."""
        assert conn.ident is not None
        return dataclasses.replace(
            conn.ident, claimed_namespace=msg.pod_namespace, claimed_pod=msg.pod_name
        )

    def _on_register(self, conn: PeerConnection, msg: p.Register, seq: int) -> None:
        if conn.client_id is not None:
            conn.send(p.Result(p.Status.INVALID, p.MsgType.REGISTER, "already registered"), seq)
            return
        problem = codec.hook_problem(msg) or self._gpus().problem(msg.gpu_uuid)
        if problem is not None:
            conn.refuse(p.Result(p.Status.INVALID, p.MsgType.REGISTER, problem), problem, seq)
            return
        ident = self._claiming(conn, msg)
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

    def _on_hook_message(self, conn: PeerConnection, msg: Any, seq: int) -> None:
        if conn.client_id is None:
            conn.send(p.Result(p.Status.NOT_REGISTERED, msg.TYPE, "send REGISTER first"), seq)
            return
        if (problem := codec.hook_problem(msg)) is not None:
            conn.refuse(p.Result(p.Status.INVALID, msg.TYPE, problem), problem, seq)
            return
        self._dispatch(codec.HOOK_EVENTS[type(msg)](msg, conn.client_id, seq))

    def _on_view_request(self, conn: PeerConnection, msg: pv.ViewRequest, seq: int) -> None:
        """How a GPU looks to the asker, registered or not (nvidia-smi never registers), with
        the PIDs of its pod's processes as its own PID namespace numbers them."""
        if (problem := codec.hook_problem(msg)) is not None:
            conn.refuse(p.Result(p.Status.INVALID, msg.TYPE, problem), problem, seq)
            return
        view = self._view(self._claiming(conn, msg), msg.gpu_uuid, msg.gpu_total_mem)
        seen = pids_seen_by(conn.pid, [h.pid for h in view.processes], proc_root=self.proc_root)
        listed = tuple(
            pv.ViewProcess(seen[h.pid], pv.VIEW_SELF if h.asker else 0, h.used)
            for h in view.processes
            if h.pid in seen
        )
        reply = pv.View(
            mem_limit=view.limit or 0,
            used=view.used,
            processes=listed,
            unlisted=len(view.processes) - len(listed),
        )
        conn.send(reply, seq)

    def _on_heartbeat(self, conn: PeerConnection, msg: Any, seq: int) -> None:
        # Liveness only: the hook treats a daemon that stops answering as gone.
        conn.send(p.HeartbeatAck(), seq)

    # nvsharectl

    def _on_control(self, conn: PeerConnection, msg: Any, seq: int) -> None:
        conn.asked[seq] = msg.TYPE  # the reply names the request it answers
        asker = ev.Requester(conn.number, seq, conn.ident)
        self._dispatch(codec.CONTROL[type(msg)](msg, conn.peer, asker))

    def _on_status_request(self, conn: PeerConnection, msg: Any, seq: int) -> None:
        if self._status_document is None or self._fresh_status() is not None:
            body = self._status_body()
            conn.send_raw(framing.encode_body(p.MsgType.STATUS_REPLY, body, seq=seq))
            return
        self._status_asked.append((conn, seq))  # answered when the document is built
        if self._status_build is None:
            loop = asyncio.get_running_loop()
            self._status_build = (self._generation(), loop.time(), self._status_document())
            loop.call_soon(self._build_status)

    def _build_status(self) -> None:
        """A slice of the status document; again on the next pass of the loop until done."""
        assert self._status_build is not None
        generation, started, steps = self._status_build
        body = next(steps)
        if body is None:
            asyncio.get_running_loop().call_soon(self._build_status)
            return
        self._status_build = None
        self._status_cache = (generation, started, body)
        asked, self._status_asked = self._status_asked, []
        for conn, seq in asked:
            if not conn.closed:
                conn.send_raw(framing.encode_body(p.MsgType.STATUS_REPLY, body, seq=seq))

    def _fresh_status(self) -> bytes | None:
        now, cached = asyncio.get_running_loop().time(), self._status_cache
        if (
            cached is not None
            and cached[0] == self._generation()
            and now - cached[1] < STATUS_REUSE_S
        ):
            return cached[2]
        return None

    def _status_body(self) -> bytes:
        """The status document, encoded once for every request until the core changes."""
        now, generation = asyncio.get_running_loop().time(), self._generation()
        cached = self._status_cache
        if cached is not None and cached[0] == generation and now - cached[1] < STATUS_REUSE_S:
            return cached[2]
        body = json.dumps(views.to_json(self._status()), sort_keys=True).encode("utf-8")
        self._status_cache = (generation, now, body)
        return body

    def _on_query(self, conn: PeerConnection, msg: p.JsonBody, seq: int) -> None:
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
        reply = p.JsonBody(p.MsgType.QUERY_REPLY, views.to_json(answer))
        conn.send_raw(framing.encode(reply, seq=seq))


def _who(pid: int, uid: int) -> str:
    """How logs name a peer: its pid, uid and user."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"pid {pid} (uid {uid})"
    return f"pid {pid} (uid {uid}, {user})"
