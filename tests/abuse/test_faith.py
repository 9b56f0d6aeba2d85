"""Nothing a client says is taken on faith: GPU names it makes up are forgotten, a GPU size it
claims is not believed, and a field out of range closes that client alone."""

from __future__ import annotations

import uuid
from typing import Any

from appliance import protocol as p

from .conftest import GPU, GiB, MiB, Stage


def test_register_and_leave_with_made_up_gpus_leaves_nothing_behind(stage: Stage) -> None:
    stage.start()
    for _ in range(200):
        c = stage.hook()
        made_up = f"GPU-{uuid.uuid4()}"
        assert isinstance(
            c.request(p.Register(pid=0, gpu_uuid=made_up, gpu_total_mem=1)), p.Registered
        )
        c.close()
    stage.registered().close()
    doc = stage.status()
    assert doc["clients"] == [] or all(c["gpu"] == GPU for c in doc["clients"])
    assert [g["uuid"] for g in doc["gpus"]] in ([], [GPU])
    assert stage.output().count("its size is unknown") == 1  # said once, not 200 times


def test_a_tiny_gpu_size_from_the_first_client_binds_no_one(stage: Stage, hooked: Any) -> None:
    stage.start()
    liar = stage.hook()
    liar.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=4 * MiB))
    honest = hooked()
    honest.ok("init")
    honest.ok(f"alloc mem {GiB}")  # not refused by a 4 MiB GPU nobody measured
    assert stage.status()["gpus"][0]["memory_total"] == 0  # unknown, as the log says


def test_a_field_out_of_range_closes_that_client_alone(stage: Stage) -> None:
    stage.start()
    bystander = stage.registered()
    for bad in (
        p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=1, env_core_limit=500),
        p.Register(pid=0, gpu_uuid="GPU-\x01\x02", gpu_total_mem=1),
        p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=1, pod_name="../../etc"),
    ):
        c = stage.hook()
        answer = c.request(bad)
        assert isinstance(answer, p.Result) and answer.status is p.Status.INVALID
        assert c._sock.recv(1) == b""  # closed
    reserver = stage.registered()
    answer = reserver.request(p.MemReserve(0, 0))
    assert isinstance(answer, p.Result) and "0 bytes" in answer.message
    assert reserver._sock.recv(1) == b""
    assert isinstance(bystander.request(p.LockRequest()), p.LockGrant)
