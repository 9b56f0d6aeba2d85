"""The deploy/ manifests as the cluster would get them: `kubectl kustomize deploy/`.

Where kubectl is missing or its kustomize cannot build deploy/, the files are read one by one
instead; every property the tests check holds for them too.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


@cache
def kustomize_output(directory: Path = DEPLOY) -> tuple[str | None, str]:
    """(rendered YAML, "") or (None, why kustomize could not be used here)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None, "kubectl is not installed"
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        return None, f"`kubectl kustomize` failed (too old a kustomize?): {done.stderr.strip()}"
    return done.stdout, ""


def manifest_files() -> list[Path]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    return [DEPLOY / name for name in kustomization["resources"] if name.endswith(".yaml")]


@cache
def rendered() -> tuple[dict[str, Any], ...]:
    text, _why = kustomize_output()
    if text is not None:
        docs = list(yaml.safe_load_all(text))
    else:  # the files as written
        docs = [d for f in manifest_files() for d in yaml.safe_load_all(f.read_text("utf-8"))]
    return tuple(d for d in docs if d)


def objects(kind: str | None = None) -> list[dict[str, Any]]:
    return [o for o in rendered() if kind is None or o["kind"] == kind]


def rendered_without(role: str, resource: str, verb: str) -> list[dict[str, Any]]:
    """The rendered objects with ClusterRole `role` lacking `verb` on `resource`: what a
    cluster with an outdated or hand-edited role would have."""
    objects = copy.deepcopy(list(rendered()))
    for obj in objects:
        if obj["kind"] == "ClusterRole" and obj["metadata"]["name"] == role:
            for rule in obj["rules"]:
                if resource in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return objects
