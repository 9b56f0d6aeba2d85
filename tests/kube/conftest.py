"""Fixtures for the Kubernetes tests: a running fake API server and clients bound to it."""

from __future__ import annotations

from collections.abc import Iterator

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
