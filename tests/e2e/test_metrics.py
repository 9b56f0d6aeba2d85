"""End to end on the CPU: /metrics of a real daemon with hooked fake-driver clients in two pods.

The fake API server has the pods, the fake libnvidia-ml.so.1 shows the daemon what NVML would
(utilisation, memory in use, what each probe process holds), and the probes allocate and
launch under the hook; they name their pod, which counts because the policy trusts this uid's
claims (`trust.podClaimUids`). Scraped over HTTP and parsed as Prometheus would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon.conftest import RunningDaemon, start_daemon
from kube import manifests
from kube.extender_client import eventually
from kube.fakeapi import FakeApiServer
from prometheus_client.parser import text_string_to_metric_families

from .probes import BUILD, ROOT, GiB, Probe
from .test_realtime_scheduling import free_port

MiB = 1 << 20
OOM = "err 2"


@dataclass
class Node:
    daemon: RunningDaemon
    nvml_state: Path
    port: int

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float | None:
        return self.scrape().get((name, frozenset(labels.items())))

    def exported(self) -> tuple[set[str], dict[str, set[str]]]:
        """Every metric name the daemon exports (samples or not), and each one's label names."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        labels: dict[str, set[str]] = {}
        for (name, found), _ in self.scrape().items():
            labels.setdefault(name, set()).update(k for k, _ in found)
        return names, labels


