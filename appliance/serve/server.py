"""The daemon's two Unix sockets: frames from hooks and nvsharectl in, the core's actions out.

One class per socket role says what its messages become: `hooks.HookSessions` for
`scheduler.sock` (in the directory pods mount: hooks only) and `control.ControlSessions` for
`control.sock` (in a directory of its own, never mounted into pods: nvsharectl). This module is
what both share: the sockets claimed, connections accepted and swept, frames decoded and handed
to the role's handler, actions routed back (`send`).

It only translates: each connection (`connection.PeerConnection`, which keeps every per-peer
I/O bound) hands complete frames here; they become core events for `dispatch` (the engine),
and the engine routes the core's actions for peers back to `send`. It knows nothing of pods,
policy or NVML. Actions are written without awaiting the peer, so a slow or stuck reader never
stalls anyone else. Garbage (a bad magic, an oversized frame) closes that one connection after
an ERROR frame; an unknown type or version is answered with an ERROR frame and the connection
stays up; a message of the other socket's role is refused, naming the socket it belongs on.
Every request gets an answer, even one that meets a bug here (logged with its traceback,
answered with an ERROR). Replies larger than a frame are streamed as JSON_PART frames.

Who may connect at all, and how many, is `admission`; the sockets are claimed through
`socket_claim`: one daemon per socket directory, in directories that are its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pwd
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import views
from appliance.host.peer import identify
from appliance.policy.model import ConnectionSettings
from appliance.serve.accept import Acceptor, Role
from appliance.serve.admission import FILES_IN_RESERVE, Admission
from appliance.serve.connection import Bounds, Budget, PeerConnection, Turns
from appliance.serve.control import ControlSessions, QueryHandler
from appliance.serve.hooks import Handler, HookSessions, ViewHandler
from appliance.serve.socket_claim import SocketClaim, claim_sockets
from appliance.wire import codec, framing, socket_dirs
from appliance.wire import protocol as p

log = logging.getLogger("nvshare.server")

SWEEP_S = 1.0


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
        turns: Turns | None = None,
    ) -> None:
        """`turns`: how connections take turns (`Turns`; a test gives one whose clock counts
        turns, so a pass of the loop handles a known number of frames)."""
        self.socket_dir = socket_dir
        self.control_dir = control_dir
        self.proc_root = proc_root
        self.hooks = HookSessions(dispatch=dispatch, view=view, gpus=gpus, proc_root=proc_root)
        self.control = ControlSessions(
            dispatch=dispatch,
            status=status,
            queries=queries,
            generation=generation,
            status_document=status_document,
        )
        self.admission = Admission(total=max(16, open_files - FILES_IN_RESERVE), caps=caps)
        self._budget = Budget()
        self._turns = turns or Turns()  # every connection's frames take turns here
        self._connections: dict[int, PeerConnection] = {}  # every open one, by its number
        self._claim: SocketClaim | None = None
        self._numbers = itertools.count(1)
        self._acceptor = Acceptor(self.admission, self._factory, proc_root=proc_root)
        self._sweeper: asyncio.TimerHandle | None = None
        self._handlers: dict[Role, dict[type, Handler]] = {
            Role.HOOK: self.hooks.handlers,
            Role.CONTROL: self.control.handlers,
        }

    # The actions this server turns into frames (`send`).
    ACTIONS: tuple[type, ...] = (*act.HOOK_ACTIONS, act.Reply)

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

    def send(self, action: act.HookAction | act.Reply) -> None:
        """An action of the core, to the peer it names; one that is gone is skipped."""
        if isinstance(action, act.Reply):
            self.reply(action)
        else:
            self.hooks.send(action)

    def reply(self, action: act.Reply) -> None:
        """The answer to a control request, to the connection that asked (if still open)."""
        if (conn := self._connections.get(action.to.connection)) is not None:
            self.control.reply(conn, action)

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
        conn.session.ident = identify(conn.pid, conn.uid, conn.gid, proc_root=self.proc_root)
        self._connections[conn.number] = conn
        return True

    def _closed(self, conn: PeerConnection) -> None:
        if self._connections.pop(conn.number, None) is not None and conn.admission_key:
            self.admission.release(conn.admission_key)
        self.hooks.closed(conn)

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


def _who(pid: int, uid: int) -> str:
    """How logs name a peer: its pid, uid and user."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"pid {pid} (uid {uid})"
    return f"pid {pid} (uid {uid}, {user})"
