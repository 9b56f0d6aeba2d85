"""The control socket (`control.sock`, in a directory of its own never mounted into pods):
nvsharectl's status, questions and state changes. Whether the asker may change state is the
core's decision (`core.authority`), from who the kernel says it is. Status is encoded once and
shared by every request until something changes (or for at most `STATUS_REUSE_S`), so a flood of
status requests costs one encoding, not one each.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import views
from appliance.serve.connection import PeerConnection
from appliance.serve.hooks import Handler, on_heartbeat
from appliance.wire import codec, framing
from appliance.wire import protocol as p

STATUS_REUSE_S = 0.1

QueryHandler = Callable[[Mapping[str, Any]], Any]  # a request -> a view; raises QueryError


class ControlSessions:
    """What the control socket does with each message nvsharectl sends, and with the core's
    replies to it."""

    def __init__(
        self,
        *,
        dispatch: Callable[[ev.Event], None],
        status: Callable[[], views.StatusView],
        queries: Mapping[str, QueryHandler],
        generation: Callable[[], int],
        status_document: Callable[[], Iterator[bytes | None]] | None,
    ) -> None:
        self._dispatch = dispatch
        self._status = status
        self.queries = queries
        self._generation = generation
        self._status_cache: tuple[int, float, bytes] | None = None
        self._status_document = status_document  # built a slice at a time, if given
        self._status_build: tuple[int, float, Iterator[bytes | None]] | None = None
        self._status_asked: list[tuple[PeerConnection, int]] = []
        self.handlers: dict[type, Handler] = {
            **{kind: self._on_control for kind in codec.CONTROL},
            p.StatusRequest: self._on_status_request,
            p.JsonBody: self._on_query,
            p.Heartbeat: on_heartbeat,
        }

    @staticmethod
    def reply(conn: PeerConnection, action: act.Reply) -> None:
        """The core's answer to a request, naming the request it answers."""
        ref = conn.session.asked.pop(action.to.seq, 0)
        conn.send(codec.result(action, ref), action.to.seq)

    def _on_control(self, conn: PeerConnection, msg: codec.ControlMessage, seq: int) -> None:
        conn.session.asked[seq] = msg.TYPE  # the reply names the request it answers
        asker = ev.Requester(conn.number, seq, conn.session.ident)
        self._dispatch(codec.control_event(msg, conn.peer, asker))

    def _on_status_request(self, conn: PeerConnection, msg: p.StatusRequest, seq: int) -> None:
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
        for conn, seq in asked:  # each on a pass of its own: framing megabytes takes ms
            asyncio.get_running_loop().call_soon(self._send_status, conn, seq, body)

    @staticmethod
    def _send_status(conn: PeerConnection, seq: int, body: bytes) -> None:
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
