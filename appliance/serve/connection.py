"""One peer of the daemon's sockets, with every I/O bound the daemon keeps per connection.

No peer can make the daemon hold much for it or wait on it:
- bytes read but not yet handled are capped per connection (a frame's body is at most
  `Bounds.max_body`: hooks' frames are a few hundred bytes, nvsharectl's questions small) and
  in total across connections (`TOTAL_BUFFERED`); past either, that connection is closed;
- a frame begun must be complete within `READ_DEADLINE_S`, and a connection must send its first
  frame within the same time, or it is closed (a parked partial frame holds nothing for long);
- at most `FRAMES_PER_TURN` frames of one connection are handled before every other connection
  has had its turn, so a flood of requests delays nobody else by more than a few frames' work;
- turns are taken across connections a time slice (`TURN_SLICE_S`) per pass of the event loop
  (`Turns`), so the loop reads again between slices; heartbeats are answered as they are read
  and a registration goes before every other turn, so no scheduling work delays either by more
  than a slice (thousands of hooks asking for the lock at once included);
- a peer that does not read what it is sent is not served: reading from it pauses while its
  send buffer is above the transport's high-water mark, and one over `MAX_WRITE_BUFFER` is
  dropped.

It reads with `asyncio.BufferedProtocol` into one shared scratch buffer, so an idle connection
costs no read buffer at all. What a frame means is the server's business (`on_frame`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from appliance.host.peer import peer_credentials
from appliance.serve.admission import EveryMinute
from appliance.serve.session import Session
from appliance.wire import framing
from appliance.wire import protocol as p
from appliance.wire.messages import Message

log = logging.getLogger("nvshare.server")

READ_DEADLINE_S = 5.0
FRAMES_PER_TURN = 8
TURN_SLICE_S = 0.002  # turns taken in one pass of the event loop, before it reads again
MAX_WRITE_BUFFER = 1 << 20
TOTAL_BUFFERED = 32 << 20
# Every read lands here first, and is handled before the next read. Small: what one read makes
# the daemon decode stays small, so a loop iteration that reads from hundreds of flooding peers
# still ends soon.
_SCRATCH = bytearray(4096)
_SCRATCH_VIEW = memoryview(_SCRATCH)  # made once: a read that fits takes it whole
_OTHER_RELEASES = EveryMinute()  # peers speaking another protocol version: a line a minute


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one connection of a socket may send: the largest frame body it may use."""

    max_body: int

    @property
    def max_buffered(self) -> int:
        # one whole frame, and one read's worth behind it
        return p.HEADER.size + self.max_body + len(_SCRATCH)


class Budget:
    """Bytes read and not yet handled, across every connection."""

    def __init__(self, total: int = TOTAL_BUFFERED) -> None:
        self.total = total
        self.used = 0


