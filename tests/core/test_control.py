"""nvsharectl's state changes as the core decides them: bounds, unknown targets, what the reply
says changed, who is logged, and overrides that end with their process or give way to policy."""

from __future__ import annotations

import logging

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.events import LimitTarget
from appliance.core.gpus import GpuFacts
from appliance.core.node import NodeCore
from appliance.core.state import DroppedOverride
from appliance.core.views import OverrideRow
from appliance.policy.model import (
    GpuMatch,
    GpuRule,
    Limits,
    Mode,
    Policy,
    SchedulerSettings,
    TrustSettings,
)

from .conftest import ADMIN, GPU, GiB, Harness, of

OTHER = "GPU-00000000-0000-0000-0000-000000000002"


def reply(actions: list[act.Action]) -> act.Reply:
    (answer,) = [a for a in actions if isinstance(a, act.Reply)]
    return answer


@pytest.mark.parametrize("seconds", [0.01, 0.999, 86401, 1e8])
def test_a_time_quantum_out_of_bounds_changes_nothing(harness: Harness, seconds: float) -> None:
    answer = reply(harness.feed(ev.TimeQuantumSet(seconds, reply_to=ADMIN)))
    assert answer.outcome is act.Outcome.INVALID
    assert answer.message.endswith("is outside 1-86400 s; nothing changed")
    assert harness.state.overrides.time_quantum_s is None


