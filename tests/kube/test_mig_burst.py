"""Seed 004's cluster: 16 pods asking for mig-2g.20gb where only 12 exist, created the ways a
cluster creates them (a controller's slow-start batches, `kubectl create` of a list, all at
once). The webhook must reserve what it admits: every pod past the twelfth falls back to
1g.10gb, and none is left pending on 2g.20gb while 1g.10gb devices are free.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from certs import issue
from fakeapi import FakeApiServer
from kubernetes import client
from mig_cluster import Binder, add_seed_004_nodes, gpu_pod, mig_requests, pods_by_state, slow_start
from test_webhook import (
    Webhook,
    admission_review,
    eventually,
    running,
    start_inventory,
    webhook_configuration,
)

from appliance.cluster.admission_ledger import SEEN_KEEP_S, AdmissionLedger, SharedClaim
from appliance.cluster.mig_inventory import MigInventory
from appliance.cluster.webhook import MigFallbackWebhook
from appliance.cluster.webhook_server import WebhookServer

MIG = "nvidia.com/mig-"
SEED_CHAINS = [["2g.20gb", "1g.10gb"]]
REPLICAS = 16


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def seed_cluster(
    fake_api: FakeApiServer,
    certificate: tuple[Path, Path],
    service_account_client: Callable[[str], client.ApiClient],
) -> Iterator[Webhook]:
    """Seed 004's nodes, and the webhook registered with the fake API server as deployed."""
    add_seed_004_nodes(fake_api)
    inventory = start_inventory(service_account_client("nvshare-webhook"))
    server = WebhookServer(
        webhook=MigFallbackWebhook(chains=lambda: SEED_CHAINS, capacity=inventory),
        cert_file=certificate[0],
        key_file=certificate[1],
        host="127.0.0.1",
        port=0,
    )
    eventually(lambda: inventory.synced, "the caches synced")
    for webhook in running(server, certificate[0]):
        fake_api.admission.register(
            webhook_configuration(certificate[0]), address=("127.0.0.1", server.port)
        )
        try:
            yield webhook
        finally:
            fake_api.admission.close()
            inventory.stop()


def settle(fake_api: FakeApiServer) -> dict[str, list[dict[str, Any]]]:
    binder = Binder(fake_api)
    while binder.bind_pending():
        pass
    return pods_by_state(fake_api)


def profiles(pods: list[dict[str, Any]]) -> dict[str, int]:
    count: dict[str, int] = {}
    for pod in pods:
        for resource in mig_requests(pod):
            count[resource] = count.get(resource, 0) + 1
    return count


def assert_nothing_pends_beside_a_free_fallback(fake_api: FakeApiServer) -> None:
    state = settle(fake_api)
    assert state["pending"] == [], profiles(state["pending"])
    assert profiles(state["bound"]) == {MIG + "2g.20gb": 12, MIG + "1g.10gb": 4}
    fell_back = [
        p
        for p in state["bound"]
        if (p["metadata"].get("annotations") or {}).get("nvshare.com/mig-fallback")
    ]
    assert len(fell_back) == 4
    assert {p["metadata"]["annotations"]["nvshare.com/mig-fallback"] for p in fell_back} == {
        "2g.20gb->1g.10gb"
    }


def test_slow_start_batches_with_a_binder_running_leave_nothing_pending(
    fake_api: FakeApiServer, seed_cluster: Webhook, api_client: client.ApiClient
) -> None:
    core = client.CoreV1Api(api_client)
    binder = Binder(fake_api).start()
    try:
        batches = slow_start(REPLICAS, lambda: core.create_namespaced_pod("default", gpu_pod()))
    finally:
        binder.stop()
    assert batches == [1, 2, 4, 8, 1]
    assert_nothing_pends_beside_a_free_fallback(fake_api)


def create_at_once(fake_api: FakeApiServer, count: int) -> None:
    """`count` pods created by as many threads released together, before any is bound."""
    cfg = client.Configuration(host=fake_api.url)
    cfg.connection_pool_maxsize = count
    core = client.CoreV1Api(client.ApiClient(cfg))
    start = threading.Barrier(count)

    def create() -> object:
        start.wait()
        return core.create_namespaced_pod("default", gpu_pod())

    with ThreadPoolExecutor(max_workers=count) as pool:
        for future in [pool.submit(create) for _ in range(count)]:
            future.result()
    core.api_client.close()


