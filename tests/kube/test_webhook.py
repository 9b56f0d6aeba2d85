"""The MIG-fallback webhook over real HTTPS, its caches fed by the fake API server.

The webhook lists and watches with the nvshare-webhook service account's token, so the RBAC of
the rendered deploy/ manifests decides what it may read, as in a cluster.
"""

from __future__ import annotations

import base64
import copy
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import manifests
import pytest
from certs import issue
from fakeapi import FakeApiServer, json_patch
from kubernetes import client

from appliance.cluster.mig_inventory import MigInventory
from appliance.cluster.webhook import (
    OPT_OUT_LABEL,
    OPT_OUT_VALUE,
    Decision,
    MigFallbackWebhook,
    warning_text,
)
from appliance.cluster.webhook_server import PolicyChains, WebhookServer, build_webhook_server

MIG = "nvidia.com/mig-"
CHAINS = [["3g.40gb", "2g.20gb", "1g.10gb"]]
WAIT = 20.0  # a bound for what happens in milliseconds; never a measurement


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return issue(tmp_path_factory.mktemp("tls"))


def eventually(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class Webhook:
    """A running webhook server and an HTTPS client that trusts only its certificate."""

    def __init__(self, server: WebhookServer, cert_file: Path) -> None:
        self.server = server
        self.url = f"https://127.0.0.1:{server.port}/mutate"
        self.tls = ssl.create_default_context(cafile=str(cert_file))

    def post(self, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, context=self.tls, timeout=30) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(
                self.url.replace("/mutate", path), context=self.tls, timeout=30
            ) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    def review(self, pod: dict[str, Any], *, operation: str = "CREATE") -> dict[str, Any]:
        status, payload = self.post(json.dumps(admission_review(pod, operation)).encode())
        assert status == 200
        answer = json.loads(payload)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
        assert answer["response"]["allowed"] is True  # never a rejection
        return dict(answer["response"])


class EverythingFree:
    """A capacity that has every profile free and forgets what it admitted."""

    def admit(self, *, admission: str, namespace: str, decide: Decision) -> dict[str, str]:
        decide(lambda resource, count: True)
        return {}


def admission_review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "namespace": "default",
            "object": pod,
        },
    }


def running(server: WebhookServer, cert_file: Path) -> Iterator[Webhook]:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Webhook(server, cert_file)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def mig_pod(profile: str, count: int = 1, **metadata: Any) -> dict[str, Any]:
    amount = {MIG + profile: str(count)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": "default", **metadata},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "resources": {"limits": dict(amount), "requests": dict(amount)},
                }
            ]
        },
    }


def seed(fake_api: FakeApiServer) -> None:
    """n1 has one 3g.40gb, taken by a running pod; n2 has one free 2g.20gb and two 1g.10gb."""
    fake_api.add_node("n1", status={"allocatable": {MIG + "3g.40gb": "1", "cpu": "64"}})
    fake_api.add_node("n2", status={"allocatable": {MIG + "2g.20gb": "1", MIG + "1g.10gb": "2"}})
    fake_api.add_pod("busy", node="n1", spec=mig_pod("3g.40gb")["spec"])
    fake_api.add_pod("cpu-only", node="n1")


def start_inventory(api: client.ApiClient, **options: Any) -> MigInventory:
    inventory = MigInventory(api_client=api, backoff=(0.05, 0.2), **options)
    inventory.start()
    return inventory


def server_over(inventory: MigInventory, certificate: tuple[Path, Path]) -> WebhookServer:
    """The webhook with CHAINS, answering from `inventory`, ready when it has synced."""
    return WebhookServer(
        webhook=MigFallbackWebhook(chains=lambda: CHAINS, capacity=inventory),
        cert_file=certificate[0],
        key_file=certificate[1],
        host="127.0.0.1",
        port=0,
        not_ready=inventory.not_ready,
        unhealthy=inventory.unhealthy,
        sources=[inventory],
    )


@pytest.fixture
def webhook(
    certificate: tuple[Path, Path],
    fake_api: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
) -> Iterator[Webhook]:
    seed(fake_api)
    inventory = start_inventory(service_account_client("nvshare-webhook"))
    server = server_over(inventory, certificate)
    eventually(lambda: inventory.synced, "the caches synced")
    yield from running(server, certificate[0])


