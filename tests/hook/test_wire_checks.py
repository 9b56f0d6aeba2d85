"""Trust nothing from the wire: every frame the hook reads is checked per type (version, body
length, enums, ranges); a malformed one is reported and ignored, never read as zeros (an empty
LIMIT_UPDATE used to mean "no limit, mode off"), and a stream that is not nvshare's at all is
treated as a daemon gone."""

from __future__ import annotations

import struct
import time

from appliance.wire.protocol import VERSION, MsgType, WireLimits, WireMode

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

MiB = 1 << 20


def limits(
    mem: int = 0, core: int = 100, mode: int = WireMode.ON, backing: int = 0, flags: int = 0
) -> bytes:
    return WireLimits.FORMAT.pack(mem, core, mode, backing, flags)


def wait_for_lines(p, text: str, n: int) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 20
    while (err := p.stderr()).count(text) < n:
        assert time.monotonic() < deadline, err
        time.sleep(0.02)
    return err


def test_malformed_frames_are_reported_and_ignored(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=64 * MiB)) as sched:
        p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        assert p.do("total") == f"ok {64 * MiB}"
        for type_, body, version in (
            (MsgType.LIMIT_UPDATE, b"", VERSION),  # empty: not "no limit, mode off"
            (MsgType.LIMIT_UPDATE, limits(mode=7), VERSION),
            (MsgType.LIMIT_UPDATE, limits(core=0), VERSION),
            (MsgType.LIMIT_UPDATE, limits(backing=5), VERSION),
            (MsgType.LIMIT_UPDATE, limits(), VERSION + 1),  # a version the hook does not speak
        ):
            sched.send_raw(type_, body, version=version)
        err = wait_for_lines(p, "ignored a frame of type 23", 5)
        for why in (
            "wrong body length",
            "unknown mode",
            "core limit outside 1-100",
            "unknown memory backing",
            "protocol version not spoken here",
        ):
            assert why in err
        assert "further ones are not reported" in err
        assert p.do("total") == f"ok {64 * MiB}"  # the limit held through all of them
        assert p.do(f"alloc mem {66 * MiB}") == "err 2"
        for type_, body in (
            (MsgType.LIMIT_UPDATE, limits(flags=0x80)),
            (MsgType.MEM_GRANT, struct.pack("<QQ", 10 * MiB, 5 * MiB)),  # granted > reserved
            (MsgType.LEDGER_PEERS, struct.pack("<II", 0, 0)),
            (MsgType.ERROR, struct.pack("<iI", 0, 3) + bytes(248)),  # an error with status 0
            (MsgType.LIMIT_UPDATE, limits(mem=32 * MiB)),  # and a good one, after them
        ):
            sched.send_raw(type_, body)
        deadline = time.monotonic() + 20
        while p.do("total") != f"ok {32 * MiB}":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        rc, err = p.finish()
        assert_clean(rc, err)
        assert err.count("ignored a frame") == 5  # reported, but not without end


def test_a_stream_that_is_not_nvshare_is_a_daemon_gone(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("launch 1")
        for c in list(sched.clients):
            c.conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        wait_for_lines(p, "not an nvshare frame", 1)
        p.ok("launch 3")  # runs on, ungated
        assert_clean(*p.finish())