class Turns:
    """Whose frames are handled next, across every connection, a slice of time per pass of the
    event loop: a connection with frames to handle has them handled at once while this pass has
    time left and nobody waits; otherwise it stops being read and waits its turn here. Turns go
    round the tenants (`PeerConnection.tenant`: a pod, or a user outside pods), a turn each, and
    within a tenant first come first served, so a tenant's share of the daemon's time does not
    grow with its connections (the per-uid budget: a flood of cheap messages from 200
    connections of one user waits for the other tenants' turns); a registration goes ahead of
    everything. Between slices the loop reads again, and answers the heartbeats it reads
    (`PeerConnection.buffer_updated`).

    What turns cost is forgotten at the start of a pass only once it reaches half a slice;
    until then it carries over, so a pass takes at least half a slice and at most a slice of
    turns before the loop reads again. A hop of the loop to mark every pass (a callback queued
    for the next) cost about as much as the rest of a hand-off's frame handling together."""

    def __init__(
        self, *, slice_s: float = TURN_SLICE_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._slice_s = slice_s
        self._clock = clock
        self._waiting: OrderedDict[object, deque[PeerConnection]] = OrderedDict()  # by tenant
        self._registering: deque[PeerConnection] = deque()
        self._spent = 0.0  # on turns in this pass of the loop
        self._pass_marked = False
        self._running = False

    def serve(self, conn: PeerConnection) -> None:
        """conn has frames to handle: now, or in its turn."""
        if conn.turn_waiting:
            return
        if self._waiting or self._registering or self._spent >= self._slice_s:
            self.wait(conn)
        else:
            self._timed(conn)

    def wait(self, conn: PeerConnection) -> None:
        conn.turn_waiting = True
        if conn.transport is not None:
            conn.transport.pause_reading()
        if conn.registering:
            self._registering.append(conn)
        else:
            self._waiting.setdefault(conn.tenant, deque()).append(conn)
        if not self._running:
            self._running = True
            asyncio.get_running_loop().call_soon(self._run)

    def _timed(self, conn: PeerConnection) -> None:
        start = self._clock()
        conn.serve_turn()
        self._spent += self._clock() - start
        if self._spent >= self._slice_s / 2 and not self._pass_marked:
            self._pass_marked = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_tenant(self) -> PeerConnection:
        """The first waiting connection of the tenant whose turn it is; the tenant goes round
        to the back."""
        tenant, conns = self._waiting.popitem(last=False)
        conn = conns.popleft()
        if conns:
            self._waiting[tenant] = conns
        return conn

    def _next_pass(self) -> None:
        self._spent, self._pass_marked = 0.0, False

    def _run(self) -> None:
        self._running = False
        self._spent = 0.0
        while (self._registering or self._waiting) and self._spent < self._slice_s:
            conn = self._registering.popleft() if self._registering else self._next_tenant()
            conn.turn_waiting = False
            if not conn.closed:
                self._timed(conn)
        if (self._registering or self._waiting) and not self._running:
            self._running = True
            asyncio.get_running_loop().call_soon(self._run)


class PeerConnection(asyncio.BufferedProtocol):
    def __init__(
        self,
        *,
        role: Any,
        bounds: Bounds,
        budget: Budget,
        number: int,
        on_open: Callable[[PeerConnection], bool],
        on_frame: Callable[[PeerConnection, framing.Frame], None],
        on_close: Callable[[PeerConnection], None],
        turns: Turns | None = None,
    ) -> None:
        self.role = role
        self.number = number
        self._budget = budget
        self._turns = turns or Turns()
        self.turn_waiting = False  # in `Turns`, for its turn
        self._on_open = on_open
        self._on_frame = on_frame
        self._on_close = on_close
        self._max_buffered = bounds.max_buffered
        self._decoder = framing.FrameDecoder(max_body=bounds.max_body)
        self._pending: deque[framing.Frame | framing.ProtocolError] = deque()
        self._queued = 0  # bytes of the frames in _pending, kept as they come and go
        self._held = 0  # bytes of this connection counted in the budget
        self._write_paused = False
        self.transport: asyncio.Transport | None = None
        self.pid = self.uid = self.gid = -1
        self.session = Session()  # who it is and what it began: the server's, not ours
        self.peer = "a peer"
        self.opened_at = 0.0
        self.partial_since: float | None = 0.0  # a frame begun (or none yet) since this time
        self.closed = False
        self.admission_key: tuple[str, str] | None = None

    # ------------------------------------------------------------------ transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport: asyncio's, or uvloop's (the daemon's loop), which has the same
        # methods without being a subclass
        self.transport = stream = cast(asyncio.Transport, transport)
        stream.set_write_buffer_limits(high=256 << 10)
        loop = asyncio.get_running_loop()
        self.opened_at = self.partial_since = loop.time()
        sock: socket.socket = stream.get_extra_info("socket")
        try:
            self.pid, self.uid, self.gid = peer_credentials(sock)
        except OSError:
            pass  # -1s: nobody, refused by every check that needs a name
        if not self._on_open(self):
            self.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        room = self._max_buffered - self._held
        return _SCRATCH_VIEW if room >= len(_SCRATCH) else _SCRATCH_VIEW[: max(1, room)]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        try:
            frames = self._decoder.feed(_SCRATCH_VIEW[:nbytes])
        except framing.ProtocolError as exc:
            self.refuse(p.Result(exc.status, exc.ref_type, str(exc)), f"sent garbage ({exc})")
            return
        for frame in frames:  # in order, a turn at a time; a heartbeat at once (`Turns`)
            if isinstance(frame, framing.Frame) and frame.msg_type == p.MsgType.HEARTBEAT:
                self._on_frame(self, frame)
                if self.closed:
                    return
                continue
            self._pending.append(frame)
            self._queued += _size(frame)
        self._account()
        if self._held > self._max_buffered or self._budget.used > self._budget.total:
            why = "sent more than the daemon buffers for a connection without waiting"
            if self._budget.used > self._budget.total:
                why = "sent a frame while the daemon's read buffers are full"
            self.refuse(p.Result(p.Status.BAD_BODY, 0, why), why)
            return
        if self._pending:
            self._turns.serve(self)

    def eof_received(self) -> bool:
        return False  # a half-closed peer is gone: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pending.clear()
        self._queued = 0
        self._account()
        self._on_close(self)

    def pause_writing(self) -> None:
        self._write_paused = True  # it does not read: stop reading what it asks
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume_if_idle()

    # ------------------------------------------------------------------ serving

    @property
    def tenant(self) -> object:
        """Whose turns this connection's are (`Turns`): its pod or user, as admitted."""
        return self.admission_key or ("connection", self.number)

    @property
    def registering(self) -> bool:
        """Whether the next frame to handle is a registration (it goes first, `Turns`)."""
        first = self._pending[0] if self._pending else None
        return isinstance(first, framing.Frame) and first.msg_type == p.MsgType.REGISTER

    def serve_turn(self) -> None:
        """Handle a few frames; if more wait, stop reading and come back after the others."""
        for _ in range(FRAMES_PER_TURN):
            if not self._pending or self.closed or self._write_paused:
                break
            item = self._pending.popleft()
            self._queued -= _size(item)
            if isinstance(item, framing.ProtocolError):  # a version we do not speak
                self.send(p.Result(item.status, item.ref_type, str(item)))
                _OTHER_RELEASES.warn(
                    "version",
                    "%s: %s; a hook or nvsharectl of another release (a running program keeps "
                    "the hook it loaded, and runs unshared until it is restarted with this "
                    "node's)",
                    self.peer,
                    item,
                )
            else:
                self._on_frame(self, item)
        self._account()
        if self.closed or self.transport is None:
            return
        if self._pending and not self._write_paused:
            self._turns.wait(self)
        else:
            self._resume_if_idle()

    def _resume_if_idle(self) -> None:
        # Nothing while the peer does not read its answers: resume_writing comes back here.
        if self.transport is None or self.closed or self._write_paused:
            return
        if self._pending:
            self._turns.serve(self)
        elif not self.transport.is_reading() and not self.turn_waiting:
            self.transport.resume_reading()

    def _account(self) -> None:
        # O(1): a flood queues thousands of frames, and this runs every turn
        partial = self._decoder.buffered
        held = 0 if self.closed else partial + self._queued
        self._budget.used += held - self._held
        self._held = held
        if partial == 0:
            self.partial_since = None
        elif self.partial_since is None:
            self.partial_since = asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ writing

    def send(self, message: Message, seq: int = 0) -> bool:
        if self.closed or self.transport is None:
            return False
        if self.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("%s is not reading its socket; disconnecting it", self.peer)
            self.abort()
            return False
        self.transport.write(framing.encode(message, seq=seq))
        return True

    def send_raw(self, data: bytes) -> None:
        """Frames already encoded (a document); the write buffer's pause bounds what piles up."""
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def refuse(self, message: p.Result, why: str, seq: int = 0) -> None:
        """Say why in one frame (answering `seq`) and close: this peer alone."""
        log.warning("%s %s; closing its connection", self.peer, why)
        self.send(message, seq)
        self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.closed = True
            self.transport.abort()  # close() would wait to flush what it never reads

    def overdue(self, now: float) -> bool:
        """A frame begun (or the first one) not complete within the read deadline."""
        return self.partial_since is not None and now - self.partial_since > READ_DEADLINE_S


def _size(item: framing.Frame | framing.ProtocolError) -> int:
    """What a queued frame holds of the read budget."""
    return p.HEADER.size + (len(item.body) if isinstance(item, framing.Frame) else 0)
