"""`make sim`: seed 004's cluster in a box, run with real kubectl against a simulated cluster.

Seed 004 (a Kind cluster with fake-gpu-operator and a MIG-fallback webhook) stands up two
nodes of four H200 each, a small one partitioned 28 x 1g.10gb and a medium one 12 x 2g.20gb +
4 x 1g.10gb, and runs three tests: a Pod, a Deployment and a Job asking for 2g.20gb, checked
with `kubectl get ... -o custom-columns`. This program does the same without Docker, Kind or
a GPU, and says at the start what is real and what is simulated.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

import manifests  # noqa: E402
from certs import issue  # noqa: E402
from fakeapi import FakeApiServer  # noqa: E402
from kubernetes import client  # noqa: E402
from mig_cluster import (  # noqa: E402
    Binder,
    Controllers,
    add_seed_004_nodes,
    mig_requests,
    pods_by_state,
)

from appliance.cluster.webhook_server import build_webhook_server  # noqa: E402

MANIFESTS = HERE / "seed_004"
SEED_KEY = "gpu-webhook.k8s.io/fallback"
WAIT_S = 60.0

BANNER = """\
=== SIMULATION of seed 004's cluster (no Kind, no Docker, no GPU) ===
Real:      kubectl ({kubectl}); the nvshare MIG-fallback webhook (appliance.cluster.webhook_server)
           over HTTPS with its informers, called by the API server's admission step with the
           MutatingWebhookConfiguration, RBAC and caBundle of deploy/; the policy shipped in
           configmaps/default/00-default.yaml plus deploy/components/mig-fallback, and a file
           setting seed 004's annotation key ({key}).
Simulated: the API server (tests/kube/fakeapi.py); the two nodes, labelled and sized as
           fake-gpu-operator makes them; the Deployment, ReplicaSet and Job controllers
           (slow-start batches 1, 2, 4, 8 through the API); the scheduler's binding (first
           fit on MIG devices, in rounds 0.5s apart); kubelet (no container runs: a Job's
           pod succeeds 1s after it is bound, so `kubectl logs` has nothing to show).
