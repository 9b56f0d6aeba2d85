"""The node daemon's probes mean something: /healthz is answered by its event loop, and /readyz
waits for the pod list and the device plugin's registration, and fails while RBAC refuses a
verb, saying which."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from pathlib import Path

import pytest
from kube import manifests
from kube.fake_kubelet import FakeKubelet
from kube.fakeapi import FakeApiServer

from appliance.daemon.daemon import Daemon

from .inprocess import daemon_config, eventually, free_port, probe, run_with, without_nvml


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_wedged_event_loop_fails_healthz_and_a_running_one_passes_on_both_families(
    tmp_path: Path,
) -> None:
    port = free_port()
    daemon = Daemon(
        daemon_config(tmp_path, f"metrics: {{address: '[::]:{port}'}}\n"), nvml=without_nvml()
    )

    def body(d: Daemon) -> None:
        eventually(lambda: probe(port, "/healthz")[0] == 200, "the daemon serving")
        assert probe(port, "/readyz") == (200, "ok\n")  # no pod watch, no device plugin
        if ipv6_loopback():  # the default listens on both families
            assert probe(port, "/healthz", host="::1") == (200, "ok\n")
        loop = d.serving.result(timeout=5).loop
        release = threading.Event()
        # A handler that blocks the loop, as a blocking call on the loop would.
        loop.call_soon_threadsafe(release.wait, 60)
        try:
            status, text = probe(port, "/healthz")
            assert status == 503 and "event loop did not answer within" in text
            assert probe(port, "/readyz")[0] == 503
        finally:
            release.set()
        eventually(lambda: probe(port, "/healthz") == (200, "ok\n"), "healthy again")

    assert run_with(daemon, body) == 0


def test_probes_answer_on_their_own_address_with_metrics_disabled(tmp_path: Path) -> None:
    """Seed 003's deployments set NVSHARE_METRICS_ENABLE=0; kubelet must still get answers."""
    metrics, probes = free_port(), free_port()
    policy = f"metrics: {{enabled: false, address: '[::]:{metrics}'}}\n"
    daemon = Daemon(
        daemon_config(tmp_path, policy, probe_address=f"[::]:{probes}"), nvml=without_nvml()
    )

    def body(d: Daemon) -> None:
        eventually(lambda: probe(probes, "/healthz")[0] == 200, "the daemon serving probes")
        assert probe(probes, "/readyz") == (200, "ok\n")
        assert probe(probes, "/metrics")[0] == 404  # only the probes here
        assert probe(metrics, "/healthz")[0] == 0  # metrics off: nothing listens there

    assert run_with(daemon, body) == 0


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    fake = FakeApiServer().start()
    fake.add_node("node-1")
    path = fake.write_kubeconfig(
        tmp_path / "kubeconfig", namespace="nvshare-system", service_account="nvshare-node"
    )
    monkeypatch.setenv("KUBECONFIG", path)  # the daemon's credentials, as in a pod
    yield fake
    fake.stop()


def test_rbac_refusing_a_verb_keeps_the_daemon_unready_and_names_the_verb(
    tmp_path: Path, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appliance.kube.access")
    api.load_rbac(manifests.rendered_without("nvshare-node", "pods", "watch"))
    port = free_port()
    config = daemon_config(tmp_path, f"metrics: {{address: '[::]:{port}'}}\n", node_name="node-1")

    def body(d: Daemon) -> None:
        _, text = eventually(
            lambda: (got := probe(port, "/readyz"))[0] == 503 and "RBAC" in got[1] and got,
            "not ready for want of a verb",
        )
        assert "RBAC forbids watch pods" in text
        assert probe(port, "/healthz")[0] == 200  # a restart would not help: stay alive
        [said] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "forbids watch pods" in said.getMessage()
        assert "verb 'watch' on resource 'pods'" in said.getMessage()
        api.load_rbac(list(manifests.rendered()))  # the operator fixes the role
        eventually(lambda: probe(port, "/readyz") == (200, "ok\n"), "ready once it may watch")

    assert run_with(Daemon(config, nvml=without_nvml()), body) == 0
    assert any("RBAC allows watch pods now" in r.getMessage() for r in caplog.records)


def test_not_ready_until_the_first_pod_list_is_in(tmp_path: Path, api: FakeApiServer) -> None:
    api.load_rbac(list(manifests.rendered()))
    port = free_port()  # before its port is free again: it must not be given out twice
    api.stop()  # the API server is away as the daemon starts
    config = daemon_config(tmp_path, f"metrics: {{address: '[::]:{port}'}}\n", node_name="node-1")

    def body(d: Daemon) -> None:
        eventually(lambda: probe(port, "/healthz")[0] == 200, "the daemon serving")
        status, text = probe(port, "/readyz")
        assert status == 503 and "the first list of node node-1's pods is not in yet" in text
        api.start()  # back on the same port
        eventually(lambda: probe(port, "/readyz") == (200, "ok\n"), "ready once listed")

    assert run_with(Daemon(config, nvml=without_nvml()), body) == 0


def test_not_ready_until_the_device_plugin_is_registered_with_kubelet(tmp_path: Path) -> None:
    kubelet_dir = tmp_path / "device-plugins"
    kubelet_dir.mkdir()
    port = free_port()
    config = daemon_config(
        tmp_path,
        f"metrics: {{address: '[::]:{port}'}}\n",
        device_plugin=True,
        device_plugin_dir=kubelet_dir,
        hook_host_path=str(tmp_path / "lib" / "libnvshare.so"),
    )
    kubelets: list[FakeKubelet] = []

    def body(d: Daemon) -> None:
        eventually(lambda: probe(port, "/healthz")[0] == 200, "the daemon serving")
        status, text = probe(port, "/readyz")
        assert status == 503 and "device plugin is not registered with kubelet" in text
        kubelets.append(FakeKubelet(kubelet_dir))  # kubelet comes up: kubelet.sock appears
        eventually(lambda: probe(port, "/readyz") == (200, "ok\n"), "ready once registered")

    try:
        assert run_with(Daemon(config, nvml=without_nvml()), body) == 0
    finally:
        for kubelet in kubelets:
            kubelet.stop()


def test_where_the_host_has_no_ipv6_it_listens_on_ipv4_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from appliance.web.listen import bind

    asked: list[tuple[str, int]] = []

    def make(address: tuple[str, int]) -> tuple[str, int]:
        asked.append(address)
        if ":" in address[0]:  # what socket(AF_INET6) raises with ipv6.disable=1
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return address

    assert bind(make, "", 9402, what="metrics") == ("0.0.0.0", 9402)  # type: ignore[type-var]
    assert asked == [("::", 9402), ("0.0.0.0", 9402)]
    assert "metrics: this host has no IPv6" in caplog.text and "IPv4 only" in caplog.text
    with pytest.raises(OSError):  # an explicit IPv6 address is not replaced
        bind(make, "::1", 9402, what="metrics")  # type: ignore[type-var]
