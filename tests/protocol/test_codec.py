"""The core's words on the wire: every action for a hook becomes a frame the hook reads, and
every frame a hook or nvsharectl sends becomes the core's event."""

from __future__ import annotations

import typing

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.limits import HookLimits
from appliance.policy.model import Backing, Mode
from appliance.wire import codec, framing
from appliance.wire import protocol as p
from appliance.wire import protocol_gang as pg
from appliance.wire import protocol_view as pv
from appliance.wire.messages import Decoded

LIMITS = HookLimits(None, 50, Mode.OFF, Backing.MANAGED, single_process_oversubscription=True)
SAMPLES = [
    act.Registered(7, 3, LIMITS),
    act.Grant(7, 4, time_quantum_s=30, idle_release_s=0.25),
    act.LockTerms(7, time_quantum_s=30, idle_release_s=0.005),
    act.Drop(7),
    act.Lent(7, True),
    act.Lent(7, False),
    act.GangDrop(7, 12),
    act.GangCut(7, 12, 40),
    act.GangCutOver(7, 12),
    act.LimitsChanged(7, LIMITS),
    act.MemoryGranted(7, 5, 64 << 20, 128 << 20),
    act.MemoryObserved(7, 1 << 30, 768 << 20),
    act.PeersChanged(7, 2),
    act.MemoryReclaim(7),
]


def test_every_action_the_core_returns_has_a_sink() -> None:
    routed = {
        *act.HOOK_ACTIONS,
        act.Reply,
        act.PodWarning,
        act.ReplicasChanged,
        act.LimitsPublished,
    }
    assert set(typing.get_args(act.Action)) == routed
    assert {type(a) for a in SAMPLES} == set(act.HOOK_ACTIONS)


def test_every_action_for_a_hook_becomes_the_frame_it_reads() -> None:
    frames = []
    for action in SAMPLES:
        client_id, message, seq = codec.to_hook(action)
        assert client_id == 7
        (frame,) = framing.FrameDecoder().feed(framing.encode(message, seq=seq))
        frames.append(framing.decode_body(frame))
    wire = p.WireLimits(0, 50, p.WireMode.OFF, p.WireBacking.MANAGED, p.LIMIT_SINGLE_OVERSUB)
    assert frames == [
        p.Registered(7, wire),
        p.LockGrant(30_000, 250_000),
        p.LockTerms(30_000, 5_000),
        p.LockDrop(),
        p.LockLent(),
        p.LockUnlent(),
        pg.GangDrop(12),
        pg.GangCut(12, 40),
        pg.GangCutOver(12),
        p.LimitUpdate(wire),
        p.MemGrant(64 << 20, 128 << 20),
        p.MemObserved(1 << 30, 768 << 20),
        p.LedgerPeers(2),
        p.MemReclaim(),
    ]


def test_hook_and_control_frames_become_the_core_events() -> None:
    released = codec.HOOK_EVENTS[p.LockReleased](p.LockReleased(p.ReleaseReason.UNDRAINED), 7, 9)
    assert released == ev.LockReleased(7, ev.ReleaseReason.UNDRAINED)
    to = ev.Requester(connection=2, seq=11)
    follow = codec.control_event(
        p.SetMode(p.WireMode.AUTO, "GPU-1", flags=p.SET_FOLLOW_POLICY), "pid 1", to
    )
    assert follow == ev.ModeSet(None, "GPU-1", by="pid 1", reply_to=to)
    pod = codec.control_event(
        p.LimitSet(flags=p.LIMIT_SET_CLEAR_MEM, pod_namespace="ml", pod_name="a"), "pid 1", to
    )
    assert isinstance(pod, ev.AdminLimitSet) and pod.target == ev.LimitTarget.pod("ml", "a")
    assert pod.clear_memory and not pod.clear_core
    nobody = codec.control_event(p.LimitSet(flags=p.LIMIT_SET_HAS_CORE), "x", to)
    assert isinstance(nobody, ev.AdminLimitSet) and nobody.target is None


def test_a_hooks_fields_out_of_range_are_named() -> None:
    uuid = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
    fine = p.Register(pid=1, gpu_uuid=uuid, gpu_total_mem=80 << 30, pod_namespace="ml")
    assert codec.hook_problem(fine) is None
    assert codec.hook_problem(p.Register(pid=1, gpu_uuid="", gpu_total_mem=1)) is not None
    bad_name = p.Register(pid=1, gpu_uuid="GPU-1\n", gpu_total_mem=1)
    assert "not a device UUID" in str(codec.hook_problem(bad_name))
    huge = p.Register(pid=1, gpu_uuid=uuid, gpu_total_mem=1 << 62)
    assert codec.hook_problem(huge) == "a byte count beyond any GPU"
    core = p.Register(pid=1, gpu_uuid=uuid, gpu_total_mem=1, env_core_limit=101)
    assert codec.hook_problem(core) == "core limit 101 is above 100"
    pod = p.Register(pid=1, gpu_uuid=uuid, gpu_total_mem=1, pod_name="Big Pod")
    assert codec.hook_problem(pod) == "pod name 'Big Pod' is not a Kubernetes name"
    assert codec.hook_problem(p.MemReserve(0, 0)) == "a reservation of 0 bytes"
    assert codec.hook_problem(p.MemReturn(0, 1 << 62)) == "a byte count beyond any GPU"
    assert codec.hook_problem(p.MemReserve(2 << 20, 1 << 30)) is None
    assert codec.hook_problem(p.LockRequest()) is None
    assert codec.hook_problem(p.PriorityHint(-1000)) is None
    assert codec.hook_problem(p.PriorityHint(5000)) == "priority 5000 is outside -1000 to 1000"
    assert codec.hook_problem(p.MemRefusals(1, 1 << 62)) == "a byte count beyond any GPU"
    assert codec.hook_problem(p.MemRefusals(3, 2 << 20)) is None
    assert codec.hook_problem(pv.ViewRequest(uuid, 80 << 30, "team", "small")) is None
    view = pv.ViewRequest(uuid, 80 << 30, "team", "Big Pod")
    assert codec.hook_problem(view) == "pod name 'Big Pod' is not a Kubernetes name"


def test_gang_frames_become_the_core_events() -> None:
    def hook(message: Decoded) -> ev.Event:
        (frame,) = framing.FrameDecoder().feed(framing.encode(message, seq=5))
        return codec.HOOK_EVENTS[type(framing.decode_body(frame))](framing.decode_body(frame), 7, 5)

    assert hook(pg.GangCatchup()) == ev.LockRequested(7, 5, catch_up=True)
    assert hook(pg.GangHint("torch/none@10.0.0.1:29500")) == ev.GangHint(
        7, "torch/none@10.0.0.1:29500"
    )
    assert hook(pg.GangPosition(12, 40)) == ev.GangPosition(7, 12, 40)
    assert codec.hook_problem(pg.GangHint("torch/none@10.0.0.1:29500")) is None
    assert "not printable" in str(codec.hook_problem(pg.GangHint("job\x1b[2J")))