"""


class Kubectl:
    def __init__(self, server: str, home: Path) -> None:
        exe = shutil.which("kubectl")
        if exe is None:
            raise SystemExit("make sim needs kubectl on PATH (Debian: apt-get install kubectl)")
        self.exe, self.server = exe, server
        self.env = {**os.environ, "KUBECONFIG": str(home / "absent"), "HOME": str(home)}

    def version(self) -> str:
        done = subprocess.run(
            [self.exe, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        return str(json.loads(done.stdout)["clientVersion"]["gitVersion"])

    def __call__(self, *args: str, shown: str = "") -> str:
        """Run, print what was run (as the seed writes it) and what it printed."""
        print(f"\n$ kubectl {shown or ' '.join(args)}", flush=True)
        done = subprocess.run(
            [self.exe, f"--server={self.server}", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        print((done.stdout + done.stderr).rstrip(), flush=True)
        if done.returncode != 0:
            raise SystemExit(f"kubectl {args[0]} failed ({done.returncode})")
        return done.stdout


def wait(what: str, ready: Callable[[], bool], *, or_after_s: float | None = None) -> None:
    """Until `ready`; after `or_after_s` go on anyway (what is still pending is the finding),
    else give up after WAIT_S."""
    deadline = time.monotonic() + (WAIT_S if or_after_s is None else or_after_s)
    while not ready():
        if time.monotonic() > deadline:
            if or_after_s is not None:
                print(f"(still waiting for {what} after {or_after_s:g}s; going on)", flush=True)
                return
            raise SystemExit(f"gave up after {WAIT_S:g}s waiting for {what}")
        time.sleep(0.05)


def policy_dir(into: Path) -> Path:
    into.mkdir()
    shutil.copy(ROOT / "configmaps" / "default" / "00-default.yaml", into)
    shutil.copy(ROOT / "deploy" / "components" / "mig-fallback" / "30-mig-fallback.yaml", into)
    (into / "40-seed-004.yaml").write_text(f"migFallback:\n  annotation: {SEED_KEY}\n")
    return into


def webhook_configuration(ca_file: Path) -> dict[str, Any]:
    import base64
    import copy

    (config,) = manifests.objects("MutatingWebhookConfiguration")
    config = copy.deepcopy(config)
    config["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(
        ca_file.read_bytes()
    ).decode()
    return config


def ready(port: int, ca_file: Path) -> bool:
    tls = ssl.create_default_context(cafile=str(ca_file))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=tls, timeout=5):
            return True
    except OSError:
        return False


def owned_pods(fake: FakeApiServer, label: str, value: str) -> list[dict[str, Any]]:
    state = pods_by_state(fake)
    return [
        p
        for p in state["bound"] + state["pending"]
        if (p["metadata"].get("labels") or {}).get(label) == value
    ]


def free_devices(fake: FakeApiServer) -> dict[str, int]:
    with fake.store.cond:
        nodes = [o for k, o in fake.store.objects.items() if k[0] == "nodes"]
    free: dict[str, int] = {}
    for node in nodes:
        for name, value in (node["status"].get("allocatable") or {}).items():
            if name.startswith("nvidia.com/mig-"):
                free[name] = free.get(name, 0) + int(value)
    for pod in pods_by_state(fake)["bound"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        for name, count in mig_requests(pod).items():
            free[name] -= count
    return free


def run(work: Path) -> int:
    fake = FakeApiServer().start()
    fake.load_rbac(list(manifests.rendered()))
    add_seed_004_nodes(fake)
    fake.store.create("namespaces", "", {"metadata": {"name": "nvshare-system"}})  # the ledger's
    kubectl = Kubectl(fake.url, work)
    print(BANNER.format(kubectl=kubectl.version(), key=SEED_KEY), flush=True)
    cert_file, key_file = issue(work / "tls")
    cfg = client.Configuration(host=fake.url)
    cfg.api_key = {"authorization": fake.token_for("nvshare-system", "nvshare-webhook")}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    server = build_webhook_server(
        policy_dir=policy_dir(work / "policy"),
        cert_file=cert_file,
        key_file=key_file,
        port=0,
        api_client=client.ApiClient(cfg),
        host="127.0.0.1",
    )
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    wait("the webhook's /readyz", lambda: ready(server.port, cert_file))
    fake.admission.register(webhook_configuration(cert_file), address=("127.0.0.1", server.port))
    # The binder works in rounds half a second apart, as a scheduler with a queue does: the
    # controllers' batches are admitted before their pods are bound, which is what the
    # webhook's reservations are for.
    controllers = Controllers(fake).start()
    binder = Binder(fake, interval_s=0.5).start()
    try:
        return scenarios(fake, kubectl, controllers)
    finally:
        controllers.stop()
        binder.stop()
        fake.admission.close()
        server.shutdown()
        server.server_close()
        fake.stop()


def scenarios(fake: FakeApiServer, kubectl: Kubectl, controllers: Controllers) -> int:
    seed_columns = (
        "NAME:.metadata.name,"
        r"FALLBACK:.metadata.annotations.gpu-webhook\.k8s\.io/fallback,"
        "GPU-REQUEST:.spec.containers[0].resources.requests"
    )
    extra = ",NODE:.spec.nodeName,STATUS:.status.phase"
    rel = os.path.relpath(MANIFESTS, Path.cwd())
    print("\n### Cluster: nodes and their MIG devices, as fake-gpu-operator advertises them")
    kubectl(
        "get",
        "nodes",
        "-o",
        "custom-columns=NAME:.metadata.name,"
        r"MIG-1g.10gb:.status.capacity.nvidia\.com/mig-1g\.10gb,"
        r"MIG-2g.20gb:.status.capacity.nvidia\.com/mig-2g\.20gb",
    )

    print("\n### Test 1: a Pod asking for 2g.20gb (12 free: it keeps its request)")
    kubectl("apply", "-f", f"{rel}/test-medium-gpu.yaml")
    wait(
        "test-medium-gpu bound",
        lambda: bool(
            fake.get("pods", "test-medium-gpu", namespace="default")["spec"].get("nodeName")
        ),
    )
    kubectl("get", "pod", "test-medium-gpu", "-o", f"custom-columns={seed_columns}{extra}")

    print("\n### Test 2: a Deployment of 16 replicas asking for 2g.20gb (11 left)")
    kubectl("apply", "-f", f"{rel}/test-deployment.yaml")
    wait("16 gpu-test pods", lambda: len(owned_pods(fake, "app", "gpu-test")) == 16)
    wait(
        "every gpu-test pod bound",
        lambda: all(p["spec"].get("nodeName") for p in owned_pods(fake, "app", "gpu-test")),
        or_after_s=5.0,
    )
    kubectl(
        "get",
        "pods",
        "-l",
        "app=gpu-test",
        "-o",
        f"custom-columns={seed_columns}{extra}",
        "--sort-by=.metadata.creationTimestamp",
    )
    deployment_batches = next(
        (b for name, b in controllers.batches.items() if name.startswith("gpu-test-")), []
    )

    print("\n### Test 3: a Job of 4 pods asking for 2g.20gb (none left)")
    kubectl("apply", "-f", f"{rel}/test-job.yaml")
    wait(
        "test-gpu-job complete",
        lambda: (
            (fake.get("jobs", "test-gpu-job", namespace="default").get("status") or {}).get(
                "succeeded"
            )
            == 4
        ),
        or_after_s=10.0,
    )
    kubectl(
        "get",
        "jobs",
        "-o",
        "custom-columns=NAME:.metadata.name,COMPLETIONS:.status.succeeded,"
        "CONDITION:.status.conditions[0].type",
    )
    kubectl(
        "get", "pods", "-l", "job-name=test-gpu-job", "-o", f"custom-columns={seed_columns}{extra}"
    )
    return verdict(fake, deployment_batches)


def verdict(fake: FakeApiServer, deployment_batches: list[int]) -> int:
    pods = pods_by_state(fake)
    fell_back = [p for p in pods["bound"] if (p["metadata"].get("annotations") or {}).get(SEED_KEY)]
    free = free_devices(fake)
    stuck = [p for p in pods["pending"] if "nvidia.com/mig-2g.20gb" in mig_requests(p)]
    print("\n### Checks")
    checks = [
        ("pods pending on 2g.20gb while 1g.10gb is free", len(stuck), 0),
        (
            "gpu-test pods that fell back to 1g.10gb",
            sum(
                1 for p in fell_back if (p["metadata"].get("labels") or {}).get("app") == "gpu-test"
            ),
            5,
        ),
        (
            "test-gpu-job pods that fell back to 1g.10gb",
            sum(
                1
                for p in fell_back
                if (p["metadata"].get("labels") or {}).get("job-name") == "test-gpu-job"
            ),
            4,
        ),
        ("2g.20gb devices free", free.get("nvidia.com/mig-2g.20gb", 0), 0),
    ]
    failed = 0
    for what, got, want in checks:
        mark = "ok  " if got == want else "FAIL"
        failed += got != want
        print(f"{mark} {what}: {got} (expected {want})")
    print(f"     1g.10gb devices still free: {free.get('nvidia.com/mig-1g.10gb', 0)}")
    if deployment_batches:
        print(f"     the ReplicaSet created its pods in batches of {deployment_batches}")
    print("=== end of SIMULATION ===")
    return 1 if failed else 0


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="nvshare-sim-") as tmp:
        return run(Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
