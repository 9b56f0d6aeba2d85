"""deploy/ renders with kustomize, validates offline (strict), and keeps its promises.

The promises are the ones that break sharing silently when lost: the policy ConfigMap is
mounted as a directory (a subPath mount never updates), the socket directory (not the socket)
is shared with the host, the daemon sees host PIDs, RBAC grants nothing beyond what the
components use, and a broken webhook cannot block pods.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml
from manifests import DEPLOY, ROOT, kustomize_output, objects

from appliance.cluster.webhook import OPT_OUT_LABEL, OPT_OUT_VALUE
from appliance.policy.load import load_policy_dir
from appliance.web.listen import split_address
from appliance.web.probes import LOOP_ANSWER_S

NAMESPACE = "nvshare-system"
KUBERNETES_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
ALLOWED_GRANTS = {
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "events", "create"),
    ("", "events", "patch"),
    ("", "nodes", "list"),
    ("", "nodes", "watch"),
    ("", "nodes", "patch"),  # the node daemon publishes its GPU status on its Node
    ("", "configmaps", "create"),  # the webhook replicas' shared admissions (one ConfigMap)
    ("", "configmaps", "get"),
    ("", "configmaps", "update"),
}
# The Extender of kubescheduler.config.k8s.io/v1 (k8s.io/kube-scheduler/config/v1, types.go:
# `type Extender struct`, its json tags) and ExtenderManagedResource's.
EXTENDER_FIELDS = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}
MANAGED_RESOURCE_FIELDS = {"name", "ignoredByScheduler"}


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects(kind) if o["metadata"]["name"] == name]
    return found


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("DaemonSet", "Deployment"):
        for workload in objects(kind):
            yield workload["metadata"]["name"], workload["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_kustomize_builds_one_namespace_with_the_policy_configmap() -> None:
    rendered, why = kustomize_output()
    if rendered is None:
        pytest.skip(f"{why}; the manifest files are validated one by one instead")
    for obj in objects():
        if obj["kind"] not in {
            "Namespace",
            "ClusterRole",
            "ClusterRoleBinding",
            "MutatingWebhookConfiguration",
        }:
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
    policy = one("ConfigMap", "nvshare-policy")  # no hash suffix: updates hot-reload in place
    source = ROOT / "configmaps" / "default" / "00-default.yaml"
    assert policy["data"] == {"00-default.yaml": source.read_text(encoding="utf-8")}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_strictly_against_the_kubernetes_schema(version: str) -> None:
    assert objects(), "nothing rendered"
    for obj in objects():
        kubernetes_validate.validate(obj, version, strict=True)


CRITICAL_CLASSES = {"system-node-critical", "system-cluster-critical"}


def test_every_critical_priority_class_used_has_a_quota_scoped_to_it_in_the_namespace() -> None:
    """GKE (and any cluster limiting critical classes in its ResourceQuota admission config)
    refuses a pod of a critical class in a namespace without such a quota: the DaemonSet would
    create no pod at all."""
    used = {
        spec["priorityClassName"]
        for _, spec in pod_specs()
        if spec.get("priorityClassName") in CRITICAL_CLASSES
    }
    assert used == {"system-node-critical"}
    covered: dict[str, int] = {}
    for quota in objects("ResourceQuota"):
        assert quota["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        for expression in quota["spec"]["scopeSelector"]["matchExpressions"]:
            if expression["scopeName"] == "PriorityClass" and expression["operator"] == "In":
                for name in expression["values"]:
                    covered[name] = int(quota["spec"]["hard"]["pods"])
    assert used <= covered.keys()
    assert min(covered[name] for name in used) >= 5000  # one pod per node, 5,000 nodes


def test_the_strict_validation_would_catch_a_misspelled_field() -> None:
    daemonset = yaml.safe_load(yaml.safe_dump(one("DaemonSet", "nvshare-node")))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_policy_configmap_is_mounted_as_a_directory_and_nothing_uses_subpath() -> None:
    mounted = 0
    for name, spec in pod_specs():
        volumes = {
            v["name"]
            for v in spec["volumes"]
            if v.get("configMap", {}).get("name") == "nvshare-policy"
        }
        for container in containers(spec):
            for mount in container.get("volumeMounts", []):
                assert "subPath" not in mount and "subPathExpr" not in mount, (name, mount)
                if mount["name"] in volumes:
                    assert mount["mountPath"] == "/etc/nvshare/policy.d"
                    mounted += 1
    assert mounted == 3  # the node daemon, the webhook and the extender


def test_rbac_grants_nothing_beyond_what_the_components_use() -> None:
    granted = set()
    for role in [*objects("ClusterRole"), *objects("Role")]:
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            if rule["verbs"] != ["create"]:  # a name cannot narrow create
                assert role["kind"] == "ClusterRole" or rule.get("resourceNames") == [
                    "nvshare-mig-admissions"
                ], rule
            assert role["kind"] == "Role" or "resourceNames" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    assert granted <= ALLOWED_GRANTS, granted - ALLOWED_GRANTS
    node = {
        (r, v)
        for rule in one("ClusterRole", "nvshare-node")["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert {("pods", "watch"), ("events", "create"), ("nodes", "patch")} <= node
    for reader in ("nvshare-webhook", "nvshare-extender"):
        grants = {
            (r, v)
            for rule in one("ClusterRole", reader)["rules"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        assert grants == {(r, v) for r in ("pods", "nodes") for v in ("list", "watch")}, reader
    roles = {r["metadata"]["name"] for r in objects("ClusterRole")}
    for binding in objects("ClusterRoleBinding"):
        assert binding["roleRef"]["name"] in roles  # never a built-in role such as admin
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE


def test_the_node_daemon_sees_host_pids_and_shares_the_socket_directory() -> None:
    spec = one("DaemonSet", "nvshare-node")["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    (daemon,) = spec["containers"]  # no bind-mount sidecar
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    env = {e["name"]: e for e in daemon["env"]}
    sockets = [n for n, p in host_paths.items() if p["path"] == "/var/run/nvshare"]
    assert sockets and host_paths[sockets[0]]["type"] == "DirectoryOrCreate"
    assert mounts[sockets[0]] == "/var/run/nvshare"
    assert not any(p["path"].endswith(".sock") for p in host_paths.values())
    # nvsharectl's socket lives beside, never inside, the directory pods are given
    control = [n for n, p in host_paths.items() if p["path"] == "/var/run/nvshare-control"]
    assert control and mounts[control[0]] == "/var/run/nvshare-control"
    assert env["NVSHARE_OPEN_FILES"]["value"] == "65536"
    assert "/var/lib/kubelet/device-plugins" in {p["path"] for p in host_paths.values()}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["containerPort"] for p in daemon["ports"]} == {9402, 9403}  # metrics, probes
    assert "--policy-dir" in daemon["command"] and "--device-plugin" in daemon["command"]
    # The device plugin writes ld.so.preload beside the hook and hands kubelet that path, so
    # the daemon must see the hook's host directory at the same path.
    hook_dir = [n for n, p in host_paths.items() if p["path"] == "/var/lib/nvshare/lib"]
    assert hook_dir and mounts[hook_dir[0]] == "/var/lib/nvshare/lib"
    assert {"/etc/cdi", "/var/run/cdi"} <= {p["path"] for p in host_paths.values()}


def test_no_container_is_privileged_and_the_hook_is_installed_by_an_init_container() -> None:
    for name, spec in pod_specs():
        for container in containers(spec):
            context = container.get("securityContext", {})
            assert not context.get("privileged", False), (name, container["name"])
            assert context.get("allowPrivilegeEscalation") is False, (name, container["name"])
    spec = one("DaemonSet", "nvshare-node")["spec"]["template"]["spec"]
    (installer,) = spec["initContainers"]
    script = " ".join(installer["command"])
    source = re.search(r"cp (\S+libnvshare\.so) ", script)
    assert source, script
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert f"libnvshare.so {source.group(1)}\n" in dockerfile  # the image has it there
    (mount,) = installer["volumeMounts"]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == "/var/lib/nvshare/lib"


def test_the_webhook_cannot_block_pods_and_points_at_its_service() -> None:
    (config,) = objects("MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["rules"][0]["operations"] == ["CREATE"] and hook["rules"][0]["resources"] == [
        "pods"
    ]
    excluded = hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert {"kube-system", NAMESPACE} <= set(excluded)
    # Only MIG pods reach it (the CEL itself is exercised by the fake API server's admission
    # in test_webhook.py), and the opt-out label keeps a pod away.
    assert "nvidia.com/mig-" in hook["matchConditions"][0]["expression"]
    (opt_out,) = hook["objectSelector"]["matchExpressions"]
    assert opt_out == {"key": OPT_OUT_LABEL, "operator": "NotIn", "values": [OPT_OUT_VALUE]}
    target = hook["clientConfig"]["service"]
    service = one("Service", target["name"])
    assert target["namespace"] == NAMESPACE
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == target["port"]]
    deployment = one("Deployment", "nvshare-webhook")["spec"]["template"]["spec"]
    assert port["targetPort"] in {p["name"] for c in deployment["containers"] for p in c["ports"]}
    assert deployment["securityContext"]["runAsNonRoot"] is True


def scheduler_configuration() -> dict[str, Any]:
    data = one("ConfigMap", "nvshare-scheduler-config")["data"]
    config = yaml.safe_load(data["scheduler-config.yaml"])
    assert isinstance(config, dict)
    return config


def test_the_scheduler_configuration_names_the_extender_as_kube_scheduler_reads_it() -> None:
    config = scheduler_configuration()
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (ext,) = config["extenders"]
    assert set(ext) <= EXTENDER_FIELDS, set(ext) - EXTENDER_FIELDS
    assert (ext["filterVerb"], ext["prioritizeVerb"]) == ("filter", "prioritize")
    assert ext["ignorable"] is True and ext["nodeCacheCapable"] is True
    assert "bindVerb" not in ext and "preemptVerb" not in ext
    managed = {m["name"]: m for m in ext["managedResources"]}
    assert all(set(m) <= MANAGED_RESOURCE_FIELDS for m in managed.values())
    assert managed["nvshare.com/gpu"].get("ignoredByScheduler", False) is False
    assert managed["nvidia.com/gpumem"]["ignoredByScheduler"] is True  # no node advertises it
    assert 1 <= ext["weight"] and ext["httpTimeout"].endswith("s")


def test_the_extender_url_reaches_its_service_and_container() -> None:
    (ext,) = scheduler_configuration()["extenders"]
    m = re.fullmatch(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", ext["urlPrefix"])
    assert m, ext["urlPrefix"]
    service = one("Service", m.group(1))
    assert m.group(2) == NAMESPACE
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(m.group(3))]
    deployment = one("Deployment", "nvshare-extender")["spec"]["template"]["spec"]
    (container,) = deployment["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["targetPort"] in named
    assert f"--port={named[port['targetPort']]}" in container["command"]
    assert container["command"][:2] == ["nvshare-scheduler", "extender"]
    assert deployment["serviceAccountName"] == "nvshare-extender"
    assert deployment["securityContext"]["runAsNonRoot"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    labels = one("Deployment", "nvshare-extender")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_every_server_is_probed_where_it_answers_with_time_to_answer() -> None:
    for name, spec in pod_specs():
        (container,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for kind, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            probe = container[kind]
            assert probe["httpGet"]["path"] == path, (name, kind)
            assert probe["httpGet"]["port"] in ports, (name, kind)
            # The node daemon's event loop is given LOOP_ANSWER_S before /healthz says it is
            # wedged; the probe must wait longer than that, or a slow answer reads as a failure.
            assert probe["timeoutSeconds"] > LOOP_ANSWER_S, (name, kind)
        liveness = container["livenessProbe"]
        # Time to start (the first policy load, importing the client) before liveness counts.
        startup = container.get("startupProbe", {})
        grace = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 0)
        assert max(grace, liveness.get("initialDelaySeconds", 0)) >= 10, name


def test_the_daemons_probes_reach_their_own_port_whether_or_not_metrics_are_on() -> None:
    spec = one("DaemonSet", "nvshare-node")["spec"]["template"]["spec"]
    (daemon,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    host, probe_port = split_address(env["NVSHARE_PROBE_ADDRESS"])
    assert ports["probes"] == probe_port != ports["metrics"]
    assert host in ("", "::"), "every address of both families: kubelet probes the pod IP"
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert daemon[kind]["httpGet"]["port"] == "probes", kind
    assert daemon["startupProbe"]["httpGet"] == daemon["livenessProbe"]["httpGet"]
    policy = load_policy_dir(ROOT / "configmaps" / "default")
    host, metrics_port = split_address(policy.metrics.address)
    assert metrics_port == ports["metrics"] and host in ("", "::")
