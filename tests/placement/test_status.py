"""The published GPU status: its document round-trips, bad ones say why, writes are rare."""

from __future__ import annotations

import json

import pytest

from appliance.placement.status import (
    ANNOTATION,
    GpuStatus,
    NodeGpuStatus,
    PublishKind,
    PublishState,
    StatusError,
    decode,
    encode,
    publish_reason,
)
from appliance.policy.model import NodeStatusSettings

MiB = 1 << 20
GiB = 1 << 30
T0 = 1_795_000_000.0
SETTINGS = NodeStatusSettings(
    min_interval_s=5.0, refresh_interval_s=60.0, memory_change_bytes=256 * MiB
)


def gpu(uuid: str = "GPU-a", used: int = 0, processes: int | None = 0, **kw: object) -> GpuStatus:
    fields: dict[str, object] = {
        "uuid": uuid,
        "index": 0,
        "model": "NVIDIA H100 80GB HBM3",
        "memory_total": 80 * GiB,
        "memory_used": used,
        "memory_free": 80 * GiB - used,
        "utilization_percent": 50,
        "compute_processes": processes,
        "healthy": True,
    }
    fields.update(kw)
    return GpuStatus(**fields)  # type: ignore[arg-type]


def node(*gpus: GpuStatus, at: float = T0) -> NodeGpuStatus:
    return NodeGpuStatus(node="gpu-1", sampled_at=at, refresh_s=60.0, gpus=gpus or (gpu(),))


def test_the_annotation_is_namespaced_to_nvshare() -> None:
    assert ANNOTATION == "nvshare.com/gpu-status"


def test_a_status_round_trips_through_its_json_in_whole_mib() -> None:
    status = node(gpu(used=3 * GiB + 1), gpu("GPU-b", processes=None, utilization_percent=None))
    text = encode(status)
    doc = json.loads(text)
    assert doc["version"] == 1 and doc["sampledAt"].endswith("Z")
    assert doc["gpus"][0]["memoryUsedMiB"] == 3 * 1024 + 1  # used rounds up
    assert doc["gpus"][0]["memoryFreeMiB"] == 77 * 1024 - 1  # free rounds down
    back = decode(text)
    assert back.node == "gpu-1" and abs(back.sampled_at - T0) < 0.001
    assert back.gpus[1].compute_processes is None and back.gpus[1].utilization_percent is None
    assert back.gpus[0].memory_total == 80 * GiB
    assert len(text) < 600  # small: it is written to the Node


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"version": 2, "gpus": []}', "version 2 is not 1"),
        ('{"version": 1}', "gpus is missing"),
        ('{"version": 1, "gpus": [], "refreshSeconds": 0}', "not a positive number"),
        (
            '{"version": 1, "gpus": [], "refreshSeconds": 60, "node": "n", "sampledAt": "soon"}',
            "not an RFC 3339 time",
        ),
    ],
)
def test_a_malformed_document_is_an_error_that_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(StatusError, match=says):
        decode(text)


def test_a_gpu_entry_with_impossible_numbers_is_refused() -> None:
    doc = json.loads(encode(node()))
    doc["gpus"][0]["memoryUsedMiB"] = 10**9
    with pytest.raises(StatusError, match=r"gpus\[0\]\.memory"):
        decode(json.dumps(doc))
    doc = json.loads(encode(node()))
    doc["gpus"][0]["computeProcesses"] = True
    with pytest.raises(StatusError, match=r"gpus\[0\]\.computeProcesses is true"):
        decode(json.dumps(doc))


def reason(state: PublishState, current: NodeGpuStatus, now: float) -> PublishKind | None:
    why = publish_reason(state, current, now=now, settings=SETTINGS)
    return None if why is None else why.kind


def test_the_first_sample_is_written_then_nothing_until_something_changes() -> None:
    assert reason(PublishState(), node(), T0) is PublishKind.FIRST
    written = PublishState(written=node(), written_at=T0, attempted_at=T0)
    assert reason(written, node(gpu(used=100 * MiB)), T0 + 10) is None  # small drift
    assert reason(written, node(gpu(used=300 * MiB)), T0 + 10) is PublishKind.CHANGE
    assert reason(written, node(gpu(processes=1)), T0 + 10) is PublishKind.CHANGE
    assert reason(written, node(gpu(healthy=False)), T0 + 10) is PublishKind.CHANGE
    assert reason(written, node(gpu(), gpu("GPU-b")), T0 + 10) is PublishKind.CHANGE


def test_changes_never_write_closer_than_min_interval_even_after_a_failure() -> None:
    written = PublishState(written=node(), written_at=T0, attempted_at=T0)
    busy = node(gpu(used=40 * GiB, processes=1))
    assert reason(written, busy, T0 + 4.9) is None
    assert reason(written, busy, T0 + 5.0) is PublishKind.CHANGE
    failed = PublishState(written=node(), written_at=T0, attempted_at=T0 + 30)
    assert reason(failed, busy, T0 + 33) is None  # the API server is not hammered


def test_small_drifts_add_up_against_what_the_node_says() -> None:
    written = PublishState(written=node(), written_at=T0, attempted_at=T0)
    assert reason(written, node(gpu(used=200 * MiB)), T0 + 10) is None
    assert reason(written, node(gpu(used=260 * MiB)), T0 + 20) is PublishKind.CHANGE


def test_unchanged_status_is_rewritten_when_the_last_write_gets_old() -> None:
    written = PublishState(written=node(), written_at=T0, attempted_at=T0)
    assert reason(written, node(), T0 + 59) is None
    assert reason(written, node(), T0 + 60) is PublishKind.REFRESH
