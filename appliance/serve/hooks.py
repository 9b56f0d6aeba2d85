"""The hooks' socket (`scheduler.sock`, in the directory pods mount): registration, the lock,
memory, the GPU's view and heartbeats. A field out of range, or a body that does not parse, closes
that hook alone. Registered hooks are kept by client id, so the core's actions reach them
(`send`); one that goes is a `ClientGone` for the core.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.identity import ClientIdentity
from appliance.core.shown import MemoryView
from appliance.host.pidns import pids_seen_by
from appliance.serve.connection import PeerConnection
from appliance.wire import codec
from appliance.wire import protocol as p
from appliance.wire import protocol_view as pv
from appliance.wire.messages import Body

ViewHandler = Callable[[ClientIdentity, str, int], MemoryView]  # (who, GPU uuid, its size)
# Each takes the message of the class it is registered for (`handlers`), which mypy cannot
# say of a dict by class: the one Any left between the frame and the typed message.
Handler = Callable[[PeerConnection, Any, int], None]


class HookSessions:
    """What the hooks' socket does with each message a hook sends, and with the core's actions
    for hooks."""

    def __init__(
        self,
        *,
        dispatch: Callable[[ev.Event], None],
        view: ViewHandler,
        gpus: Callable[[], codec.NodeGpus],
        proc_root: Path,
    ) -> None:
        self._dispatch = dispatch
        self._view = view
        self._gpus = gpus
        self.proc_root = proc_root
        self._clients: dict[int, PeerConnection] = {}  # registered hooks, by client id
        self._ids = itertools.count(1)
        # What each message a hook may send is turned into: greppable, no names built at run time.
        self.handlers: dict[type, Handler] = {
            p.Register: self._on_register,
            **{kind: self._on_hook_message for kind in codec.HOOK_EVENTS},
            p.Heartbeat: on_heartbeat,
            pv.ViewRequest: self._on_view_request,
        }

    def send(self, action: act.HookAction) -> None:
        """An action of the core for a hook, to that hook; one that is gone is skipped."""
        client_id, message, seq = codec.to_hook(action)
        if (conn := self._clients.get(client_id)) is not None:
            conn.send(message, seq)

    def closed(self, conn: PeerConnection) -> None:
        if conn.session.client_id is not None:
            self._clients.pop(conn.session.client_id, None)
            self._dispatch(ev.ClientGone(conn.session.client_id))

    def _claiming(self, conn: PeerConnection, msg: p.Register | pv.ViewRequest) -> ClientIdentity:
        """Who the peer is, from the kernel (at connect); the pod it names is only a hint, which
        the core weighs (`trust.podClaimUids`)."""
        assert conn.session.ident is not None
        return dataclasses.replace(
            conn.session.ident, claimed_namespace=msg.pod_namespace, claimed_pod=msg.pod_name
        )

    def _on_register(self, conn: PeerConnection, msg: p.Register, seq: int) -> None:
        if conn.session.client_id is not None:
            conn.send(p.Result(p.Status.INVALID, p.MsgType.REGISTER, "already registered"), seq)
            return
        problem = codec.hook_problem(msg) or self._gpus().problem(msg.gpu_uuid)
        if problem is not None:
            conn.refuse(p.Result(p.Status.INVALID, p.MsgType.REGISTER, problem), problem, seq)
            return
        ident = self._claiming(conn, msg)
        conn.session.client_id = next(self._ids)
        conn.peer = f"client {conn.session.client_id} (pid {conn.pid}, uid {conn.uid})"
        self._clients[conn.session.client_id] = conn
        self._dispatch(
            ev.ClientRegistered(
                client_id=conn.session.client_id,
                seq=seq,
                ident=ident,
                gpu_uuid=msg.gpu_uuid,
                gpu_total_memory=msg.gpu_total_mem,
                env_memory_bytes=msg.env_mem_limit,
                env_core_percent=msg.env_core_limit,
            )
        )

    def _on_hook_message(self, conn: PeerConnection, msg: Body, seq: int) -> None:
        if conn.session.client_id is None:
            conn.send(p.Result(p.Status.NOT_REGISTERED, msg.TYPE, "send REGISTER first"), seq)
            return
        if (problem := codec.hook_problem(msg)) is not None:
            conn.refuse(p.Result(p.Status.INVALID, msg.TYPE, problem), problem, seq)
            return
        self._dispatch(codec.HOOK_EVENTS[type(msg)](msg, conn.session.client_id, seq))

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


def on_heartbeat(conn: PeerConnection, msg: p.Heartbeat, seq: int) -> None:
    # Liveness only: the hook treats a daemon that stops answering as gone.
    conn.send(p.HeartbeatAck(), seq)