def test_a_burst_of_concurrent_creates_before_any_binding_leaves_nothing_pending(
    fake_api: FakeApiServer, seed_cluster: Webhook
) -> None:
    create_at_once(fake_api, REPLICAS)
    assert len(pods_by_state(fake_api)["pending"]) == REPLICAS  # nothing bound yet
    assert_nothing_pends_beside_a_free_fallback(fake_api)


def test_kubectl_create_of_sixteen_pods_leaves_nothing_pending(
    fake_api: FakeApiServer, seed_cluster: Webhook, tmp_path: Path
) -> None:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    # one document per pod: kubectl checks a `kind: List` itself, against /openapi/v2, which
    # the fake API server does not serve (each pod is checked by the server instead)
    manifest = tmp_path / "pods.yaml"
    items = [gpu_pod(generate_name=f"gpu-test-{i}-") for i in range(REPLICAS)]
    manifest.write_text(yaml.safe_dump_all(items))
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "absent"), "HOME": str(tmp_path)}
    done = subprocess.run(
        [exe, f"--server={fake_api.url}", "create", "-f", str(manifest)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("created") == REPLICAS
    assert_nothing_pends_beside_a_free_fallback(fake_api)


@pytest.fixture
def inventory(
    fake_api: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> Iterator[tuple[MigInventory, list[float]]]:
    """An inventory over seed 004's nodes, with a clock the test moves."""
    add_seed_004_nodes(fake_api)
    now = [1000.0]
    inventory = start_inventory(
        service_account_client("nvshare-webhook"), clock=lambda: now[0], admission_ttl_s=30.0
    )
    eventually(lambda: inventory.synced, "the caches synced")
    try:
        yield inventory, now
    finally:
        inventory.stop()


def free_2g(inventory: MigInventory) -> int:
    return sum(f.get(MIG + "2g.20gb", 0) for f in inventory.free_per_node().values())


def test_an_admission_whose_pod_never_appears_is_released_after_its_ttl(
    inventory: tuple[MigInventory, list[float]],
) -> None:
    mig, now = inventory
    mig.reserve(admission="a1", pod=gpu_pod(), namespace="default")
    assert free_2g(mig) == 11
    now[0] += 29.0
    assert free_2g(mig) == 11
    now[0] += 1.0
    assert free_2g(mig) == 12 and mig.admissions_pending() == 0


def test_the_informer_takes_an_admission_over_and_a_deleted_pod_frees_it(
    fake_api: FakeApiServer, inventory: tuple[MigInventory, list[float]]
) -> None:
    mig, now = inventory
    pod = gpu_pod()
    mig.reserve(admission="a1", pod=pod, namespace="default")
    created = fake_api.store.create("pods", "default", {**pod, "status": {"phase": "Pending"}})
    name = created["metadata"]["name"]
    eventually(lambda: mig.admissions_pending() == 0, "the pod took its admission over")
    assert free_2g(mig) == 11
    now[0] += 3600.0  # the pod, not the admission, holds the device now: no expiry
    assert free_2g(mig) == 11
    # Bound elsewhere than the model placed it: the claim moves to that node.
    fake_api.update(
        "pods",
        name,
        lambda o: {**o, "spec": {**o["spec"], "nodeName": "gpu-sim-medium"}},
        namespace="default",
    )
    eventually(
        lambda: mig.free_per_node()["gpu-sim-medium"][MIG + "2g.20gb"] == 11, "bound on medium"
    )
    fake_api.delete("pods", name, namespace="default")
    eventually(lambda: free_2g(mig) == 12, "the deleted pod's device freed")


def test_two_replicas_answering_one_burst_admit_no_more_than_is_free(
    fake_api: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    """Seed 004's 16 pods reviewed by two webhook replicas at once, before any pod exists: each
    replica's informer shows nothing of the other's admissions, so each used to keep all 12
    2g.20gb for its own half. The shared ledger (a ConfigMap written under its resourceVersion)
    makes exactly 12 keep the profile and 4 fall back."""
    add_seed_004_nodes(fake_api)
    fake_api.store.create("namespaces", "", {"metadata": {"name": "nvshare-system"}})
    replicas = []
    for _ in range(2):
        api = service_account_client("nvshare-webhook")  # RBAC as deploy/ renders it
        ledger = AdmissionLedger(api_client=api, namespace="nvshare-system")
        inventory = start_inventory(api, ledger=ledger)
        replicas.append(
            (inventory, MigFallbackWebhook(chains=lambda: SEED_CHAINS, capacity=inventory))
        )
    try:
        eventually(lambda: all(i.synced for i, _ in replicas), "both replicas' caches synced")
        start = threading.Barrier(REPLICAS)

        def review(n: int) -> dict[str, Any]:
            body = admission_review(gpu_pod())
            body["request"]["uid"] = f"review-{n}"
            start.wait()
            return dict(replicas[n % 2][1].review(body)["response"])

        with ThreadPoolExecutor(max_workers=REPLICAS) as pool:
            responses = list(pool.map(review, range(REPLICAS)))
    finally:
        for inventory, _ in replicas:
            inventory.stop()
    patches = [json.loads(base64.b64decode(r["patch"])) for r in responses]
    fell_back = [p for p in patches if any(op["op"] == "remove" for op in p)]
    assert len(fell_back) == 4 and all("warnings" not in r for r in responses)
    # every held admission is marked on its pod, so an informer retires its claim
    marks = [op for p in patches for op in p if "mig-admission" in json.dumps(op)]
    assert len(marks) == REPLICAS
    ledger = fake_api.get("configmaps", "nvshare-mig-admissions", namespace="nvshare-system")
    assert len(ledger["data"]) == REPLICAS


def test_two_replicas_behind_one_service_leave_nothing_pending_in_a_burst(
    fake_api: FakeApiServer,
    certificate: tuple[Path, Path],
    service_account_client: Callable[[str], client.ApiClient],
) -> None:
    """As deployed: two webhook replicas, each with its own caches, behind one Service (the API
    server spreads its connections over both), and 16 pods created at once. Without the shared
    ledger each replica admitted its half onto the same 12 free 2g.20gb."""
    add_seed_004_nodes(fake_api)
    fake_api.store.create("namespaces", "", {"metadata": {"name": "nvshare-system"}})
    inventories, servers = [], []
    for _ in range(2):
        api = service_account_client("nvshare-webhook")
        inventory = start_inventory(
            api, ledger=AdmissionLedger(api_client=api, namespace="nvshare-system")
        )
        inventories.append(inventory)
        servers.append(
            WebhookServer(
                webhook=MigFallbackWebhook(chains=lambda: SEED_CHAINS, capacity=inventory),
                cert_file=certificate[0],
                key_file=certificate[1],
                host="127.0.0.1",
                port=0,
            )
        )
    eventually(lambda: all(i.synced for i in inventories), "both replicas' caches synced")
    # Their watches fall silent: neither replica sees the other's pods appear (the window a
    # burst fills, held open), so only the shared ledger can tell them apart.
    assert fake_api.stall_open_watches() >= 4
    serve = contextlib.contextmanager(running)
    with serve(servers[0], certificate[0]), serve(servers[1], certificate[0]):
        fake_api.admission.register(
            webhook_configuration(certificate[0]),
            address=("127.0.0.1", servers[0].port),
            replicas=[("127.0.0.1", servers[1].port)],
        )
        try:
            create_at_once(fake_api, REPLICAS)
        finally:
            fake_api.admission.close()
            for inventory in inventories:
                inventory.stop()
    assert fake_api.admission.connections >= 2  # connections alternate: both replicas answered
    assert_nothing_pends_beside_a_free_fallback(fake_api)


def test_the_ledger_drops_claims_whose_pods_are_shown_and_those_expired(
    fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.store.create("namespaces", "", {"metadata": {"name": "nvshare-system"}})
    now = [1000.0]
    ledger = AdmissionLedger(
        api_client=api_client, namespace="nvshare-system", clock=lambda: now[0]
    )
    devices = ((MIG + "2g.20gb", 1),)

    def claim(uid: str, ttl: float = 30.0) -> Callable[[list[SharedClaim]], SharedClaim]:
        return lambda claims: SharedClaim(uid, devices, now[0] + ttl, admitted=now[0])

    def held() -> set[str]:
        cm = fake_api.get("configmaps", "nvshare-mig-admissions", namespace="nvshare-system")
        return set(cm["data"])

    shown = {"a"}
    ledger.admit(claim("a"), seen=shown.__contains__)
    ledger.admit(claim("b", ttl=3.0), seen=shown.__contains__)
    counted: list[list[str]] = []
    ledger.admit(
        lambda claims: counted.append([c.admission for c in claims]) or None,
        seen=shown.__contains__,
    )
    assert counted == [["b"]] and held() == {"a", "b"}  # a's pod is shown: counted no more
    now[0] += 4.0  # b expired; a is kept a while for replicas whose caches lag
    ledger.admit(claim("c"), seen=shown.__contains__)
    assert held() == {"a", "c"}
    now[0] += SEEN_KEEP_S
    ledger.admit(claim("d"), seen=shown.__contains__)
    assert held() == {"c", "d"}
