"""A borrower keeps its queue short (ld_hook/pace.h): a holder told a queue bound with its grant
(as the daemon tells a lower priority on a GPU a higher one lent it) has only a few launches
queued on the fake GPU at a time, and as many as it likes without one; the bound goes and comes
with the terms; a stream capture is neither paced nor recorded into; an absurd bound from the
wire neither starves the GPU nor hangs the process."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from appliance.wire.protocol import LockTerms, MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

KERNEL_US = 1000  # each launch on the fake GPU
BOUND_US = 2500  # two or three launches' worth
LAUNCHES = 40  # queued in a few microseconds: all of them, unless paced
FIRST_DEPTH = 4  # pace.c: before the first wait has measured anything
CAPTURE_GLOBAL = 0


@contextmanager
def _holding(variant: Variant, start_probe, sock_dir: str, queue_us: int = BOUND_US):  # type: ignore[no-untyped-def]
    """A probe holding the lock, granted with `queue_us`; it must end cleanly."""
    with fs.FakeScheduler(sock_dir, idle_release_ms=3_600_000, queue_us=queue_us) as sched:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_LAUNCH_US=str(KERNEL_US))
        p = start_probe(variant, env)
        p.ok("init")
        p.ok("launch 1")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_GRANT) == 1)
        yield sched, p
        assert_clean(*p.finish())


def _most_queued(p) -> int:  # type: ignore[no-untyped-def]
    return int(p.ok(f"queuedepth {LAUNCHES}").split()[1])


def _eventually_queued(p, ok: Callable[[int], bool]) -> None:  # type: ignore[no-untyped-def]
    """New terms arrive on their own time: queue until they show (bounded generously)."""
    deadline = time.monotonic() + 20
    while not ok(most := _most_queued(p)):
        assert time.monotonic() < deadline, f"still {most} queued at most"


def test_a_bound_keeps_few_launches_queued_and_none_keeps_all(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with _holding(variant, start_probe, sock_dir) as (sched, p):
        assert _most_queued(p) <= FIRST_DEPTH
        assert _most_queued(p) <= 3  # learned: the bound's worth, at least two
        # new terms without a bound (the lender left): the process queues as it likes
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, 0, 0).pack())
        _eventually_queued(p, lambda most: most >= LAUNCHES - 5)
        sched.send_raw(MsgType.LOCK_TERMS, LockTerms(0, 0, BOUND_US).pack())
        _eventually_queued(p, lambda most: most <= 3)
        assert _most_queued(p) <= 3
        assert (sched.count(MsgType.LOCK_REQUEST), sched.count(MsgType.LOCK_DROP)) == (1, 0)


def test_without_a_bound_nothing_is_paced(plain: Variant, start_probe, sock_dir: str) -> None:
    with _holding(plain, start_probe, sock_dir, queue_us=0) as (_, p):
        assert _most_queued(p) >= LAUNCHES - 5


def test_a_capture_under_a_bound_is_neither_paced_nor_recorded_into(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    with _holding(variant, start_probe, sock_dir) as (_, p):
        s = p.ok("stream 0").split()[1]
        p.ok(f"queue_on {s} 8")  # paced on its own stream: events behind its launches
        p.ok(f"capture_begin {s} {CAPTURE_GLOBAL}")
        p.ok(f"capture_launch {s} 5")
        graph = p.ok(f"capture_end {s}").split()[1]  # not broken by a wait on an event
        assert p.ok(f"graph_nodes {graph}") == "ok 5"  # the five kernels, no event of ours
        exe = p.ok(f"instantiate {graph}").split()[1]
        p.ok(f"graph_launch {exe} {s}")  # and the graph runs, paced like a launch
        assert _most_queued(p) <= FIRST_DEPTH


@pytest.mark.parametrize("bound_us", [1, 2**64 - 1])
def test_an_absurd_bound_neither_starves_the_gpu_nor_hangs(
    plain: Variant, start_probe, sock_dir: str, bound_us: int
) -> None:
    # from a broken or hostile daemon: a microsecond still keeps two launches queued (the GPU
    # never runs dry between them); past a second is a second; the launches go on
    with _holding(plain, start_probe, sock_dir, queue_us=bound_us) as (_, p):
        if bound_us == 1:
            assert _most_queued(p) <= FIRST_DEPTH
            assert _most_queued(p) == 2  # learned
        else:
            assert _most_queued(p) >= LAUNCHES - 5
        p.ok("launch 3")


def test_threads_launching_under_a_bound_share_one_pace(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    # several threads of one process launch at once, paced together (one ring a GPU, under
    # its mutex): no race (ThreadSanitizer), no launch refused, no hang
    with _holding(variant, start_probe, sock_dir) as (_, p):
        assert int(p.ok("threads 4 300").split()[1]) > 0
        assert _most_queued(p) <= FIRST_DEPTH
