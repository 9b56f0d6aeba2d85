"""Play well with others: another interposer loaded after the hook reaches the driver through
dlsym(RTLD_NEXT) (it used to find itself and recurse forever); the hook's threads have names and
block every signal; every environment value is parsed strictly and a bad one is reported; a
socket path that does not fit is an error, not a truncation; nothing the hook does while holding
one of its mutexes can block (the socket and stderr are written in two files only, non-blocking)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import LD_HOOK, Variant, assert_clean


def test_an_interposer_after_the_hook_reaches_the_driver(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir) as sched:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir)
        env["LD_PRELOAD"] += f" {LD_HOOK / 'build' / 'interposer.so'}"
        p = start_probe(variant, env)
        p.ok("init")
        p.ok("launch 7")  # application -> libnvshare.so -> interposer -> libcuda.so.1
        rc, err = p.finish()
        assert_clean(rc, err)
        assert "interposer: passed on 7 launches" in err
        assert sched.count(MsgType.LOCK_GRANT) == 1  # and the hook still gated them


def test_hook_threads_are_named_and_block_every_signal(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir):
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("launch 1")  # service, connection reader and drainer threads are running now
        tasks = Path(f"/proc/{p.proc.pid}/task")
        ours: dict[str, str] = {}
        deadline = time.monotonic() + 20
        while {"nvshare-service", "nvshare-reader", "nvshare-drain"} - set(ours.values()):
            assert time.monotonic() < deadline, ours
            for task in tasks.iterdir():
                name = (task / "comm").read_text().strip()
                if name.startswith("nvshare-"):
                    ours[task.name] = name
        for tid in ours:
            status = (tasks / tid / "status").read_text()
            blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
            for sig in (2, 10, 12, 14, 15, 17):  # INT, USR1, USR2, ALRM, TERM, CHLD
                assert blocked >> (sig - 1) & 1, (ours[tid], sig)
        assert_clean(*p.finish())


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("NVSHARE_IDLE_RELEASE_MS", "99999999999999999999999", "is not a whole number of milli"),
        ("NVSHARE_IDLE_RELEASE_MS", "-5", "NVSHARE_IDLE_RELEASE_MS=-5 is not a whole number"),
        ("NVSHARE_DAEMON_TIMEOUT_MS", "5", "NVSHARE_DAEMON_TIMEOUT_MS=5 is not a whole number"),
        ("NVSHARE_DEBUG", "yes", "NVSHARE_DEBUG=yes is neither 0 nor 1"),
        ("NVSHARE_POD_NAME", "p" * 300, "NVSHARE_POD_NAME is 300 bytes long"),
    ],
)
def test_bad_environment_values_are_reported_and_ignored(
    plain: Variant, start_probe, sock_dir: str, name: str, value: str, message: str
) -> None:
    with fs.FakeScheduler(sock_dir) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir, **{name: value}))
        p.ok("init")
        p.ok("launch 1")
        rc, err = p.finish()
        assert_clean(rc, err)
        assert message in err
        assert err.count(name) == 1  # said once
    assert sched.count(MsgType.REGISTER) == 1  # and the program went on, registered as usual


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("NVSHARE_GPU_CORE_LIMIT", "50x", "NVSHARE_GPU_CORE_LIMIT=50x is not a whole percentage"),
        ("NVSHARE_GPU_CORE_LIMIT", "0", "NVSHARE_GPU_CORE_LIMIT=0 is not a whole percentage"),
        ("NVSHARE_GPU_CORE_LIMIT", " 50", "NVSHARE_GPU_CORE_LIMIT= 50 is not a whole percentage"),
        ("NVSHARE_GPU_CORE_LIMIT", "101", "NVSHARE_GPU_CORE_LIMIT=101 is not a whole percentage"),
        ("NVSHARE_GPU_MEMORY_LIMIT", "0", "NVSHARE_GPU_MEMORY_LIMIT=0 is zero bytes"),
        ("NVSHARE_GPU_MEMORY_LIMIT", "1ki", "NVSHARE_GPU_MEMORY_LIMIT=1ki is not a byte quantity"),
        ("NVSHARE_GPU_MEMORY_LIMIT", "2Ei", "NVSHARE_GPU_MEMORY_LIMIT=2Ei is more than 1Ei"),
    ],
)
def test_a_mistyped_limit_of_the_programs_own_refuses_cuda(
    plain: Variant, start_probe, sock_dir: str, name: str, value: str, message: str
) -> None:
    """A limit the user asked for and mistyped must not leave the program with no limit."""
    with fs.FakeScheduler(sock_dir) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir, **{name: value}))
        assert p.do("init") == "err 1"  # CUDA_ERROR_INVALID_VALUE
        rc, err = p.finish()
        assert_clean(rc, err)
        [line] = [x for x in err.splitlines() if name in x]  # one line
        assert message in line and "CUDA is not started" in line, line
        assert "fix or unset it" in line
    assert sched.count(MsgType.REGISTER) == 0  # nothing ran, not even ungated


def test_limits_of_the_programs_own_that_parse_reach_the_scheduler(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir) as sched:
        env = plain.env(
            NVSHARE_SOCKET_DIR=sock_dir,
            NVSHARE_GPU_CORE_LIMIT="30",
            NVSHARE_GPU_MEMORY_LIMIT="1.5Gi",
        )
        p = start_probe(plain, env)
        p.ok("init")
        p.ok("launch 1")
        rc, err = p.finish()
        assert_clean(rc, err)
        assert "NVSHARE_GPU" not in err
    [(_pid, memory, core)] = [f for _, t, f in sched.events if t == MsgType.REGISTER]
    assert (memory, core) == (3 << 29, 30)


def test_a_socket_path_that_does_not_fit_is_an_error_not_a_truncation(
    plain: Variant, start_probe, tmp_path: Path
) -> None:
    long_dir = tmp_path / ("d" * 120)
    p = start_probe(
        plain, plain.env(NVSHARE_SOCKET_DIR=str(long_dir), NVSHARE_GPU_MEMORY_LIMIT="8Mi")
    )
    p.ok("init")
    p.ok("launch 2")
    assert p.do("alloc mem 16777216") == "err 2"  # the local limit still holds
    rc, err = p.finish()
    assert_clean(rc, err)
    assert "more than the 107 a Unix socket allows; running without the scheduler" in err


def test_only_the_connection_and_the_log_touch_file_descriptors() -> None:
    for path in LD_HOOK.glob("*.c"):
        text = path.read_text()
        calls = set(re.findall(r"\b(send|sendmsg|connect|write|recv)\(", text))
        allowed = {
            "conn.c": {"send"},  # the outbox
            "frames.c": {"recv"},  # the reader's frames
            "dial.c": {"send", "connect", "recv"},  # reaching the socket; the one question
            "log.c": {"write"},
        }.get(path.name, set())
        assert calls <= allowed, (path.name, calls - allowed)
    conn, dial = ((LD_HOOK / name).read_text() for name in ("conn.c", "dial.c"))
    # sends never wait for the daemon; connecting waits for room in a full backlog only up to
    # the daemon timeout (SO_SNDTIMEO), and the background reconnect never waits
    assert "MSG_DONTWAIT" in conn and "MSG_DONTWAIT" in dial
    assert "SOCK_NONBLOCK" in dial and "SO_SNDTIMEO" in dial


def test_the_dlsym_trampoline_is_exported_as_dlsym(plain: Variant) -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(plain.build / "libnvshare.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.search(r" T dlsym$", out, re.M)