def applied(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["patchType"] == "JSONPatch"
    return json_patch(pod, json.loads(base64.b64decode(response["patch"])))


def test_falls_back_to_the_next_free_profile_and_says_so_on_the_pod(webhook: Webhook) -> None:
    pod = mig_pod("3g.40gb", labels={"app": "train"})
    patched = applied(pod, webhook.review(pod))
    resources = patched["spec"]["containers"][0]["resources"]
    assert resources == {
        "limits": {MIG + "2g.20gb": "1"},
        "requests": {MIG + "2g.20gb": "1"},
    }
    assert patched["metadata"]["annotations"] == {"nvshare.com/mig-fallback": "3g.40gb->2g.20gb"}
    assert patched["metadata"]["labels"] == {"app": "train"}


def test_keeps_existing_annotations_and_skips_profiles_that_are_too_few(webhook: Webhook) -> None:
    pod = mig_pod("3g.40gb", count=2, annotations={"team": "vision"})
    patched = applied(pod, webhook.review(pod))  # n2 has one 2g.20gb but two 1g.10gb
    assert patched["spec"]["containers"][0]["resources"]["limits"] == {MIG + "1g.10gb": "2"}
    assert patched["metadata"]["annotations"] == {
        "team": "vision",
        "nvshare.com/mig-fallback": "3g.40gb->1g.10gb",
    }


def test_the_caches_follow_pods_and_nodes_as_they_change(
    fake_api: FakeApiServer, webhook: Webhook
) -> None:
    inventory = webhook.server.webhook._capacity
    assert isinstance(inventory, MigInventory)

    def finish(pod: dict[str, Any]) -> dict[str, Any]:
        pod["status"]["phase"] = "Succeeded"
        return pod

    fake_api.update("pods", "busy", finish, namespace="default")
    eventually(lambda: inventory.free_per_node()["n1"][MIG + "3g.40gb"] == 1, "busy's 3g freed")
    response = webhook.review(mig_pod("3g.40gb"))
    assert "patch" not in response and "warnings" not in response
    fake_api.add_pod("again", node="n1", spec=mig_pod("3g.40gb")["spec"])
    fake_api.delete("nodes", "n2")
    eventually(lambda: inventory.free_per_node() == {"n1": {MIG + "3g.40gb": 0}}, "n2 gone")
    (warning,) = webhook.review(mig_pod("3g.40gb"))["warnings"]
    assert "not free on any node" in warning


def test_nothing_free_in_the_chain_admits_unchanged_with_a_warning(webhook: Webhook) -> None:
    response = webhook.review(mig_pod("3g.40gb", count=3))
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert MIG + "3g.40gb x3 is not free on any node" in warning
    assert "2g.20gb, 1g.10gb" in warning


@pytest.mark.parametrize(
    ("pod", "operation"),
    [
        (mig_pod("4g.40gb"), "CREATE"),  # in no chain
        (mig_pod("3g.40gb"), "UPDATE"),  # only CREATE is mutated
        (mig_pod("3g.40gb", labels={OPT_OUT_LABEL: OPT_OUT_VALUE}), "CREATE"),  # opted out
        (
            {"kind": "Pod", "metadata": {"name": "cpu"}, "spec": {"containers": [{"name": "c"}]}},
            "CREATE",
        ),
    ],
)
def test_pods_outside_the_policy_pass_untouched(
    webhook: Webhook, pod: dict[str, Any], operation: str
) -> None:
    response = webhook.review(pod, operation=operation)
    assert "patch" not in response and "warnings" not in response


def test_before_the_caches_sync_it_is_not_ready_and_admits_unchanged(
    certificate: tuple[Path, Path], fake_api: FakeApiServer, api_client: client.ApiClient
) -> None:
    fake_api.stop()
    server = server_over(start_inventory(api_client), certificate)
    for webhook in running(server, certificate[0]):
        assert webhook.get("/readyz") == 503 and webhook.get("/healthz") == 200
        response = webhook.review(mig_pod("3g.40gb"))
        assert "patch" not in response
        assert "still being listed" in response["warnings"][0]


def test_its_own_failure_admits_unchanged_with_a_printable_warning(
    certificate: tuple[Path, Path],
) -> None:
    class Broken:
        def admit(self, *, admission: str, namespace: str, decide: Decision) -> dict[str, str]:
            raise RuntimeError("line one\n\x1b[31mred\x1b[0m\tand\x00more" + "x" * 500)

    cert_file, key_file = certificate
    server = WebhookServer(
        webhook=MigFallbackWebhook(chains=lambda: CHAINS, capacity=Broken()),
        cert_file=cert_file,
        key_file=key_file,
        host="127.0.0.1",
        port=0,
    )
    for webhook in running(server, cert_file):
        response = webhook.review(mig_pod("3g.40gb"))
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert warning.isprintable() and len(warning) <= 250
    assert warning.startswith("nvshare MIG fallback skipped (line one [31mred")


def test_warning_text_keeps_words_and_drops_control_characters() -> None:
    assert warning_text("a\r\nb\x07  c") == "a b c"
    assert len(warning_text("y" * 1000)) == 250


def test_a_body_that_is_not_an_admission_review_is_a_400_and_the_server_lives_on(
    webhook: Webhook,
) -> None:
    status, payload = webhook.post(b"{not json")
    assert status == 400 and b"AdmissionReview" in payload
    status, _ = webhook.post(b'{"kind": "AdmissionReview"}')
    assert status == 400
    status, payload = webhook.post(b"[" * 100_000 + b"]" * 100_000)  # used to kill the thread
    assert status == 400 and b"nested deeper than 100 levels" in payload
    huge = http.client.HTTPSConnection("127.0.0.1", webhook.server.port, context=webhook.tls)
    huge.putrequest("POST", "/mutate")
    huge.putheader("Content-Length", str(1 << 40))  # refused before a byte of it is read
    huge.endheaders()
    answer = huge.getresponse()
    assert answer.status == 413 and b"at most 3145728" in answer.read()
    huge.close()
    assert "patch" in webhook.review(mig_pod("3g.40gb"))


def test_a_device_count_that_is_no_count_admits_the_pod_unchanged(
    webhook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    pod = mig_pod("3g.40gb")
    pod["spec"]["containers"][0]["resources"]["limits"][MIG + "3g.40gb"] = "1ki"
    response = webhook.review(pod)
    assert response["allowed"] is True and "patch" not in response
    assert "'1ki' is not a whole number of devices" in caplog.text


def test_one_connection_carries_many_reviews(webhook: Webhook) -> None:
    conn = http.client.HTTPSConnection("127.0.0.1", webhook.server.port, context=webhook.tls)
    try:
        sockets = set()
        for _ in range(3):
            body = json.dumps(admission_review(mig_pod("3g.40gb")))
            conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 200 and not answer.will_close
            assert "patch" in json.loads(answer.read())["response"]
            sockets.add(id(conn.sock))
        assert len(sockets) == 1
    finally:
        conn.close()


def swap_secret(mounted: Path, cert: tuple[Path, Path], generation: int) -> None:
    """Update `mounted` as kubelet updates a Secret volume: new dir, then swap `..data`."""
    data = mounted / f"..{generation}"
    data.mkdir()
    for source in cert:
        (data / source.name).write_bytes(source.read_bytes())
    (mounted / "..data_tmp").symlink_to(data.name)
    os.replace(mounted / "..data_tmp", mounted / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (mounted / name).is_symlink():
            (mounted / name).symlink_to(f"..data/{name}")


def handshake(port: int, cafile: Path) -> bool:
    tls = ssl.create_default_context(cafile=str(cafile))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=30)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except ssl.SSLCertVerificationError:
        return False
    finally:
        conn.close()


def test_a_rotated_certificate_is_served_to_new_connections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = issue(tmp_path / "old", cn="old"), issue(tmp_path / "new", cn="new")
    mounted = tmp_path / "tls"
    mounted.mkdir()
    swap_secret(mounted, old, 1)
    server = WebhookServer(
        webhook=MigFallbackWebhook(chains=lambda: CHAINS, capacity=EverythingFree()),
        cert_file=mounted / "tls.crt",
        key_file=mounted / "tls.key",
        host="127.0.0.1",
        port=0,
    )
    for webhook in running(server, old[0]):
        assert handshake(webhook.server.port, old[0])
        assert not handshake(webhook.server.port, new[0])
        swap_secret(mounted, new, 2)
        assert handshake(webhook.server.port, new[0])
        assert not handshake(webhook.server.port, old[0])
        assert server.certificate.loads == 2
        # A pair that does not belong together keeps the certificate that works.
        swap_secret(mounted, (new[0], old[1]), 3)
        assert handshake(webhook.server.port, new[0])
        assert "does not load" in caplog.text and "still serving the previous one" in caplog.text


def test_chains_come_from_the_policy_dir_and_a_bad_edit_keeps_the_last_good(
    tmp_path: Path,
) -> None:
    (tmp_path / "10-mig.yaml").write_text(
        'migFallback:\n  chains:\n    - ["3g.40gb", "2g.20gb"]\n', encoding="utf-8"
    )
    chains = PolicyChains(tmp_path)
    chains.start()
    try:
        assert [list(c) for c in chains()] == [["3g.40gb", "2g.20gb"]]
        (tmp_path / "10-mig.yaml").write_text("migFallback:\n  chains: 3\n", encoding="utf-8")
        assert chains.watcher.reload_now() == "invalid"
        assert [list(c) for c in chains()] == [["3g.40gb", "2g.20gb"]]
        (tmp_path / "10-mig.yaml").write_text(
            'migFallback:\n  chains:\n    - ["7g.80gb", "3g.40gb"]\n', encoding="utf-8"
        )
        eventually(lambda: [list(c) for c in chains()] == [["7g.80gb", "3g.40gb"]], "hot reload")
    finally:
        chains.stop()


def test_a_policy_invalid_from_the_start_means_no_chains_until_it_is_fixed(
    tmp_path: Path,
) -> None:
    (tmp_path / "10-mig.yaml").write_text("migFallback:\n  chains: 3\n", encoding="utf-8")
    chains = PolicyChains(tmp_path)
    chains.start()  # the webhook still serves, changing no pod
    try:
        assert chains() == ()
        (tmp_path / "10-mig.yaml").write_text(
            'migFallback:\n  chains:\n    - ["3g.40gb", "2g.20gb"]\n', encoding="utf-8"
        )
        eventually(lambda: [list(c) for c in chains()] == [["3g.40gb", "2g.20gb"]], "fixed")
    finally:
        chains.stop()


def test_the_production_server_reads_chains_from_the_policy_dir_and_nodes_from_the_api(
    tmp_path: Path,
    certificate: tuple[Path, Path],
    fake_api: FakeApiServer,
    service_account_client: Callable[[str], client.ApiClient],
) -> None:
    (tmp_path / "50-mig.yaml").write_text(
        'migFallback:\n  chains:\n    - ["3g.40gb", "1g.10gb"]\n', encoding="utf-8"
    )
    seed(fake_api)
    cert_file, key_file = certificate
    server = build_webhook_server(
        policy_dir=tmp_path,
        cert_file=cert_file,
        key_file=key_file,
        port=0,
        api_client=service_account_client("nvshare-webhook"),
        host="127.0.0.1",
    )
    for webhook in running(server, cert_file):
        eventually(lambda w=webhook: w.get("/readyz") == 200, "ready once the caches synced")
        pod = mig_pod("3g.40gb")
        patched = applied(pod, webhook.review(pod))
        assert patched["metadata"]["annotations"]["nvshare.com/mig-fallback"] == "3g.40gb->1g.10gb"
        assert webhook.get("/healthz") == 200
        # Seed 004's key, set in the policy, is picked up on the next review (hot reload).
        (tmp_path / "60-seed.yaml").write_text(
            "migFallback: {annotation: gpu-webhook.k8s.io/fallback}\n", encoding="utf-8"
        )

        def seed_key(w: Webhook = webhook, pod: dict[str, Any] = pod) -> bool:
            done = applied(pod, w.review(pod))
            return done["metadata"]["annotations"] == {
                "gpu-webhook.k8s.io/fallback": "3g.40gb->1g.10gb"
            }

        eventually(seed_key, "the annotation key from the policy")


def webhook_configuration(ca_file: Path) -> dict[str, Any]:
    """The rendered MutatingWebhookConfiguration with its caBundle, as webhook-certs.sh sets it."""
    (config,) = manifests.objects("MutatingWebhookConfiguration")
    config = copy.deepcopy(config)
    config["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(
        ca_file.read_bytes()
    ).decode()
    return config


def kubectl_create(fake_api: FakeApiServer, tmp_path: Path, pod: dict[str, Any]) -> str:
    """`kubectl create -f` of a pod; returns what kubectl printed on stderr (its warnings)."""
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    manifest = tmp_path / f"{pod['metadata']['name']}.json"
    manifest.write_text(json.dumps(pod), encoding="utf-8")
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "absent"), "HOME": str(tmp_path)}
    done = subprocess.run(
        [exe, f"--server={fake_api.url}", "create", "-f", str(manifest)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def named(pod: dict[str, Any], name: str, namespace: str = "default") -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"].update(name=name, namespace=namespace)
    return pod


def test_kubectl_create_of_a_mig_pod_goes_through_the_webhook_as_configured(
    fake_api: FakeApiServer, webhook: Webhook, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    admission = fake_api.admission
    admission.register(
        webhook_configuration(certificate[0]), address=("127.0.0.1", webhook.server.port)
    )
    kubectl_create(fake_api, tmp_path, named(mig_pod("3g.40gb"), "train"))
    train = fake_api.get("pods", "train", namespace="default")
    assert train["metadata"]["annotations"] == {"nvshare.com/mig-fallback": "3g.40gb->2g.20gb"}
    assert train["spec"]["containers"][0]["resources"]["limits"] == {MIG + "2g.20gb": "1"}
    assert admission.calls == 1
    # matchConditions: a pod without MIG devices never reaches the webhook; objectSelector:
    # nor does one that opted out; namespaceSelector: nor does anything in kube-system.
    cpu = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu"}}
    cpu["spec"] = {"containers": [{"name": "c", "image": "busybox"}]}
    kubectl_create(fake_api, tmp_path, cpu)
    opted_out = mig_pod("3g.40gb", labels={OPT_OUT_LABEL: OPT_OUT_VALUE})
    kubectl_create(fake_api, tmp_path, named(opted_out, "keep"))
    kubectl_create(fake_api, tmp_path, named(mig_pod("3g.40gb"), "system", "kube-system"))
    assert admission.calls == 1
    kept = fake_api.get("pods", "keep", namespace="default")
    assert kept["spec"]["containers"][0]["resources"]["limits"] == {MIG + "3g.40gb": "1"}
    printed = kubectl_create(fake_api, tmp_path, named(mig_pod("3g.40gb", count=3), "big"))
    assert f"Warning: {MIG}3g.40gb x3 is not free on any node" in printed
    assert admission.calls == 2 and admission.connections == 1  # kept alive between calls
    assert admission.failures == []


def test_a_webhook_that_is_down_leaves_pods_unchanged_under_failure_policy_ignore(
    fake_api: FakeApiServer, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    fake_api.admission.register(webhook_configuration(certificate[0]), address=("127.0.0.1", port))
    kubectl_create(fake_api, tmp_path, named(mig_pod("3g.40gb"), "train"))
    train = fake_api.get("pods", "train", namespace="default")
    assert train["spec"]["containers"][0]["resources"]["limits"] == {MIG + "3g.40gb": "1"}
    (failure,) = fake_api.admission.failures
    assert 'failed calling webhook "mig-fallback.nvshare.com"' in failure


def test_the_caches_list_in_pages_keep_only_mig_pods_and_recover_from_410(
    fake_api: FakeApiServer, service_account_client: Callable[[str], client.ApiClient]
) -> None:
    fake_api.add_node("n1", status={"allocatable": {MIG + "1g.10gb": "7"}})
    for i in range(120):
        fake_api.add_pod(f"cpu-{i}", node="n1")
    for i in range(5):
        fake_api.add_pod(f"mig-{i}", node="n1", spec=mig_pod("1g.10gb")["spec"])
    fake_api.add_pod("pending", spec=mig_pod("1g.10gb")["spec"])  # not bound: will hold one
    inventory = start_inventory(service_account_client("nvshare-webhook"), page_size=50)
    try:
        eventually(lambda: inventory.synced, "the caches synced")
        assert inventory.free_per_node() == {"n1": {MIG + "1g.10gb": 1}}
        assert len(inventory.pods.items()) == 6
        lists = [q for m, p, q in fake_api.requests if p == "/api/v1/pods" and "watch" not in q]
        assert [q["limit"] for q in lists] == ["50", "50", "50"]
        assert "continue" not in lists[0] and "continue" in lists[1]
        # While the API server is down, a MIG pod goes and history is compacted away: the
        # watch's version is then too old (410), and the relist's diff still frees the device.
        fake_api.stop()
        fake_api.delete("pods", "mig-0", namespace="default")
        fake_api.compact()
        fake_api.start()
        eventually(lambda: inventory.pods.relists == 2, "a relist after the 410")
        eventually(lambda: inventory.free_per_node()["n1"][MIG + "1g.10gb"] == 2, "mig-0 freed")
    finally:
        inventory.stop()
