"""RBAC refusals are remembered until granted, named in the log once, and shown by /readyz."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import manifests
import pytest
from extender_client import eventually
from fakeapi import FakeApiServer
from kubernetes import client

from appliance.cluster.mig_inventory import MigInventory
from appliance.cluster.webhook_server import PolicyChains
from appliance.core.annotations import PodRef
from appliance.kube.access import Permission, Permissions
from appliance.kube.recorder import EventRecorder


def test_an_event_refused_by_rbac_is_missing_until_a_review_says_it_is_allowed(
    fake_api: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_api.load_rbac(manifests.rendered_without("nvshare-node", "events", "create"))
    api = service_account_client("nvshare-node")
    permissions = Permissions(api, recheck_s=0.1)
    recorder = EventRecorder(api, node_name="gpu-node-1", permissions=permissions)
    meta = fake_api.add_pod("trainer", node="gpu-node-1")["metadata"]
    try:
        recorder.warn(PodRef(meta["uid"], "default", "trainer"), "Test", "something to say")
        assert recorder.flush()
        assert permissions.missing() == [Permission("create", "events", "default")]
        assert fake_api.store.list("events", "default")[0] == []
        [said] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert "RBAC forbids create events in namespace default" in said  # one line, not two
        # Nothing retries an Event, so the fixed role is found by asking the API server.
        fake_api.load_rbac(list(manifests.rendered()))
        eventually(lambda: permissions.missing() == [], "the refusal reviewed away")
    finally:
        recorder.close()
        permissions.stop()


def test_the_webhooks_caches_are_unready_while_rbac_forbids_listing_nodes(
    fake_api: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    fake_api.load_rbac(manifests.rendered_without("nvshare-webhook", "nodes", "list"))
    inventory = MigInventory(
        api_client=service_account_client("nvshare-webhook"), backoff=(0.05, 0.2)
    )
    inventory.start()
    try:
        eventually(lambda: "RBAC forbids list nodes" in inventory.not_ready(), "list refused")
        assert "the webhook node cache has not listed yet" in inventory.not_ready()
        assert inventory.unhealthy() == []  # retrying, not dead: a restart would not help
        fake_api.load_rbac(list(manifests.rendered()))
        eventually(lambda: inventory.not_ready() == [], "ready once it may list")
    finally:
        inventory.stop()
    assert inventory.unhealthy() == []  # stopped on purpose


def test_the_webhook_is_unready_until_its_policy_has_loaded(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("migFallback: {chains: nope}\n")
    chains = PolicyChains(tmp_path)
    chains.start()
    try:
        [reason] = chains.not_ready()
        assert f"no valid policy in {tmp_path}" in reason
        (tmp_path / "policy.yaml").write_text("migFallback: {chains: []}\n")
        eventually(lambda: chains.not_ready() == [], "ready once the policy is valid")
    finally:
        chains.stop()