def test_a_time_quantum_is_set_logged_with_who_and_handed_back(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvshare.scheduler")
    a = harness.register()
    out = harness.feed(ev.TimeQuantumSet(86400, by="pid 7 (uid 0, root)", reply_to=ADMIN))
    assert (
        reply(out).message == "time quantum set to 86400 s on every GPU (was 30 s from the policy)"
    )
    assert "pid 7 (uid 0, root) set the time quantum to 86400 s" in caplog.text
    assert of(harness.feed(ev.LockRequested(a, 1)), act.Grant)[0].time_quantum_s == 86_400
    out = harness.feed(ev.TimeQuantumSet(None, by="pid 8", reply_to=ADMIN))
    assert reply(out).message == "the time quantum follows the policy again (30 s)"
    assert harness.state.time_quantum(GPU) == 30
    assert "pid 8 handed the time quantum back to the policy" in caplog.text
    assert reply(harness.feed(ev.TimeQuantumSet(None, reply_to=ADMIN))).message == (
        "the time quantum already follows the policy"
    )


def test_a_mode_for_an_unknown_gpu_is_refused_naming_the_known_ones() -> None:
    h = Harness(NodeCore(Policy(), inventory={OTHER: GpuFacts(uuid=OTHER, index=1)}))
    h.register()  # on GPU, which NVML does not list: no index
    answer = reply(h.feed(ev.ModeSet(Mode.OFF, "GPU-nosuch", reply_to=ADMIN)))
    assert answer.outcome is act.Outcome.NOT_FOUND
    assert answer.message == (
        f"no GPU GPU-nosuch is known here; nothing changed (known: {GPU}, GPU 1 ({OTHER}))"
    )
    assert h.state.overrides.modes == {}
    assert (
        reply(h.feed(ev.ModeSet(Mode.OFF, OTHER, reply_to=ADMIN))).outcome is act.Outcome.DONE
    )  # NVML knows it


def test_a_gpu_is_named_by_its_index_or_a_prefix_of_its_uuid_found_nowhere_else() -> None:
    third = "GPU-00000000-0000-0000-0000-000000000003"
    inventory = {u: GpuFacts(uuid=u, index=i) for i, u in enumerate((GPU, OTHER, third))}
    h = Harness(NodeCore(Policy(), inventory=inventory))
    answer = reply(h.feed(ev.ModeSet(Mode.OFF, "1", reply_to=ADMIN)))
    assert answer.outcome is act.Outcome.DONE
    assert answer.message == f"mode set to off for GPU 1 ({OTHER}) (was on from the policy)"
    assert h.state.overrides.modes == {OTHER: Mode.OFF}
    answer = reply(
        h.feed(ev.ModeSet(Mode.AUTO, "00000000-0000-0000-0000-000000000003", reply_to=ADMIN))
    )
    assert answer.message == f"mode set to auto for GPU 2 ({third}) (was on from the policy)"
    answer = reply(
        h.feed(ev.ModeSet(None, "gpu-00000000-0000-0000-0000-0000000000", reply_to=ADMIN))
    )
    assert answer.outcome is act.Outcome.NOT_FOUND
    assert answer.message == (
        "'gpu-00000000-0000-0000-0000-0000000000' names 3 GPUs: give more of the UUID; nothing "
        "changed (known: GPU 0 (GPU-00000000), GPU 1 (GPU-00000000), GPU 2 (GPU-00000000))"
    )  # too long with whole UUIDs: the index and the UUID's start
    answer = reply(h.feed(ev.ModeSet(Mode.ON, "3", reply_to=ADMIN)))
    assert answer.outcome is act.Outcome.NOT_FOUND
    assert answer.message.startswith("no GPU 3 is known here; nothing changed (known: GPU 0 (")
    assert h.state.overrides.modes == {OTHER: Mode.OFF, third: Mode.AUTO}


def test_a_mode_set_says_what_it_replaced(harness: Harness) -> None:
    """As -T does: `-S on` after `-S off` says "was off from nvsharectl"."""
    assert reply(harness.feed(ev.ModeSet(Mode.OFF, reply_to=ADMIN))).message == (
        "mode set to off for every GPU (was on from the policy)"
    )
    harness.register()
    assert reply(harness.feed(ev.ModeSet(Mode.ON, reply_to=ADMIN))).message == (
        "mode set to on for every GPU (was off from nvsharectl)"
    )
    harness.feed(ev.ModeSet(Mode.AUTO, GPU, reply_to=ADMIN))
    assert reply(harness.feed(ev.ModeSet(Mode.OFF, GPU, reply_to=ADMIN))).message == (
        f"mode set to off for {GPU} (was auto from nvsharectl)"
    )


def test_a_mode_handed_back_to_policy_reaches_the_hooks(harness: Harness) -> None:
    a = harness.register()
    harness.feed(ev.ModeSet(Mode.OFF, reply_to=ADMIN))
    assert harness.enforced(a).mode is Mode.OFF
    out = harness.feed(ev.ModeSet(None, reply_to=ADMIN))
    assert reply(out).message == "the mode on every GPU follows the policy again"
    assert of(out, act.LimitsChanged, a)[0].limits.mode is Mode.ON
    assert reply(harness.feed(ev.ModeSet(None, GPU, reply_to=ADMIN))).message == (
        f"the mode on {GPU} already follows the policy"
    )


def test_a_reload_that_leaves_the_policys_mode_and_quantum_keeps_what_nvsharectl_set(
    harness: Harness,
) -> None:
    """An edit of scheduler.idleRelease is not a word about the mode: `-S off` stays."""
    a = harness.register()
    harness.feed(ev.TimeQuantumSet(45, reply_to=ADMIN))
    harness.feed(ev.ModeSet(Mode.OFF, reply_to=ADMIN))
    edited = Policy(scheduler=SchedulerSettings(idle_release_s=3.0))
    harness.feed(ev.PolicyChanged(edited))
    assert harness.state.gpu_mode(GPU) is Mode.OFF and harness.enforced(a).mode is Mode.OFF
    assert harness.state.time_quantum(GPU) == 45
    assert not harness.state.overrides.dropped


def test_a_reload_that_changes_the_policys_quantum_replaces_only_nvsharectls_quantum(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvshare.scheduler")
    harness.register()
    harness.feed(ev.TimeQuantumSet(45, reply_to=ADMIN))
    harness.feed(ev.ModeSet(Mode.AUTO, GPU, reply_to=ADMIN))
    harness.feed(ev.PolicyChanged(Policy(scheduler=SchedulerSettings(time_quantum_s=12))))
    assert harness.state.time_quantum(GPU) == 12 and harness.state.gpu_mode(GPU) is Mode.AUTO
    why = "a policy reload changed the policy's time quantum (scheduler.timeQuantum 30s -> 12s)"
    assert list(harness.state.overrides.dropped) == [
        DroppedOverride("time quantum 45 s on every GPU", why, harness.now)
    ]
    assert f"{why}, so it replaces what nvsharectl set: time quantum 45 s on every GPU" in (
        caplog.text
    )


def test_a_reload_that_changes_the_policys_mode_replaces_nvsharectls_mode() -> None:
    h = Harness(NodeCore(Policy(), inventory={OTHER: GpuFacts(uuid=OTHER, index=1)}))
    h.register()
    h.feed(ev.ModeSet(Mode.OFF, OTHER, reply_to=ADMIN))
    h.feed(ev.ModeSet(Mode.AUTO, GPU, reply_to=ADMIN))
    # a `gpus` rule gives GPU 1 its own mode: the override there gives way, GPU's stays
    rule = GpuRule(GpuMatch(index=1), mode=Mode.AUTO)
    h.feed(ev.PolicyChanged(Policy(gpus=(rule,))))
    assert h.state.overrides.modes == {GPU: Mode.AUTO} and h.state.gpu_mode(OTHER) is Mode.AUTO
    (dropped,) = h.state.overrides.dropped
    assert dropped.what == f"mode off on GPU 1 ({OTHER})"
    assert dropped.why == f"a policy reload changed the policy's mode (GPU 1 ({OTHER}) on -> auto)"
    # one set on every GPU gives way to a change of the policy's mode on any GPU
    h.feed(ev.ModeSet(Mode.OFF, reply_to=ADMIN))
    h.feed(ev.PolicyChanged(Policy(scheduler=SchedulerSettings(mode=Mode.AUTO))))
    assert h.state.overrides.modes == {} and h.state.gpu_mode(GPU) is Mode.AUTO
    assert h.state.overrides.dropped[-1].what == "mode off on every GPU"
    assert h.state.overrides.dropped[-1].why == (
        "a policy reload changed the policy's mode (scheduler.mode on -> auto)"
    )


def test_a_pid_that_is_not_connected_is_refused(harness: Harness) -> None:
    harness.register(pid=500)
    answer = reply(
        harness.feed(
            ev.AdminLimitSet(LimitTarget.pid(999999), Limits(memory_bytes=GiB), reply_to=ADMIN)
        )
    )
    assert answer.outcome is act.Outcome.NOT_FOUND
    assert answer.message.startswith("no connected client has pid 999999; nothing changed")
    assert harness.state.overrides.limits == {}


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(memory_bytes=0), "a memory limit must be greater than 0"),
        (Limits(memory_bytes=(1 << 60) + 1), "at most 1Ei"),
        (Limits(core_percent=0), "core limit 0 is outside 1-100"),
        (Limits(core_percent=101), "core limit 101 is outside 1-100"),
    ],
)
def test_an_override_that_means_nothing_is_refused(
    harness: Harness, limits: Limits, message: str
) -> None:
    harness.register(pid=500)
    answer = reply(harness.feed(ev.AdminLimitSet(LimitTarget.pid(500), limits, reply_to=ADMIN)))
    assert answer.outcome is act.Outcome.INVALID and message in answer.message
    assert answer.message.endswith("nothing changed") and harness.state.overrides.limits == {}


