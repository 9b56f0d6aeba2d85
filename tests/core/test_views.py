"""What nvsharectl and /metrics are shown: typed views that survive the trip through JSON, and a
collector that reads the same view as `nvsharectl status`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.core import events as ev
from appliance.core import views
from appliance.core.events import LimitTarget
from appliance.core.node import NodeCore
from appliance.policy.model import Limits, Mode, Policy
from appliance.web.metrics import ApplianceCollector

from .conftest import ADMIN, GPU, GiB, Harness


@pytest.fixture
def busy(harness: Harness) -> Harness:
    a, b = harness.register(pid=10), harness.register(pid=11)
    harness.feed(ev.LockRequested(a, 1))
    harness.feed(ev.LockRequested(b, 2))
    harness.feed(ev.MemoryReserveRequested(a, 3, GiB, GiB))
    harness.feed(ev.ModeSet(Mode.AUTO, GPU, reply_to=ADMIN))
    harness.feed(ev.AdminLimitSet(LimitTarget.pid(10), Limits(core_percent=50), reply_to=ADMIN))
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
    assert (
        f'nvshare_client_core_limit_percent{{client_id="1",gpu_uuid="{GPU}",namespace="",pod=""}}'
        in text
    )
    assert "nvshare_scheduler_grants_total 2.0" in text
    assert 'nvshare_scheduler_releases_total{reason="undrained"} 0.0' in text


def scrape(h: Harness, **bounds: int) -> str:
    registry = CollectorRegistry()
    registry.register(ApplianceCollector(lambda: h.core.status(h.now), **bounds))
    return generate_latest(registry).decode()


def value(text: str, name: str, **labels: str) -> float | None:
    """The sample of `name` with exactly these labels, None if there is none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def test_metrics_show_gpu_time_per_client_and_pod_and_nvmls_view() -> None:
    h = Harness(NodeCore(Policy(defaults=Limits(memory_bytes=GiB))))
    a = h.register(pid=10, pod_uid="uid-a")
    b = h.register(pid=11)
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 2))
    h.advance(30.0)  # a's quantum is over: dropped
    h.advance(0.5)
    h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
    h.feed(ev.MemoryRefusedByHook(a, 3, 2 * GiB))
    h.feed(
        ev.GpuFreeMemory(
            {GPU: 60 * GiB}, {GPU: {10: GiB}}, used={GPU: 20 * GiB}, utilization={GPU: 37}
        )
    )
    text = scrape(h)
    la = {"client_id": "1", "gpu_uuid": GPU, "namespace": "ns", "pod": "uid-a"}
    lb = {"client_id": "2", "gpu_uuid": GPU, "namespace": "", "pod": ""}
    gpu = {"gpu_uuid": GPU, "gpu_index": ""}
    assert value(text, "nvshare_client_lock_held_seconds_total", **la) == 30.5
    assert value(text, "nvshare_client_lock_wait_seconds_total", **lb) == 30.5
    assert value(text, "nvshare_client_drops_total", **la, reason="quantum") == 1
    assert value(text, "nvshare_client_drops_total", **la, reason="quota") == 0
    assert value(text, "nvshare_client_info", **la, gpu_index="", host_pid="10") == 1
    assert value(text, "nvshare_client_nvml_used_bytes", **la, host_pid="10") == GiB
    assert value(text, "nvshare_client_nvml_used_bytes", **lb, host_pid="11") is None
    assert value(text, "nvshare_client_managed_allocated_bytes", **la) == 0
    assert value(text, "nvshare_client_memory_refusals_total", **la) == 3
    assert value(text, "nvshare_pod_lock_held_seconds_total", namespace="ns", pod="uid-a") == 30.5
    assert value(text, "nvshare_scheduler_memory_refusals_total", decided_by="hook") == 3
    assert value(text, "nvshare_gpu_utilization_ratio", **gpu) == 0.37
    assert value(text, "nvshare_gpu_memory_used_bytes", **gpu) == 20 * GiB
    assert value(text, "nvshare_scheduler_running_clients", **gpu) == 1


def test_no_limit_is_no_sample_and_departed_clients_take_their_series_along() -> None:
    h = Harness(NodeCore(Policy()))
    a = h.register(pid=10, pod_uid="uid-a")
    h.feed(ev.LockRequested(a, 1))
    h.advance(2.0)
    assert "nvshare_client_memory_limit_bytes{" not in scrape(h)  # no limit: no sample, not 0
    h.feed(ev.ClientGone(a))
    text = scrape(h)
    assert 'client_id="1"' not in text
    assert value(text, "nvshare_pod_lock_held_seconds_total", namespace="ns", pod="uid-a") == 2
    assert value(text, "nvshare_pod_clients", namespace="ns", pod="uid-a") == 0


def test_series_are_bounded_and_what_is_left_out_is_counted() -> None:
    h = Harness(NodeCore(Policy()))
    for i in range(5):
        h.register(pod_uid=f"uid-{i}")
    text = scrape(h, max_clients=3, max_pods=2)
    assert text.count("nvshare_client_info{") == 3
    assert text.count("nvshare_pod_clients{") == 2
    assert value(text, "nvshare_metrics_series_omitted", kind="client") == 2
    assert value(text, "nvshare_metrics_series_omitted", kind="pod") == 3
