"""deploy/components/cert-manager: the webhook's certificate from cert-manager, checked as
test_deploy.py checks deploy/ (rendered as an operator's overlay would render it, every built-in
object strictly validated), and its cert-manager objects against cert-manager.io/v1's fields."""

from __future__ import annotations

import os
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from manifests import DEPLOY, kustomize_output

COMPONENT = DEPLOY / "components" / "cert-manager"
NAMESPACE = "nvshare-system"

# The fields of cert-manager.io/v1 Issuer and Certificate (cert-manager's API reference),
# closed, so that a misspelled or invented field fails here rather than in the cluster.
_OBJECT_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"type": "string"},
    },
}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "namespace": {"const": NAMESPACE}},
}


def _kind(spec: dict[str, Any]) -> dict[str, Any]:
    """A cert-manager.io/v1 object of this namespace whose spec is `spec` (closed)."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


ISSUER = _kind(
    {
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {
            "selfSigned": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"crlDistributionPoints": {"type": "array"}},
            },
            "ca": {
                "type": "object",
                "additionalProperties": False,
                "required": ["secretName"],
                "properties": {
                    "secretName": {"type": "string"},
                    "crlDistributionPoints": {"type": "array"},
                    "ocspServers": {"type": "array"},
                    "issuingCertificateURLs": {"type": "array"},
                },
            },
            "acme": {"type": "object"},
            "vault": {"type": "object"},
            "venafi": {"type": "object"},
        },
    }
)
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"}
CERTIFICATE = _kind(
    {
        "required": ["secretName", "issuerRef"],
        "properties": {
            "secretName": {"type": "string"},
            "issuerRef": _OBJECT_REF,
            "commonName": {"type": "string"},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "ipAddresses": {"type": "array", "items": {"type": "string"}},
            "uris": {"type": "array"},
            "emailAddresses": {"type": "array"},
            "duration": _DURATION,
            "renewBefore": _DURATION,
            "renewBeforePercentage": {"type": "integer"},
            "isCA": {"type": "boolean"},
            "usages": {
                "type": "array",
                "items": {
                    "enum": [
                        "signing",
                        "digital signature",
                        "content commitment",
                        "key encipherment",
                        "key agreement",
                        "data encipherment",
                        "cert sign",
                        "crl sign",
                        "encipher only",
                        "decipher only",
                        "any",
                        "server auth",
                        "client auth",
                        "code signing",
                        "email protection",
                        "s/mime",
                        "ipsec end system",
                        "ipsec tunnel",
                        "ipsec user",
                        "timestamping",
                        "ocsp signing",
                        "microsoft sgc",
                        "netscape sgc",
                    ]
                },
            },
            "privateKey": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "size": {"type": "integer"},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
            },
            "subject": {"type": "object"},
            "secretTemplate": {"type": "object"},
            "revisionHistoryLimit": {"type": "integer"},
            "encodeUsagesInRequest": {"type": "boolean"},
            "additionalOutputFormats": {"type": "array"},
            "keystores": {"type": "object"},
            "literalSubject": {"type": "string"},
            "nameConstraints": {"type": "object"},
            "otherNames": {"type": "array"},
        },
    }
)
SCHEMAS = {"Issuer": ISSUER, "Certificate": CERTIFICATE}


def _hours(duration: str) -> float:
    assert duration.endswith("h") and duration[:-1].isdigit(), duration
    return float(duration[:-1])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """deploy/ with the component, as an operator's own kustomization names them."""
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY, overlay)],
                "components": [os.path.relpath(COMPONENT, overlay)],
            }
        )
    )
    text, why = kustomize_output(overlay)
    if text is None:
        pytest.skip(f"{why}; a kustomize Component needs kubectl 1.21 or newer")
    return [d for d in yaml.safe_load_all(text) if d]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_the_component_file_holds_only_cert_manager_objects_that_match_its_api() -> None:
    docs = [d for d in yaml.safe_load_all((COMPONENT / "certificates.yaml").read_text()) if d]
    assert {d["kind"] for d in docs} == {"Issuer", "Certificate"}
    for doc in docs:
        jsonschema.validate(doc, SCHEMAS[doc["kind"]])
    wrong = {**docs[-1], "spec": {**docs[-1]["spec"], "dnsName": ["x"]}}
    with pytest.raises(jsonschema.ValidationError):  # the check would catch a typo
        jsonschema.validate(wrong, SCHEMAS[wrong["kind"]])


def test_with_the_component_every_builtin_object_still_validates_strictly(
    rendered: list[dict[str, Any]],
) -> None:
    for obj in rendered:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_certificate_serves_the_webhook_and_its_ca_is_injected_and_stable(
    rendered: list[dict[str, Any]],
) -> None:
    serving = find(rendered, "Certificate", "nvshare-webhook")["spec"]
    (config,) = [o for o in rendered if o["kind"] == "MutatingWebhookConfiguration"]
    # The CA injector fills caBundle from this Certificate's CA.
    inject = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert inject == f"{NAMESPACE}/nvshare-webhook"
    # Its names are the ones the API server calls: the webhook Service's DNS names.
    service = config["webhooks"][0]["clientConfig"]["service"]
    assert f"{service['name']}.{service['namespace']}.svc" in serving["dnsNames"]
    # Its Secret is the one the webhook mounts.
    pod = find(rendered, "Deployment", "nvshare-webhook")["spec"]["template"]["spec"]
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert serving["secretName"] in secrets
    assert (
        "server auth" in serving["usages"] and serving["privateKey"]["rotationPolicy"] == "Always"
    )
    assert _hours(serving["renewBefore"]) < _hours(serving["duration"])
    # Signed by a CA Issuer whose key lives in a long-lived CA Certificate of its own, so the
    # caBundle does not change when the serving certificate renews.
    issuer = find(rendered, "Issuer", serving["issuerRef"]["name"])["spec"]
    ca = [
        c["spec"]
        for c in rendered
        if c["kind"] == "Certificate" and c["spec"]["secretName"] == issuer["ca"]["secretName"]
    ]
    assert len(ca) == 1 and ca[0]["isCA"] is True
    assert _hours(ca[0]["duration"]) > 10 * _hours(serving["duration"])
    root = find(rendered, "Issuer", ca[0]["issuerRef"]["name"])["spec"]
    assert root == {"selfSigned": {}}


def test_without_the_component_deploy_names_no_cert_manager_object() -> None:
    text, why = kustomize_output()
    if text is None:
        pytest.skip(why)
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    (config,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    assert "cert-manager.io/inject-ca-from" not in (config["metadata"].get("annotations") or {})
