"""What nvsharectl and /metrics are shown: typed views that survive the trip through JSON, and a
collector that reads the same view as `nvsharectl status`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from appliance.core import events as ev
from appliance.core import views
from appliance.core.events import LimitTarget
from appliance.metrics import ApplianceCollector
from appliance.policy.model import Limits, Mode

from .conftest import GPU, GiB, Harness


@pytest.fixture
def busy(harness: Harness) -> Harness:
    a, b = harness.register(pid=10), harness.register(pid=11)
    harness.feed(ev.LockRequested(a, 1))
    harness.feed(ev.LockRequested(b, 2))
    harness.feed(ev.MemoryReserveRequested(a, 3, GiB, GiB))
    harness.feed(ev.ModeSet(Mode.AUTO, GPU))
    harness.feed(ev.AdminLimitSet(LimitTarget.pid(10), Limits(core_percent=50)))
    return harness


def test_status_overrides_and_explain_survive_the_json_the_cli_reads(busy: Harness) -> None:
    policy = views.PolicyStatus(
        "/etc/nvshare/policy.d", "ab" * 32, ("10-a.yaml",), True, True, None, 1.5, {}, {}
    )
    status = dataclasses.replace(busy.core.status(busy.now), policy=policy, nvml=False)
    answers = [
        status,
        busy.core.overrides(),
        busy.core.explain(views.ExplainQuery(pid=10)),
    ]
    for view in answers:
        sent = json.loads(json.dumps(views.to_json(view)))  # as the socket carries it
        assert views.from_json(type(view), sent) == view


def test_status_says_who_holds_who_waits_and_what_nvsharectl_set(busy: Harness) -> None:
    status = busy.core.status(busy.now + 2)
    (gpu,) = status.gpus
    assert (gpu.mode, gpu.mode_source, gpu.holders) == (Mode.AUTO, "nvsharectl", (1, 2))
    first = status.clients[0]
    assert (first.pid, first.core_limit, first.memory_reserved) == (10, 50, GiB)
    assert first.limits_from["core"] == "nvsharectl limit set"


def test_a_bad_explain_request_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(views.QueryError, match="give exactly one of pid and pod"):
        views.ExplainQuery.from_request({"pid": 3, "pod": "a/b"})
    with pytest.raises(views.QueryError, match="pid must be a positive whole number"):
        views.ExplainQuery.from_request({"pid": True})


def test_metrics_read_the_status_view(busy: Harness) -> None:
    registry = CollectorRegistry()
    registry.register(ApplianceCollector(lambda: busy.core.status(busy.now)))
    text = generate_latest(registry).decode()
    assert f'nvshare_gpu_mode{{gpu_uuid="{GPU}"}} 2.0' in text  # auto, as on the wire
    assert f'nvshare_gpu_lock_holders{{gpu_uuid="{GPU}"}} 2.0' in text
    assert 'nvshare_client_core_limit_percent{client_id="1",gpu_uuid="' in text
    assert "nvshare_scheduler_grants_total 2.0" in text
    assert 'nvshare_scheduler_releases_total{reason="undrained"} 0.0' in text