def test_an_override_says_what_changed_and_whom_it_reaches(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvshare.scheduler")
    harness.register(pid=500)
    target = LimitTarget.pid(500)
    out = harness.feed(
        ev.AdminLimitSet(target, Limits(memory_bytes=4 * GiB), by="pid 9 (uid 0)", reply_to=ADMIN)
    )
    assert reply(out).message == (
        "pid 500: memory override 4Gi (was none); applies to 1 connected client(s), pid 500"
    )
    assert "pid 9 (uid 0) changed the limits of pid 500: memory override 4Gi (was none)" in (
        caplog.text
    )
    out = harness.feed(ev.AdminLimitSet(target, Limits(core_percent=50), reply_to=ADMIN))
    assert reply(out).message.startswith("pid 500: core override 50% (was none);")
    out = harness.feed(ev.AdminLimitSet(target, Limits(memory_bytes=4 * GiB), reply_to=ADMIN))
    assert reply(out).message == "pid 500 already has memory 4Gi, core 50%; no change"
    out = harness.feed(
        ev.AdminLimitSet(target, Limits(), clear_memory=True, clear_core=True, reply_to=ADMIN)
    )
    assert reply(out).message.startswith(
        "pid 500: memory override none (was 4Gi), core override none (was 50%);"
    )
    out = harness.feed(
        ev.AdminLimitSet(target, Limits(), clear_memory=True, clear_core=True, reply_to=ADMIN)
    )
    assert reply(out).outcome is act.Outcome.NOT_FOUND
    assert reply(out).message == (
        "nothing was set for pid 500: it has no memory or core override to clear; nothing changed"
    )


def test_an_override_under_a_lower_env_limit_says_the_env_limit_wins(harness: Harness) -> None:
    a = harness.register(pid=500, env_mem=1 * GiB)
    out = harness.feed(
        ev.AdminLimitSet(LimitTarget.pid(500), Limits(memory_bytes=4 * GiB), reply_to=ADMIN)
    )
    assert reply(out).message.endswith(
        "pid 500's own NVSHARE_GPU_MEMORY_LIMIT=1Gi is lower and still applies"
    )
    assert harness.enforced(a).memory_bytes == 1 * GiB


def test_a_pid_override_ends_with_its_process(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvshare.scheduler")
    a = harness.register(pid=500)
    b = harness.register(pid=500, gpu=OTHER)  # the same process on a second GPU
    harness.feed(
        ev.AdminLimitSet(LimitTarget.pid(500), Limits(memory_bytes=4 * GiB), reply_to=ADMIN)
    )
    harness.feed(ev.ClientGone(a))
    assert LimitTarget.pid(500) in harness.state.overrides.limits  # still connected through b
    harness.feed(ev.ClientGone(b))
    assert harness.state.overrides.limits == {}
    assert "dropped the nvsharectl override of pid 500" in caplog.text
    reused = harness.register(pid=500)  # a new process that got the same pid
    assert harness.enforced(reused).memory_bytes is None


def test_a_pod_override_waits_for_its_pod_and_says_so() -> None:
    harness = Harness(NodeCore(Policy(), watching_pods=True))
    out = harness.feed(
        ev.AdminLimitSet(
            LimitTarget.pod("ml", "trainer"), Limits(memory_bytes=2 * GiB), reply_to=ADMIN
        )
    )
    assert reply(out).outcome is act.Outcome.DONE
    assert reply(out).message.endswith(
        "no client of that pod is connected yet; the override waits for it"
    )
    assert harness.core.overrides().limits == (
        OverrideRow(target="pod ml/trainer", memory_limit=2 * GiB, core_limit=None, clients=()),
    )


def pod_limit(h: Harness, memory: int) -> act.Reply:
    target = LimitTarget.pod("ml", "trainer")
    return reply(h.feed(ev.AdminLimitSet(target, Limits(memory_bytes=memory), reply_to=ADMIN)))


def test_without_a_pod_watch_a_trusted_claim_is_the_pod_an_override_waits_for() -> None:
    """A workstation's way to group processes: one answer, and the override then holds."""
    h = Harness(NodeCore(Policy(trust=TrustSettings(pod_claim_uids=frozenset({1000})))))
    answer = pod_limit(h, 1 * GiB)
    assert answer.outcome is act.Outcome.DONE
    assert answer.message.endswith(
        "no process claims that pod yet; the override waits for one (without a pod watch, a "
        "process of a uid in trust.podClaimUids that names the pod through "
        "NVSHARE_POD_NAMESPACE/NVSHARE_POD_NAME is of it, and shares its ledger)"
    )
    a = h.register(claimed_namespace="ml", claimed_pod="trainer")
    b = h.register(claimed_namespace="ml", claimed_pod="trainer")
    stranger = h.register(uid=1001, claimed_namespace="ml", claimed_pod="trainer")
    assert h.enforced(a).memory_bytes == h.enforced(b).memory_bytes == 1 * GiB
    assert h.enforced(stranger).memory_bytes is None  # an untrusted uid's claim counts for nothing
    assert h.state.subject(h.state.clients[a]) == h.state.subject(h.state.clients[b])
    assert h.state.pod_label(h.state.clients[a]) == "ml/trainer (claimed)"
    assert pod_limit(h, 2 * GiB).message.endswith("applies to 2 connected client(s), pid 101, 102")


def test_without_a_pod_watch_or_trusted_claims_a_pod_override_is_refused() -> None:
    h = Harness(NodeCore(Policy()))
    answer = pod_limit(h, 1 * GiB)
    assert answer.outcome is act.Outcome.NOT_FOUND
    assert answer.message == (
        "no process can be of pod ml/trainer: this daemon watches no pods (no --node-name) and "
        "its policy trusts no uid's pod claims (trust.podClaimUids); nothing changed"
    )
    assert h.core.overrides().limits == ()
