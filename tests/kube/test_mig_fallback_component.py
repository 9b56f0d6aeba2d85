"""deploy/components/mig-fallback: the webhook's fallback chains, enabled by the one documented
step (uncommenting its line in deploy/kustomization.yaml), land in the policy ConfigMap the
webhook mounts, after the shipped default, and fall back as seed 004 asks (2g.20gb -> 1g.10gb).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import DEPLOY, ROOT, kustomize_output

from appliance.cluster.webhook import choose_fallbacks
from appliance.policy.load import load_policy_dir

STEP = ("#   - components/mig-fallback", "  - components/mig-fallback")


def enabled_as_documented(tmp_path: Path) -> list[dict[str, Any]]:
    """deploy/ and configmaps/ copied, the documented lines uncommented, rendered."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    shutil.copytree(ROOT / "configmaps", tmp_path / "configmaps")
    kustomization = tmp_path / "deploy" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count(STEP[0]) == 1 and text.count("# components:") == 1
    kustomization.write_text(text.replace(STEP[0], STEP[1]).replace("# components:", "components:"))
    rendered, why = kustomize_output(tmp_path / "deploy")
    if rendered is None:
        pytest.skip(f"{why}; a kustomize Component needs kubectl 1.21 or newer")
    return [d for d in yaml.safe_load_all(rendered) if d]


def test_one_step_adds_the_chains_to_the_policy_the_webhook_mounts(tmp_path: Path) -> None:
    objects = enabled_as_documented(tmp_path / "tree")
    (policy,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "nvshare-policy"
    ]
    assert policy["metadata"]["namespace"] == "nvshare-system"
    assert sorted(policy["data"]) == ["00-default.yaml", "30-mig-fallback.yaml"]
    (webhook,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "nvshare-webhook"
    ]
    volumes = webhook["spec"]["template"]["spec"]["volumes"]
    assert {"name": "policy", "configMap": {"name": "nvshare-policy"}} in volumes
    mounted = tmp_path / "mounted"  # what kubelet shows the webhook: each key a file
    mounted.mkdir()
    for key, text in policy["data"].items():
        (mounted / key).write_text(text)
    chains = load_policy_dir(mounted, environ={}).mig_fallback.chains
    pod = {
        "spec": {
            "containers": [{"resources": {"limits": {"nvidia.com/mig-2g.20gb": "1"}}}],
        }
    }
    free = {"nvidia.com/mig-1g.10gb"}  # 2g.20gb exhausted, as in the seed
    fallbacks, warnings = choose_fallbacks(
        pod, chains=chains, available=lambda resource, count: resource in free
    )
    assert [f.summary for f in fallbacks] == ["2g.20gb->1g.10gb"] and warnings == []


def test_without_the_step_the_policy_has_no_chains() -> None:
    assert load_policy_dir(ROOT / "configmaps" / "default", environ={}).mig_fallback.chains == ()
    assert STEP[0] in (DEPLOY / "kustomization.yaml").read_text()
