"""Frame encoding and the decoder's handling of split, bad and unknown input."""

from __future__ import annotations

import pytest

from appliance.wire import framing
from appliance.wire import protocol as p
from appliance.wire import protocol_view as pv


def test_round_trip_every_fixed_message() -> None:
    limits = p.WireLimits(4 << 30, 50, p.WireMode.AUTO, p.WireBacking.MANAGED, 1)
    messages = [
        p.Register(
            pid=7,
            gpu_uuid="GPU-abc",
            gpu_total_mem=80 << 30,
            env_mem_limit=1 << 30,
            env_core_limit=30,
            pod_namespace="ns",
            pod_name="pod",
        ),
        p.Registered(9, limits),
        p.LockRequest(),
        p.LockGrant(30000),
        p.LockDrop(),
        p.LockReleased(p.ReleaseReason.IDLE),
        p.SetTq(12),
        p.SetMode(p.WireMode.OFF, "GPU-1"),
        p.MemReserve(1 << 20, 5),
        p.MemGrant(64 << 20, 128 << 20),
        p.MemReturn(3, 4),
        p.LimitUpdate(limits),
        p.LimitSet(pid=3, flags=p.LIMIT_SET_HAS_MEM, mem_limit=1 << 30),
        p.Heartbeat(),
        p.HeartbeatAck(),
        p.MemObserved(5 << 30, 512 << 20),
        p.LedgerPeers(3),
        p.MemRefusals(2, 1 << 20),
        p.PriorityHint(-100),
        pv.ViewRequest("GPU-abc", 80 << 30, "ns", "pod"),
        pv.View(1 << 30, 300 << 20, (pv.ViewProcess(12, pv.VIEW_SELF, 200 << 20),), unlisted=1),
        p.Result(p.Status.PERMISSION, 7, "only root may change the time quantum"),
        p.JsonBody(p.MsgType.QUERY, {"query": "policy"}),
    ]
    data = b"".join(framing.encode(m, seq=i) for i, m in enumerate(messages))
    decoder = framing.FrameDecoder()
    frames = []
    for i in range(0, len(data), 7):  # arbitrary split points
        frames += decoder.feed(data[i : i + 7])
    assert [f.seq for f in frames] == list(range(len(messages)))  # type: ignore[union-attr]
    assert [framing.decode_body(f) for f in frames] == messages  # type: ignore[arg-type]


def test_the_decoder_keeps_a_partial_frame_when_the_buffer_it_read_from_is_reused() -> None:
    """The daemon reads every connection into one scratch buffer and hands the decoder a view
    of it: what is left of a frame must be the decoder's own copy."""
    data = framing.encode(p.LockGrant(30000, 5), seq=1) + framing.encode(p.MemGrant(7, 8), seq=2)
    scratch = bytearray(64)
    cut = len(data) - 5
    scratch[:cut] = data[:cut]
    decoder = framing.FrameDecoder()
    first = decoder.feed(memoryview(scratch)[:cut])
    scratch[:] = bytes(64)  # the next read overwrites it
    scratch[:5] = data[cut:]
    second = decoder.feed(memoryview(scratch)[:5])
    got = [framing.decode_body(f) for f in first + second]  # type: ignore[arg-type]
    assert got == [p.LockGrant(30000, 5), p.MemGrant(7, 8)]


def test_a_view_lists_what_fits_and_counts_the_rest() -> None:
    many = tuple(pv.ViewProcess(pid, 0, 1 << 20) for pid in range(1, 21))
    frame = framing.FrameDecoder().feed(framing.encode(pv.View(1 << 30, 20 << 20, many)))[0]
    view = framing.decode_body(frame)  # type: ignore[arg-type]
    assert view.processes == many[: pv.VIEW_MAX_PROCESSES]
    assert view.unlisted == 20 - pv.VIEW_MAX_PROCESSES


def test_long_strings_are_truncated_and_nul_terminated() -> None:
    reg = p.Register(pid=1, gpu_uuid="G" * 100, gpu_total_mem=0)
    frame = framing.FrameDecoder().feed(framing.encode(reg))[0]
    assert framing.decode_body(frame).gpu_uuid == "G" * (p.UUID_LEN - 1)  # type: ignore[union-attr]


def test_unknown_type_and_bad_body_are_protocol_errors() -> None:
    raw = p.HEADER.pack(p.MAGIC, p.VERSION, 999, 0, 0, 5)
    frame = framing.FrameDecoder().feed(raw)[0]
    with pytest.raises(framing.ProtocolError) as exc:
        framing.decode_body(frame)  # type: ignore[arg-type]
    assert exc.value.status == p.Status.UNKNOWN_TYPE
    raw = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.SET_TQ, 0, 3, 6) + b"abc"
    with pytest.raises(framing.ProtocolError) as exc:
        framing.decode_body(framing.FrameDecoder().feed(raw)[0])  # type: ignore[arg-type]
    assert exc.value.status == p.Status.BAD_BODY and "SET_TQ" in str(exc.value)


def test_wrong_version_is_reported_and_stream_continues() -> None:
    bad = p.HEADER.pack(p.MAGIC, p.VERSION + 1, p.MsgType.LOCK_REQUEST, 0, 0, 1)
    good = framing.encode(p.LockRequest(), seq=2)
    out = framing.FrameDecoder().feed(bad + good)
    assert isinstance(out[0], framing.ProtocolError) and out[0].status == p.Status.BAD_VERSION
    assert isinstance(out[1], framing.Frame) and out[1].seq == 2


def test_garbage_and_oversized_frames_are_fatal() -> None:
    with pytest.raises(framing.ProtocolError, match="bad magic"):
        framing.FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10)
    with pytest.raises(framing.ProtocolError, match="too large"):
        framing.FrameDecoder().feed(p.HEADER.pack(p.MAGIC, 1, 1, 0, framing.MAX_BODY + 1, 0))
