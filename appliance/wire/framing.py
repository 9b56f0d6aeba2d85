"""Frames on a stream: messages to bytes (`encode`) and bytes to messages (`FrameDecoder`,
`decode_body`), sans-I/O.

Every message is one frame (`protocol.HEADER`, then its body), except JSON documents larger than
a frame (status of thousands of clients), which travel as JSON_PART frames ended by a frame of
the document's own type, all with one sequence number. What is wrong with a frame is a
`ProtocolError` whose status says how to answer it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from appliance.wire import messages
from appliance.wire import protocol as p
from appliance.wire.messages import Decoded, Message
from appliance.wire.protocol import HEADER, MAGIC, VERSION, MsgType, Status

MAX_BODY = 1 << 20
MAX_DOCUMENT = 64 << 20  # a JSON reply split over JSON_PART frames (status of 10,000 clients: 4 MB)


class ProtocolError(Exception):
    """A frame that cannot be accepted; `status` says how to answer it."""

    def __init__(self, status: Status, message: str, *, ref_type: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.ref_type = ref_type


@dataclass(frozen=True, slots=True)
class Frame:
    msg_type: int
    seq: int
    body: bytes


def encode(message: Message, *, seq: int = 0) -> bytes:
    """The frame of a message; a JSON document over MAX_BODY becomes JSON_PART frames and a
    last frame of its own type."""
    body: bytes = message.pack()
    if len(body) > MAX_BODY and not isinstance(message, p.JsonBody):
        raise ValueError(f"a {message.TYPE.name} body of {len(body)} bytes cannot be sent")
    return encode_body(message.TYPE, body, seq=seq)


def encode_body(msg_type: MsgType, body: bytes, *, seq: int = 0) -> bytes:
    """Frames of a body already packed (a JSON document encoded once, sent to many)."""
    if len(body) <= MAX_BODY:
        return HEADER.pack(MAGIC, VERSION, int(msg_type), 0, len(body), seq) + body
    if len(body) > MAX_DOCUMENT:
        raise ValueError(f"a {msg_type.name} body of {len(body)} bytes cannot be sent")
    frames = []
    for start in range(0, len(body), MAX_BODY):
        chunk = body[start : start + MAX_BODY]
        last = start + MAX_BODY >= len(body)
        kind = int(msg_type) if last else int(MsgType.JSON_PART)
        frames.append(HEADER.pack(MAGIC, VERSION, kind, 0, len(chunk), seq) + chunk)
    return b"".join(frames)


# Bodies of a fixed layout by the plain number in a header: read without an enum made per frame.
_FIXED_BY_NUMBER: dict[int, type[messages.Body]] = {int(t): b for t, b in messages.FIXED.items()}


def decode_body(frame: Frame) -> Decoded:
    """Parse a frame's body; raises ProtocolError saying what is wrong with it."""
    fixed = _FIXED_BY_NUMBER.get(frame.msg_type)
    if fixed is not None:  # every message a hook sends: the hot path
        try:
            return fixed.unpack(frame.body)
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise _malformed(MsgType(frame.msg_type), frame, exc) from None
    try:
        msg_type = MsgType(frame.msg_type)
    except ValueError:
        raise ProtocolError(
            Status.UNKNOWN_TYPE, f"unknown message type {frame.msg_type}", ref_type=frame.msg_type
        ) from None
    try:
        if msg_type in (MsgType.OK, MsgType.ERROR):
            return p.Result.unpack(frame.body)
        if msg_type in messages.JSON_TYPES:
            return p.JsonBody(msg_type, json.loads(frame.body.decode("utf-8")))
        if msg_type is MsgType.JSON_PART:
            return p.JsonPart(frame.body)
        return messages.FIXED[msg_type].unpack(frame.body)
    except RecursionError:
        raise ProtocolError(
            Status.BAD_BODY,
            f"{msg_type.name} body is nested too deeply",
            ref_type=frame.msg_type,
        ) from None
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise _malformed(msg_type, frame, exc) from None


def _malformed(msg_type: MsgType, frame: Frame, exc: Exception) -> ProtocolError:
    return ProtocolError(
        Status.BAD_BODY,
        f"{msg_type.name} body of {len(frame.body)} bytes is malformed: {exc}",
        ref_type=frame.msg_type,
    )


class FrameDecoder:
    """Incremental decoder: feed bytes, take complete frames.

    A bad magic or an oversized body makes the stream unusable (`ProtocolError` with
    `fatal=True` semantics: the caller closes the connection); a wrong version is reported per
    frame so the peer can be told which version we speak.

    With `max_document` (the CLI's side) JSON_PART frames are joined to the frame that ends
    their document, up to that many bytes; without it (the daemon's side) they are frames like
    any other, which the daemon does not accept.
    """

    def __init__(self, *, max_document: int = 0, max_body: int = MAX_BODY) -> None:
        self._buf = bytearray()
        self._max_document = max_document
        self._max_body = max_body
        self._parts: dict[int, bytearray] = {}

    @property
    def buffered(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame | ProtocolError]:
        """The frames `data` completes, in order; what is left of a frame is kept for the next
        call (`data` itself is not: a caller may reuse its buffer)."""
        if self._buf:
            self._buf += data
            data = self._buf
        out: list[Frame | ProtocolError] = []
        start, end = 0, len(data)
        while end - start >= HEADER.size:
            magic, version, msg_type, _flags, length, seq = HEADER.unpack_from(data, start)
            if magic != MAGIC or length > self._max_body:
                raise self._unusable(magic, length)
            begin = start + HEADER.size
            if end - begin < length:
                break
            start = begin + length
            body = bytes(data[begin:start])
            if version == VERSION and not self._max_document:  # the daemon's every frame
                out.append(Frame(msg_type, seq, body))
            else:
                self._take(out, version, msg_type, seq, body)
        if data is self._buf:
            del self._buf[:start]
        elif start < end:
            self._buf += data[start:]
        return out

    def _unusable(self, magic: int, length: int) -> ProtocolError:
        """What makes the stream unusable: not our magic, or a body larger than allowed."""
        if magic != MAGIC:
            return ProtocolError(Status.BAD_BODY, f"bad magic 0x{magic:08x}: not an nvshare peer")
        return ProtocolError(
            Status.BAD_BODY,
            f"frame body of {length} bytes is too large (at most {self._max_body} here)",
        )

    def _take(
        self, out: list[Frame | ProtocolError], version: int, msg_type: int, seq: int, body: bytes
    ) -> None:
        """One whole frame: to `out`, or held as a part of a document."""
        if version != VERSION:
            out.append(
                ProtocolError(
                    Status.BAD_VERSION,
                    f"protocol version {version} is not supported (we speak {VERSION})",
                    ref_type=msg_type,
                )
            )
            return
        if self._max_document and msg_type == MsgType.JSON_PART:
            part = self._parts.setdefault(seq, bytearray())
            part += body
            if len(part) > self._max_document:
                raise ProtocolError(
                    Status.BAD_BODY, f"a document of more than {self._max_document} bytes"
                )
            return
        if seq in self._parts:
            body = bytes(self._parts.pop(seq)) + body
        out.append(Frame(msg_type, seq, body))
