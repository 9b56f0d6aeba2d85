"""The README's and docs/kubernetes.md's install, upgrade and uninstall commands refer to what
exists: the image they build is the one the rendered manifests run, through the overlay they
write, checked with the real `kubectl kustomize`; the host paths they clean are the ones the
DaemonSet writes.

The Kubernetes quick path used to be `kubectl apply -k deploy/` alone, which left every pod
unable to pull `nvshare/appliance:0.1.0`, and the guide's image step needed a standalone
`kustomize` it did not list.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from manifests import DEPLOY, ROOT, kustomize_output

GUIDE = ROOT / "docs" / "kubernetes.md"
VERSION = re.findall(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[0]

# What the blocks run that needs a registry or a cluster: echoed instead, so the test sees the
# arguments; `kubectl apply -k DIR` renders DIR with the real kustomize instead.
STAND_INS = """
docker() { echo "docker $*"; }
git() { :; }
kubectl() {
  case "$1" in
    apply) command kubectl kustomize "$3" ;;
    kustomize) command kubectl "$@" ;;
    *) echo "kubectl $*" ;;
  esac
}
"""


def block_with(path: Path, needle: str) -> str:
    """The one fenced code block of `path` that contains `needle`."""
    blocks, current = [], None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if current is not None:
                blocks.append("".join(current))
            current = [] if current is None else None
        elif current is not None:
            current.append(line)
    [block] = [b for b in blocks if needle in b]
    return block


def run(script: str, where: Path) -> str:
    done = subprocess.run(
        ["bash", "-euc", STAND_INS + script],
        cwd=where, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def images(rendered: str) -> set[str]:
    found = set()
    for doc in yaml.safe_load_all(rendered):
        if not doc or "spec" not in doc:
            continue
        pod = doc["spec"].get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            found.add(container["image"])
    return found


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What the commands need of a checkout: deploy/ and the policy ConfigMap's configmaps/."""
    _, why = kustomize_output()
    if why:
        pytest.skip(why)
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    shutil.copytree(ROOT / "configmaps", tmp_path / "configmaps")
    return tmp_path


@pytest.mark.parametrize("document", [ROOT / "README.md", GUIDE], ids=["README", "guide"])
def test_the_image_built_is_the_image_the_overlay_runs(document: Path, checkout: Path) -> None:
    block = block_with(document, "cat > nvshare/kustomization.yaml")
    out = run(block + "\ncommand kubectl kustomize nvshare/ > rendered.yaml\n", checkout)
    [built] = re.findall(r"^docker build -f (\S+) -t (\S+) \.$", out, re.M)
    dockerfile, tag = built
    assert (ROOT / dockerfile).is_file()
    assert f"docker push {tag}" in out.splitlines()
    assert tag.endswith(f"/nvshare-appliance:{VERSION}") and "$" not in tag
    rendered = (checkout / "rendered.yaml").read_text()
    assert images(rendered) == {tag}  # every Deployment and the DaemonSet, init containers too
    shipped = images(kustomize_output()[0] or "")
    assert shipped == {f"nvshare/appliance:{VERSION}"}  # what the overlay's `name` replaces


def test_the_guides_upgrade_moves_every_image_to_the_new_tag(checkout: Path) -> None:
    run(block_with(GUIDE, "cat > nvshare/kustomization.yaml"), checkout)  # step 1: the overlay
    upgrade = block_with(GUIDE, "git pull")
    assert "kubectl apply -k nvshare/" in upgrade
    render = "\ncommand kubectl kustomize nvshare/ > rendered.yaml\n"
    out = run("REGISTRY=registry.example.com/gpu\n" + upgrade + render, checkout)
    [tag] = re.findall(r"^docker push (\S+)$", out, re.M)
    assert tag == "registry.example.com/gpu/nvshare-appliance:0.2.0"
    assert images((checkout / "rendered.yaml").read_text()) == {tag}


def test_uninstalling_removes_what_was_applied_and_every_host_path_written() -> None:
    guide = GUIDE.read_text()
    uninstall = block_with(GUIDE, "kubectl delete -k")
    assert "kubectl delete -k nvshare/" in uninstall  # the overlay the install made
    [cleanup] = re.findall(r"`rm -rf ([^`]+)`", guide[guide.index("## Uninstalling") :])
    removed = cleanup.split()
    assert re.search(r"`rm -rf " + re.escape(cleanup) + "`", (ROOT / "README.md").read_text())
    daemonset = next(
        d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()) if d
    )  # fmt: skip
    written = [
        v["hostPath"]["path"]
        for v in daemonset["spec"]["template"]["spec"]["volumes"]
        if "hostPath" in v
        and not v["hostPath"]["path"].startswith(("/var/lib/kubelet", "/etc", "/var/run/cdi"))
    ]
    assert written, "the DaemonSet writes host paths"
    for path in written:
        assert any(path == r or path.startswith(r + "/") for r in removed), path
