"""A small scripted stand-in for the node scheduler, speaking ld_hook/nvshare_proto.h.

It exists so the hook's side of the protocol (registration, lock grant/drop/release, chunked
memory reservations, limit updates, daemon death, a daemon that stops answering, malformed
frames) can be tested exactly and quickly, with every frame the hook sends recorded for
assertions. The real daemon is tested against the hook in test_with_daemon.py. Frames are
`appliance.wire.protocol`'s, the one Python mirror of the header, so the fake cannot drift from it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.wire import framing
from appliance.wire import protocol as p


def limits(
    mem_limit: int = 0,
    core_limit: int = 100,
    mode: p.WireMode = p.WireMode.ON,
    backing: p.WireBacking = p.WireBacking.DEVICE,
    flags: int = 0,
) -> p.WireLimits:
    """What the fake tells hooks: no memory limit, the whole GPU, gated, unless said."""
    return p.WireLimits(mem_limit, core_limit, mode, backing, flags)


DEFAULT_LIMITS = limits()


@dataclass(slots=True)
class Client:
    conn: socket.socket
    client_id: int
    pid: int = 0
    uuid: str = ""
    env_mem_limit: int = 0
    gpu_total_mem: int = 0
    pod: tuple[str, str] = ("", "")
    reserved: int = 0
    used: int = 0
    lock_since: float = 0.0
    dropped: bool = False
    pending_seq: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: Any, seq: int = 0) -> None:
        with self.send_lock:
            try:
                self.conn.sendall(framing.encode(message, seq=seq))
            except OSError:
                pass


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = conn.recv(n - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


class FakeScheduler:
    """Serves scheduler.sock in `socket_dir` on a background thread until stop()."""

    def __init__(
        self,
        socket_dir: str,
        *,
        limits: p.WireLimits = DEFAULT_LIMITS,
        tq_s: float = 0.0,
        chunk: int = 64 << 20,
        pod_limit: int = 0,
        auto_grant: bool = True,
        idle_release_ms: int = 0,
        queue_us: int = 0,
        listener: socket.socket | None = None,
    ) -> None:
        self.path = os.path.join(socket_dir, "scheduler.sock")
        self.limits = limits
        self.tq_s = tq_s
        self.chunk = chunk
        self.pod_limit = pod_limit
        self.auto_grant = auto_grant  # False: requests wait for grant_waiting()
        self.idle_release_ms = idle_release_ms  # in every grant; 0: the hook's default
        self.queue_us = queue_us  # in every grant; 0: no bound
        self.silent = threading.Event()  # set: read nothing, answer nothing (a hung daemon)
        self.grant_reserved_extra = 0  # added to the absolute reservation a MEM_GRANT reports
        self.limits_with_next_grant: p.WireLimits | None = None  # pushed just before it
        self.mu = threading.Condition()
        self.clients: list[Client] = []
        self.events: list[tuple[int, int, tuple[int, ...]]] = []  # (client_id, type, fields)
        self.holder: Client | None = None
        self.queue: list[Client] = []
        self._next_id = 1
        self._stopping = False
        if listener is None:  # else: one bound to self.path already, now served
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.path)
            listener.listen(64)
        self._listener = listener
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        if tq_s > 0:
            self._threads.append(threading.Thread(target=self._quantum, daemon=True))
        for t in self._threads:
            t.start()

    def __enter__(self) -> FakeScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- observation helpers for tests ----
    def wait_for(self, predicate: object, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.mu:
            while not predicate():  # type: ignore[operator]
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.mu.wait(left)
            return True

    def count(self, type_: int) -> int:
        with self.mu:
            return sum(1 for _, t, _ in self.events if t == type_)

    def total_reserved(self) -> int:
        with self.mu:
            return sum(c.reserved for c in self.clients)

    def grant_waiting(self) -> None:
        """With auto_grant=False: grant the lock to the first client waiting for it."""
        with self.mu:
            if self.holder is None and self.queue:
                self._next_holder(force=True)

    def send_raw(self, type_: int, body: bytes, *, seq: int = 0, version: int = p.VERSION) -> None:
        """A frame to every client, as given: for testing how the hook treats bad ones."""
        with self.mu:
            clients = list(self.clients)
        for c in clients:
            with c.send_lock:
                c.conn.sendall(p.HEADER.pack(p.MAGIC, version, type_, 0, len(body), seq) + body)

    def push_limits(self, limits: p.WireLimits) -> None:
        with self.mu:
            self.limits = limits
            clients = list(self.clients)
        for c in clients:
            c.send(p.LimitUpdate(limits))

    def stop(self) -> None:
        """Die like kill -9: every connection and the listener close at once."""
        with self.mu:
            self._stopping = True
            clients = list(self.clients)
            self.clients.clear()
            self.mu.notify_all()
        for c in clients:
            try:
                c.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.conn.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        for t in self._threads:
            t.join(timeout=5)

    # ---- server ----
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self.mu:
                client = Client(conn=conn, client_id=self._next_id)
                self._next_id += 1
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            t.start()

    def _serve(self, c: Client) -> None:
        while True:
            head = _recv_exact(c.conn, p.HEADER.size)
            if head is None:
                break
            magic, _version, type_, _flags, length, seq = p.HEADER.unpack(head)
            body = _recv_exact(c.conn, length) if length else b""
            if magic != p.MAGIC or body is None:
                break
            while self.silent.is_set() and not self._stopping:
                time.sleep(0.01)  # hung: what arrived now is answered only after it wakes
            self._handle(c, type_, seq, body)
        self._gone(c)

    def _record(self, c: Client, type_: int, fields: tuple[int, ...] = ()) -> None:
        self.events.append((c.client_id, type_, fields))
        self.mu.notify_all()

    def _handle(self, c: Client, type_: int, seq: int, body: bytes) -> None:
        try:
            msg = framing.decode_body(framing.Frame(type_, seq, body))
        except framing.ProtocolError as exc:
            msg = exc
        with self.mu:
            if isinstance(msg, p.Register):
                c.pid, c.gpu_total_mem, c.env_mem_limit = (
                    msg.pid,
                    msg.gpu_total_mem,
                    msg.env_mem_limit,
                )
                c.uuid, c.pod = msg.gpu_uuid, (msg.pod_namespace, msg.pod_name)
                self.clients.append(c)
                self._record(c, type_, (msg.pid, msg.env_mem_limit, msg.env_core_limit))
                c.send(p.Registered(c.client_id, self.limits), seq)
            elif isinstance(msg, p.LockRequest):
                self._record(c, type_)
                if self.limits.mode == p.WireMode.OFF or (self.holder is None and self.auto_grant):
                    self._grant(c, seq)
                else:
                    self.queue.append(c)
                    c.pending_seq = seq
            elif isinstance(msg, p.LockReleased):
                self._record(c, type_, (msg.reason,))
                if self.holder is c:
                    self._next_holder()
            elif isinstance(msg, p.MemReserve):
                self._reserve(c, msg, seq)
            elif isinstance(msg, p.Heartbeat):
                self._record(c, type_)
                c.send(p.HeartbeatAck(), seq)
            elif isinstance(msg, (p.MemReturn, p.MemRefusals)):
                self._reports(c, msg)
            else:
                self._record(c, type_)
                c.send(p.Result(p.Status.UNKNOWN_TYPE, type_, "unknown type"), seq)

    def _reports(self, c: Client, msg: p.MemReturn | p.MemRefusals) -> None:
        """What a hook says without asking for an answer."""
        if isinstance(msg, p.MemReturn):
            c.reserved -= msg.nbytes
            c.used = msg.used
            self._record(c, msg.TYPE, (msg.nbytes, msg.used))
        else:
            self._record(c, msg.TYPE, (msg.count, msg.largest))

    def _reserve(self, c: Client, msg: p.MemReserve, seq: int) -> None:
        c.used = msg.used
        others = sum(x.reserved for x in self.clients if x is not c)
        room = self.pod_limit - others - c.reserved if self.pod_limit else 1 << 62
        granted = min(max(msg.nbytes, self.chunk), room) if room >= msg.nbytes else 0
        c.reserved += granted + (self.grant_reserved_extra if granted else 0)
        self._record(c, p.MsgType.MEM_RESERVE, (msg.nbytes, msg.used, granted))
        if self.limits_with_next_grant is not None:  # a limit change that crossed the request
            self.limits, self.limits_with_next_grant = self.limits_with_next_grant, None
            c.send(p.LimitUpdate(self.limits))
        c.send(p.MemGrant(granted, c.reserved), seq)

    def _grant(self, c: Client, seq: int) -> None:
        self.holder = c
        c.lock_since = time.monotonic()
        c.dropped = False
        self._record(c, p.MsgType.LOCK_GRANT)
        c.send(p.LockGrant(int(self.tq_s * 1000), self.idle_release_ms * 1000, self.queue_us), seq)

    def _next_holder(self, *, force: bool = False) -> None:
        self.holder = None
        if self.queue and (self.auto_grant or force):
            nxt = self.queue.pop(0)
            self._grant(nxt, nxt.pending_seq)

    def _gone(self, c: Client) -> None:
        with self.mu:
            if c in self.clients:
                self.clients.remove(c)
            if c in self.queue:
                self.queue.remove(c)
            c.reserved = 0
            self._record(c, -1)
            if self.holder is c and not self._stopping:
                self._next_holder()
        c.conn.close()

    def _quantum(self) -> None:
        while True:
            time.sleep(min(self.tq_s / 4, 0.05))
            with self.mu:
                if self._stopping:
                    return
                h = self.holder
                if (
                    h
                    and self.queue
                    and not h.dropped
                    and time.monotonic() - h.lock_since > self.tq_s
                ):
                    h.dropped = True
                    self._record(h, p.MsgType.LOCK_DROP)
                    h.send(p.LockDrop())
