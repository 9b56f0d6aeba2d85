"""Fixtures for the Kubernetes tests: a running fake API server and clients bound to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import manifests
import pytest
from fakeapi import FakeApiServer
from kubernetes import client


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    """A fresh fake API server on a free port (namespaces default and kube-system exist)."""
    fake = FakeApiServer(bookmark_interval_s=60.0).start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def api_client(fake_api: FakeApiServer) -> Iterator[client.ApiClient]:
    """A real `kubernetes` ApiClient talking to `fake_api`."""
    cfg = client.Configuration(host=fake_api.url)
    api = client.ApiClient(cfg)
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def service_account_client(
    fake_api: FakeApiServer,
) -> Iterator[Callable[[str], client.ApiClient]]:
    """`make("nvshare-webhook")`: an ApiClient with that nvshare-system service account's token.

    The fake enforces the RBAC of the rendered deploy/ manifests for it, as a cluster would.
    """
    fake_api.load_rbac(list(manifests.rendered()))
    made: list[client.ApiClient] = []

    def make(name: str) -> client.ApiClient:
        cfg = client.Configuration(host=fake_api.url)
        cfg.api_key = {"authorization": fake_api.token_for("nvshare-system", name)}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        made.append(client.ApiClient(cfg))
        return made[-1]

    yield make
    for api in made:
        api.close()
