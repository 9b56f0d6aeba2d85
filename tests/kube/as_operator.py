"""Acting on the (fake) API server as an operator would: with kubectl where it is installed,
else with the client library, so the tests run on machines without kubectl too."""

from __future__ import annotations

import os
import shutil
import subprocess

from kubernetes import client


def annotate(
    url: str, kind: str, name: str, key: str, value: str | None, namespace: str = ""
) -> None:
    """Set (or with None remove) one annotation of a pod or node."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        where = [f"--namespace={namespace}"] if namespace else []
        change = f"{key}={value}" if value is not None else f"{key}-"
        subprocess.run(
            [kubectl, f"--server={url}", *where, "annotate", kind, name, change, "--overwrite"],
            check=True,
            capture_output=True,
            timeout=30,
            env={**os.environ, "KUBECONFIG": "/dev/null"},
        )
        return
    api = client.CoreV1Api(client.ApiClient(client.Configuration(host=url)))
    patch = {"metadata": {"annotations": {key: value}}}
    if kind == "node":
        api.patch_node(name, patch)
    else:
        api.patch_namespaced_pod(name, namespace, patch)
