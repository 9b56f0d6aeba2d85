"""Busy means busy: a holder with a thread waiting for its GPU, in any call that waits, or with
work still running on the GPU, is never idle; one with nothing in flight and nobody waiting is.

Each test holds the lock under terms of a short idle window (as while another client waits)
and runs a loop whose thread spends most of its time waiting (inside one entry point) or
sleeping while the fake GPU runs what it queued. A hold that lasted the whole loop took one
request; one handed over as idle in between has to ask again. Once the loop ends the hold is
handed back as idle. (Synchronisation and synchronous copies kept a holder before this rule
too; the others did not.)"""

from __future__ import annotations

import re

import pytest

from appliance.wire.protocol import LockTerms, MsgType

from . import fake_scheduler as fs
from .conftest import LD_HOOK, Variant, assert_clean

KERNEL_US = 100_000  # each kernel, copy or wait on the fake GPU
IDLE_MS = 50  # the idle window while "someone waits"
LOOP_MS = 400


def _family(macro: str, suffixes: tuple[str, ...]) -> list[str]:
    """The entry points of one of copies.h's lists, with each suffix."""
    text = (LD_HOOK / "copies.h").read_text()
    body = text.split(f"#define {macro}(X, SFX)")[1].split("\n\n")[0]
    return [f"{n}{sfx}" for sfx in suffixes for n in re.findall(r"X\((cu\w+)##SFX", body)]


SYNC_COPIES = _family("NVS_SYNC_COPIES", ("", "_ptds"))
ASYNC_COPIES = _family("NVS_ASYNC_COPIES", ("", "_ptsz"))
# stream-ordered copies with a host side: to pageable memory they block until they have run
HOST_COPIES = [n for n in ASYNC_COPIES if re.search(r"HtoD|DtoH|HtoA|AtoH", n)]
WAITS = [
    "cuCtxSynchronize",
    "cuCtxSynchronize_v2",
    "cuStreamSynchronize",
    "cuStreamSynchronize_ptsz",
    "cuEventSynchronize",
    # a thread polling a query in a loop is waiting too
    "cuStreamQuery",
    "cuStreamQuery_ptsz",
    "cuEventQuery",
]
# the rest return at once, their work queued (with pageable memory, a host copy has run when it
# returns: nothing is left in flight)
QUEUED = [
    *(n for n in ASYNC_COPIES if n not in HOST_COPIES),
    "cuStreamWaitEvent",
    "cuStreamWaitEvent_ptsz",
    "cuLaunchKernel",
]


def _released_idle(sched: fs.FakeScheduler) -> bool:
    return any(t == MsgType.LOCK_RELEASED and f == (1,) for _, t, f in sched.events)


def hold_through(variant: Variant, start_probe, sock_dir: str, loop: str) -> None:  # type: ignore[no-untyped-def]
    with fs.FakeScheduler(sock_dir, idle_release_ms=3_600_000) as sched:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_LAUNCH_US=str(KERNEL_US))
        p = start_probe(variant, env)
        p.ok("init")
        p.ok("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, IDLE_MS * 1000).pack())
        rounds = int(p.ok(loop).split()[1])  # it answers with a kernel of its still running
        assert rounds >= 2
        assert not _released_idle(sched), f"{loop!r}: taken for idle while its GPU was busy"
        assert (sched.count(MsgType.LOCK_REQUEST), sched.count(MsgType.LOCK_GRANT)) == (1, 1)
        # Nothing in flight, nobody waiting: now it is idle, and lets go without being asked.
        assert sched.wait_for(lambda: _released_idle(sched))
        assert sched.count(MsgType.LOCK_DROP) == 0
        assert_clean(*p.finish())


@pytest.mark.parametrize("name", [*WAITS, *SYNC_COPIES, *HOST_COPIES])
def test_a_thread_waiting_in_any_call_keeps_the_holder(
    plain: Variant, start_probe, sock_dir: str, name: str
) -> None:
    hold_through(plain, start_probe, sock_dir, f"waitin {name} {LOOP_MS}")


@pytest.mark.parametrize("name", QUEUED)
def test_work_still_running_keeps_the_holder(
    plain: Variant, start_probe, sock_dir: str, name: str
) -> None:
    hold_through(plain, start_probe, sock_dir, f"queuefor {name} {LOOP_MS}")


@pytest.mark.parametrize(
    "loop",
    [
        f"waitin cuMemcpyDtoHAsync_v2 {LOOP_MS}",
        f"waitin cuEventQuery {LOOP_MS}",
        f"queuefor cuMemsetD8Async {LOOP_MS}",
    ],
)
def test_busy_holders_under_the_sanitizers(
    variant: Variant, start_probe, sock_dir: str, loop: str
) -> None:
    hold_through(variant, start_probe, sock_dir, loop)


def test_a_holder_with_nothing_in_flight_lets_go_without_a_drop(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # Its work has run and no thread waits: released as idle, and the next launch asks again.
    with fs.FakeScheduler(sock_dir, idle_release_ms=3_600_000) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("launch 3")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, IDLE_MS * 1000).pack())
        assert sched.wait_for(lambda: _released_idle(sched))
        p.ok("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 2)
        assert sched.count(MsgType.LOCK_DROP) == 0
        assert_clean(*p.finish())