@pytest.fixture
def node() -> Iterator[Node]:
    subprocess.run(["make", "-s", "-C", str(BUILD.parent)], check=True)
    api = FakeApiServer().start()
    api.add_node("node-1")
    api.add_pod(
        "pod-a",
        namespace="team",
        node="node-1",
        annotations={"nvshare.com/gpu-memory-limit": "1Gi"},
    )
    api.add_pod("pod-b", namespace="team", node="node-1")
    tmp = Path(tempfile.mkdtemp(prefix="nvs-m-"))  # short: the socket path must fit
    api.load_rbac(list(manifests.rendered()))
    kubeconfig = api.write_kubeconfig(
        tmp / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
    )
    state = tmp / "nvml-state"
    state.write_text("")
    port = free_port()
    d = start_daemon(
        tmp,
        f"scheduler: {{mode: 'on', timeQuantum: 1s}}\nmetrics: {{address: '127.0.0.1:{port}'}}\n"
        f"trust: {{podClaimUids: [{os.getuid()}]}}\n",
        args=["--node-name", "node-1"],
        extra_env={
            "KUBECONFIG": kubeconfig,
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "NVSHARE_FAKE_GPU_MEM": str(16 * GiB),
            "NVSHARE_FAKE_NVML_STATE": str(state),
        },
    )
    try:
        yield Node(d, state, port)
    finally:
        d.stop()
        api.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_scrape_shows_each_client_and_pod_as_the_scheduler_and_nvml_see_them(
    node: Node,
) -> None:
    a1, a2 = Probe(node.daemon, "team", "pod-a"), Probe(node.daemon, "team", "pod-a")
    b = Probe(node.daemon, "team", "pod-b")
    for probe in (a1, a2, b):  # a memory query registers the probe on its GPU
        assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    uuid_of = {}

    def client(probe: Probe) -> dict[str, str] | None:
        for (name, labels), _ in node.scrape().items():
            found = dict(labels)
            if name == "nvshare_client_info" and found["host_pid"] == str(probe.pid):
                uuid_of[probe.pid] = found["gpu_uuid"]
                return {k: v for k, v in found.items() if k not in ("gpu_index", "host_pid")}
        return None

    eventually(lambda: None not in (client(a1), client(a2), client(b)), "clients in /metrics")
    # over the limit its hook knows: asked all the same (a raise may be on its way), refused
    eventually(lambda: a1.try_alloc(2 * GiB) == OOM, "pod-a's 1Gi limit")
    assert a1.ask(f"alloc mem {512 * MiB}").startswith("ok")
    assert a2.try_alloc(600 * MiB) == OOM  # within the hook's view, refused by the daemon
    node.nvml_state.write_text(
        f"0 {3 * GiB} 3 42 {a1.pid}:{700 * MiB} {a2.pid}:{300 * MiB} {b.pid}:{500 * MiB}\n"
    )
    racers = [threading.Thread(target=p.ask, args=("launchfor 2500 1",)) for p in (a1, b)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()

    la, l2, lb = client(a1), client(a2), client(b)
    assert la is not None and l2 is not None and lb is not None
    assert (la["namespace"], la["pod"], lb["pod"]) == ("team", "pod-a", "pod-b")
    gpu = {"gpu_uuid": uuid_of[a1.pid], "gpu_index": "0"}
    eventually(lambda: node.value("nvshare_gpu_utilization_ratio", **gpu) == 0.42, "NVML util")
    nvml_a1 = {**la, "host_pid": str(a1.pid)}
    eventually(
        lambda: node.value("nvshare_client_nvml_used_bytes", **nvml_a1) == 700 * MiB,
        "what NVML shows a1's process holding",
    )
    assert node.value("nvshare_gpu_memory_used_bytes", **gpu) == 3 * GiB
    assert node.value("nvshare_client_managed_allocated_bytes", **la) == 512 * MiB
    assert node.value("nvshare_client_memory_limit_bytes", **la) == GiB
    assert node.value("nvshare_client_memory_limit_bytes", **lb) is None  # no limit, not 0
    assert node.value("nvshare_scheduler_memory_refusals_total", decided_by="scheduler") == 2
    assert not node.value("nvshare_scheduler_memory_refusals_total", decided_by="hook")
    assert node.value("nvshare_client_memory_refusals_total", **la) == 1
    assert node.value("nvshare_client_memory_refusals_total", **l2) == 1

    # Lock time grows while a client holds: read it once the last holder let go (idle release).
    eventually(
        lambda: node.value("nvshare_gpu_lock_holders", gpu_uuid=uuid_of[a1.pid]) == 0,
        "the lock free again",
    )
    held_a = node.value("nvshare_client_lock_held_seconds_total", **la) or 0
    held_b = node.value("nvshare_client_lock_held_seconds_total", **lb) or 0
    waited = sum(node.value("nvshare_client_lock_wait_seconds_total", **x) or 0 for x in (la, lb))
    drops = sum(
        node.value("nvshare_client_drops_total", **x, reason="quantum") or 0 for x in (la, lb)
    )
    assert held_a > 0.5 and held_b > 0.5 and waited > 0.5  # they took turns for 2.5 s each
    assert drops >= 1
    pod_a = {"namespace": "team", "pod": "pod-a"}
    assert node.value("nvshare_pod_lock_held_seconds_total", **pod_a) == pytest.approx(held_a)
    assert node.value("nvshare_pod_clients", **pod_a) == 2

    assert a2.close() == 0  # a departed client takes its series along; its pod stays
    eventually(lambda: node.value("nvshare_pod_clients", **pod_a) == 1, "a2 gone")
    assert node.value("nvshare_client_memory_refusals_total", **l2) is None
    assert node.value("nvshare_pod_lock_held_seconds_total", **pod_a) == pytest.approx(held_a)
    assert "Traceback" not in node.daemon.output()


DASHBOARD = ROOT / "deploy" / "grafana" / "nvshare.json"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    panels = [p for p in doc["panels"]] + [
        p for row in doc["panels"] for p in row.get("panels", [])
    ]
    queries = [t["expr"] for p in panels for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            queries.append(var["query"]["query"])
    return queries


def test_the_grafana_dashboard_asks_only_for_what_the_daemon_exports(node: Node) -> None:
    quota = Probe(node.daemon, "team", "pod-a", NVSHARE_GPU_CORE_LIMIT="50")
    other = Probe(node.daemon, "team", "pod-b")
    for probe in (quota, other):
        assert probe.ask("init") == "ok" and probe.ask("total").startswith("ok")
    node.nvml_state.write_text(f"0 {GiB} 2 10 {quota.pid}:{GiB // 2} {other.pid}:{GiB // 2}\n")
    assert quota.ask("launchfor 300 1").startswith("ok")  # a quota window with use in it
    needed = ("nvshare_client_core_window_usage_ms", "nvshare_client_nvml_used_bytes")
    eventually(lambda: all(n in node.exported()[1] for n in needed), "every series there")
    names, labels = node.exported()

    queries = dashboard_queries()
    assert len(queries) >= 15
    for query in queries:
        used = set(re.findall(r"\bnvshare_[a-z0-9_]+\b", query))
        assert used, f"a query without an nvshare metric: {query}"
        assert used <= names, f"{query}: not exported: {sorted(used - names)}"
        grouped = {
            label.strip()
            for clause in re.findall(
                r"\b(?:by|on|without|group_left|group_right)\s*\(([^)]*)\)", query
            )
            for label in clause.split(",")
            if label.strip()
        }
        grouped |= set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", query))
        grouped |= set(re.findall(r"label_values\([^,]+,\s*([a-z_]+)\)", query))
        have = set().union(*(labels.get(n, set()) for n in used))
        assert grouped - TARGET_LABELS <= have, f"{query}: no such label: {grouped - have}"
