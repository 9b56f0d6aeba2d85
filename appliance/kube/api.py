"""Reaching the Kubernetes API server: one way to build a client, for every program and part.

`--kube-api URL` (NVSHARE_KUBE_API) wins, then the in-cluster service account, then the
kubeconfig; when none works the error says what was tried and what to give.
"""

from __future__ import annotations

import os

from kubernetes import client, config


class KubeConfigError(Exception):
    """No usable way to reach the API server; the message says what was tried."""


def api_client_from_env(api_url: str | None = None) -> client.ApiClient:
    """An ApiClient for `api_url` if given, else in-cluster config, else the kubeconfig.

    urllib3's own retries are off: the informers back off and retry themselves, and urllib3
    would log a long warning for each of its attempts.
    """
    cfg = client.Configuration()
    cfg.retries = False
    try:
        if api_url:
            cfg.host = api_url
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            # KUBECONFIG as it is now: the client library reads it once, when first imported.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg
            )
    except (config.ConfigException, OSError, ValueError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise KubeConfigError(
            f"no way to reach the Kubernetes API server: not in a pod, and no usable kubeconfig "
            f"({lines[0][:200]}); give --kube-api URL (env NVSHARE_KUBE_API) or KUBECONFIG"
        ) from None
    return client.ApiClient(cfg)
