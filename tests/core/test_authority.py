"""Authority from the node: host processes run by root or the admin group change state; a
process in a pod is a tenant whatever its uid, and nobody else may either."""

from __future__ import annotations

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.authority import Authority
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.policy.model import Limits, Policy

from .conftest import Harness

POD = "0b1c5e5e-1111-2222-3333-444455556666"
DAEMON_POD = "0b1c5e5e-9999-8888-7777-666655554444"


def ask(h: Harness, ident: ClientIdentity | None) -> act.Reply:
    [reply, *_] = h.feed(ev.TimeQuantumSet(12, by="someone", reply_to=ev.Requester(7, 3, ident)))
    assert isinstance(reply, act.Reply) and reply.to.seq == 3
    return reply


@pytest.fixture
def h() -> Harness:
    authority = Authority(admin_group="gpu-admins", own_pod_uid=DAEMON_POD)
    return Harness(NodeCore(Policy(), authority=authority))


def test_root_on_the_host_may(h: Harness) -> None:
    assert ask(h, ClientIdentity(pid=1, uid=0, gid=0)).outcome is act.Outcome.DONE
    assert h.state.overrides.time_quantum_s == 12


def test_root_in_a_pod_is_a_tenant(h: Harness) -> None:
    reply = ask(h, ClientIdentity(pid=9, uid=0, gid=0, pod_uid=POD))
    assert reply.outcome is act.Outcome.REFUSED
    assert reply.message == (
        f"pid 9 runs in pod {POD}: a process in a pod is a tenant whatever its uid and may not "
        "set the time quantum; nothing changed"
    )
    assert h.state.overrides.time_quantum_s is None


def test_the_daemons_own_pod_counts_as_the_host(h: Harness) -> None:
    reply = ask(h, ClientIdentity(pid=9, uid=0, gid=0, pod_uid=DAEMON_POD))
    assert reply.outcome is act.Outcome.DONE


def test_the_admin_group_may_from_the_host_only(h: Harness) -> None:
    admin = ClientIdentity(pid=5, uid=1001, gid=1001, groups=frozenset({"gpu-admins"}))
    assert ask(h, admin).outcome is act.Outcome.DONE
    in_pod = ClientIdentity(pid=5, uid=1001, gid=1001, groups=admin.groups, pod_uid=POD)
    assert ask(h, in_pod).outcome is act.Outcome.REFUSED


def test_anyone_else_is_refused_saying_who_may(h: Harness) -> None:
    reply = ask(h, ClientIdentity(pid=5, uid=1001, gid=1001))
    assert reply.outcome is act.Outcome.REFUSED
    assert reply.message == (
        "only root or members of group 'gpu-admins' may set the time quantum; nothing changed"
    )


def test_an_unknown_place_or_no_asker_is_refused(h: Harness) -> None:
    unplaced = ClientIdentity(pid=5, uid=0, gid=0, cgroup_known=False)
    assert "could not be read" in ask(h, unplaced).message
    assert ask(h, None).outcome is act.Outcome.REFUSED
    assert h.state.overrides.time_quantum_s is None


def test_every_state_change_is_guarded(h: Harness) -> None:
    tenant = ev.Requester(1, 1, ClientIdentity(pid=9, uid=0, gid=0, pod_uid=POD))
    for event in (
        ev.ModeSet(None, reply_to=tenant),
        ev.AdminLimitSet(ev.LimitTarget.pod("a", "b"), Limits(), reply_to=tenant),
    ):
        [reply] = h.feed(event)
        assert isinstance(reply, act.Reply) and reply.outcome is act.Outcome.REFUSED


def test_a_daemon_a_user_started_answers_to_that_user() -> None:
    """A workstation user's own daemon (no root) used to refuse its owner's `nvsharectl -T`."""
    h = Harness(NodeCore(Policy(), authority=Authority(daemon_uid=1000)))
    assert ask(h, ClientIdentity(pid=5, uid=1000, gid=1000)).outcome is act.Outcome.DONE
    assert h.state.overrides.time_quantum_s == 12
    assert ask(h, ClientIdentity(pid=6, uid=0, gid=0)).outcome is act.Outcome.DONE
    other = ask(h, ClientIdentity(pid=7, uid=1001, gid=1001))
    assert other.message == (
        "only root or the daemon's own user (uid 1000) may set the time quantum; nothing changed"
    )


def test_the_daemons_own_user_in_a_pod_is_still_a_tenant() -> None:
    h = Harness(NodeCore(Policy(), authority=Authority(daemon_uid=1000)))
    reply = ask(h, ClientIdentity(pid=9, uid=1000, gid=1000, pod_uid=POD))
    assert reply.outcome is act.Outcome.REFUSED and "is a tenant whatever its uid" in reply.message
    assert h.state.overrides.time_quantum_s is None
