"""The MIG-fallback webhook over real HTTPS, with cluster state in the fake API server."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fakeapi import FakeApiServer, json_patch
from kubernetes import client

from appliance.kube.webhook import (
    ClusterAvailability,
    MigFallbackWebhook,
    PolicyChains,
    WebhookServer,
    build_webhook_server,
    policy_chains,
)

MIG = "nvidia.com/mig-"
CHAINS = [["3g.40gb", "2g.20gb", "1g.10gb"]]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, as a cluster's cert-manager would issue one."""
    directory = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nvshare-webhook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


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

    def review(self, pod: dict[str, Any], *, operation: str = "CREATE") -> dict[str, Any]:
        body = {
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
        status, payload = self.post(json.dumps(body).encode())
        assert status == 200
        answer = json.loads(payload)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == body["request"]["uid"]
        assert answer["response"]["allowed"] is True  # never a rejection
        return dict(answer["response"])


def running(server: WebhookServer, cert_file: Path) -> Iterator[Webhook]:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Webhook(server, cert_file)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def webhook(certificate: tuple[Path, Path], api_client: client.ApiClient) -> Iterator[Webhook]:
    cert_file, key_file = certificate
    server = WebhookServer(
        webhook=MigFallbackWebhook(
            chains=lambda: CHAINS,
            available=ClusterAvailability(api_client=api_client, ttl_s=0.0),
        ),
        cert_file=cert_file,
        key_file=key_file,
        host="127.0.0.1",
        port=0,
    )
    yield from running(server, cert_file)


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
    """n1 has one 3g.40gb, taken by a running pod; n2 has one free 2g.20gb."""
    fake_api.add_node("n1", status={"allocatable": {MIG + "3g.40gb": "1", "cpu": "64"}})
    fake_api.add_node("n2", status={"allocatable": {MIG + "2g.20gb": "1", MIG + "1g.10gb": "2"}})
    busy = mig_pod("3g.40gb")
    fake_api.add_pod("busy", node="n1", spec=busy["spec"])


def applied(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["patchType"] == "JSONPatch"
    return json_patch(pod, json.loads(base64.b64decode(response["patch"])))


def test_falls_back_to_the_next_free_profile_and_says_so_on_the_pod(
    fake_api: FakeApiServer, webhook: Webhook
) -> None:
    seed(fake_api)
    pod = mig_pod("3g.40gb", labels={"app": "train"})
    patched = applied(pod, webhook.review(pod))
    resources = patched["spec"]["containers"][0]["resources"]
    assert resources == {
        "limits": {MIG + "2g.20gb": "1"},
        "requests": {MIG + "2g.20gb": "1"},
    }
    assert patched["metadata"]["annotations"] == {"nvshare.com/mig-fallback": "3g.40gb->2g.20gb"}
    assert patched["metadata"]["labels"] == {"app": "train"}


def test_keeps_existing_annotations_and_skips_profiles_that_are_too_few(
    fake_api: FakeApiServer, webhook: Webhook
) -> None:
    seed(fake_api)
    pod = mig_pod("3g.40gb", count=2, annotations={"team": "vision"})
    patched = applied(pod, webhook.review(pod))  # n2 has one 2g.20gb but two 1g.10gb
    assert patched["spec"]["containers"][0]["resources"]["limits"] == {MIG + "1g.10gb": "2"}
    assert patched["metadata"]["annotations"] == {
        "team": "vision",
        "nvshare.com/mig-fallback": "3g.40gb->1g.10gb",
    }


def test_a_pod_that_finished_frees_its_profile(fake_api: FakeApiServer, webhook: Webhook) -> None:
    seed(fake_api)

    def finish(pod: dict[str, Any]) -> dict[str, Any]:
        pod["status"]["phase"] = "Succeeded"
        return pod

    fake_api.update("pods", "busy", finish, namespace="default")
    response = webhook.review(mig_pod("3g.40gb"))
    assert "patch" not in response and "warnings" not in response


def test_nothing_free_in_the_chain_admits_unchanged_with_a_warning(
    fake_api: FakeApiServer, webhook: Webhook
) -> None:
    seed(fake_api)
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
        (
            {"kind": "Pod", "metadata": {"name": "cpu"}, "spec": {"containers": [{"name": "c"}]}},
            "CREATE",
        ),
    ],
)
def test_pods_outside_the_policy_pass_untouched(
    fake_api: FakeApiServer, webhook: Webhook, pod: dict[str, Any], operation: str
) -> None:
    seed(fake_api)
    response = webhook.review(pod, operation=operation)
    assert "patch" not in response and "warnings" not in response


def test_an_unreachable_api_server_fails_open(fake_api: FakeApiServer, webhook: Webhook) -> None:
    fake_api.stop()
    response = webhook.review(mig_pod("3g.40gb"))
    assert "patch" not in response
    assert "MIG fallback skipped" in response["warnings"][0]


def test_a_body_that_is_not_an_admission_review_is_a_400_and_the_server_lives_on(
    fake_api: FakeApiServer, webhook: Webhook
) -> None:
    status, payload = webhook.post(b"{not json")
    assert status == 400 and b"AdmissionReview" in payload
    status, _ = webhook.post(b'{"kind": "AdmissionReview"}')
    assert status == 400
    seed(fake_api)
    assert "patch" in webhook.review(mig_pod("3g.40gb"))


def test_chains_come_from_the_policy_dir_and_a_bad_edit_keeps_the_last_good(
    tmp_path: Path,
) -> None:
    (tmp_path / "10-mig.yaml").write_text(
        'migFallback:\n  chains:\n    - ["3g.40gb", "2g.20gb"]\n', encoding="utf-8"
    )
    chains = PolicyChains(policy_dir=tmp_path, load=policy_chains, ttl_s=0.0)
    assert [list(c) for c in chains()] == [["3g.40gb", "2g.20gb"]]
    (tmp_path / "10-mig.yaml").write_text("migFallback:\n  chains: 3\n", encoding="utf-8")
    assert [list(c) for c in chains()] == [["3g.40gb", "2g.20gb"]]


def test_the_production_server_reads_chains_from_the_policy_dir_and_nodes_from_the_api(
    tmp_path: Path,
    certificate: tuple[Path, Path],
    fake_api: FakeApiServer,
    api_client: client.ApiClient,
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
        api_client=api_client,
        host="127.0.0.1",
    )
    for webhook in running(server, cert_file):
        pod = mig_pod("3g.40gb")
        patched = applied(pod, webhook.review(pod))
        assert patched["metadata"]["annotations"]["nvshare.com/mig-fallback"] == "3g.40gb->1g.10gb"
        health = urllib.request.urlopen(
            webhook.url.replace("/mutate", "/healthz"), context=webhook.tls, timeout=30
        )
        assert health.status == 200
        health.close()
