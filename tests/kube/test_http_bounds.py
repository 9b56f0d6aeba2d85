"""The extender's and webhook's HTTP layer (`appliance.cluster.serving`) under a hostile peer.

Before: two loopback clients announcing 1.5 GiB each took the extender from 73 MB to 5.8 GB; a
100,000-deep JSON body was dropped with a RecursionError; every connection, idle or trickling,
held a thread for as long as it liked; SIGTERM did not stop it in 10 s. Loopback clients only,
every loop bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from certs import issue
from extender_client import ExtenderClient, args, gpu_pod
from kubernetes import client
from prometheus_client import CollectorRegistry

from appliance.cluster.cluster_view import ClusterView
from appliance.cluster.extender import Extender
from appliance.cluster.extender_server import MAX_BODY_BYTES, ExtenderServer
from appliance.cluster.serving import IN_FLIGHT, CacheBackedServer, ProbedHandler
from appliance.policy.model import Policy

WAIT = 30.0  # a bound for what takes a second or two; never a measurement


@pytest.fixture
def server() -> Iterator[ExtenderServer]:
    dead = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))  # nothing there
    cluster = ClusterView(api_client=dead, backoff=(5.0, 5.0))
    registry = CollectorRegistry()
    policy = Policy()
    server = ExtenderServer(
        extender=Extender(cluster=cluster, policy=lambda: policy, switch=True, registry=registry),
        registry=registry,
        host="127.0.0.1",
        port=0,
        sources=[cluster],
    )
    cluster.start()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def raw(server: ExtenderServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    return s


def answer_of(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
        if b"\r\n\r\n" in data and data.split(b"\r\n\r\n", 1)[1]:
            break
    return data


def still_serves(server: ExtenderServer) -> None:
    ext = ExtenderClient(server.port)
    try:
        assert ext.filter(args(gpu_pod(), ["a"]))["NodeNames"] == ["a"]
    finally:
        ext.close()


def test_a_body_announced_past_the_cap_is_a_413_before_a_byte_is_read(
    server: ExtenderServer,
) -> None:
    s = raw(server)
    s.sendall(
        b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {3 << 29}\r\n\r\n".encode()  # 1.5 GiB, never sent
    )
    answer = answer_of(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413") and f"at most {MAX_BODY_BYTES}".encode() in answer
    still_serves(server)


def test_json_nested_without_end_is_a_400_not_a_recursion_error(
    server: ExtenderServer, caplog: pytest.LogCaptureFixture
) -> None:
    ext = ExtenderClient(server.port)
    try:
        for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 500 + b"1" + b"}" * 500):
            status, text = ext.post("filter", deep)
            assert status == 400 and "nested deeper than 100 levels" in text
    finally:
        ext.close()
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text
    still_serves(server)


def test_past_the_connection_cap_a_new_connection_is_a_503_without_a_thread(
    server: ExtenderServer,
) -> None:
    server.max_connections = 4
    idle = [raw(server) for _ in range(4)]
    try:
        deadline = time.monotonic() + WAIT
        while server.connections < 4:  # accepted: each holds its thread and slot
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threads = threading.active_count()
        busy = raw(server)
        assert answer_of(busy).startswith(b"HTTP/1.1 503")
        busy.close()
        assert threading.active_count() <= threads
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + WAIT
    while server.connections:  # their threads saw the end and left
        assert time.monotonic() < deadline
        time.sleep(0.01)
    still_serves(server)


def test_one_peer_may_not_take_every_connection(server: ExtenderServer) -> None:
    server.max_per_peer = 2
    mine = [raw(server) for _ in range(2)]
    try:
        deadline = time.monotonic() + WAIT
        while server.connections < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        third = raw(server)
        assert answer_of(third).startswith(b"HTTP/1.1 503")
        third.close()
    finally:
        for s in mine:
            s.close()


def test_a_request_trickled_in_is_cut_off(server: ExtenderServer) -> None:
    class Impatient(server.RequestHandlerClass):  # type: ignore[name-defined,misc]
        timeout = 1
        request_s = 1.0

    server.RequestHandlerClass = Impatient
    server.request_deadline_s = 2.0
    s = raw(server)
    s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\n")
    deadline = time.monotonic() + WAIT
    cut = False
    while not cut:  # a header byte every 0.1 s: each read arrives well within the timeout
        assert time.monotonic() < deadline, "a trickling peer kept its connection"
        try:
            s.sendall(b"X")
            s.settimeout(0.1)
            cut = s.recv(1) == b""
        except TimeoutError:
            pass
        except OSError:
            cut = True
    s.close()
    still_serves(server)


def test_requests_past_the_turns_in_flight_are_told_to_retry(server: ExtenderServer) -> None:
    server.turn_wait_s = 0.2
    with contextlib.ExitStack() as held:
        for _ in range(IN_FLIGHT):  # every turn taken, as by as many slow requests
            held.enter_context(server.in_flight())
        ext = ExtenderClient(server.port)
        try:
            status, text = ext.post("filter", args(gpu_pod(), ["a"]))
            assert status == 503 and "retry later" in text
        finally:
            ext.close()
    still_serves(server)


def test_sigterm_stops_the_extender_while_peers_hold_it(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    command = [str(Path(sys.executable).parent / "nvshare-scheduler"), "extender"]
    env = {**os.environ, "NVSHARE_KUBE_API": "http://127.0.0.1:9"}
    proc = subprocess.Popen(
        [*command, f"--policy-dir={tmp_path}", "--host=127.0.0.1", f"--port={port}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        while "listening" not in proc.stderr.readline():
            assert proc.poll() is None, "the extender did not start"
        peers = []
        for _ in range(2):  # announce a huge body, send a little of it, wait
            s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1610612736\r\n\r\n[")
            peers.append(s)
        trickler = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        trickler.sendall(b"POST /filter HTTP/1.1\r\n")
        peers.append(trickler)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        for s in peers:
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_sigterm_stops_the_webhook_cleanly_while_peers_hold_it(tmp_path: Path) -> None:
    cert_file, key_file = issue(tmp_path)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    command = [str(Path(sys.executable).parent / "nvshare-scheduler"), "webhook"]
    proc = subprocess.Popen(
        [
            *command,
            f"--policy-dir={tmp_path}",
            f"--cert-file={cert_file}",
            f"--key-file={key_file}",
            "--host=127.0.0.1",
            f"--port={port}",
            "--kube-api=http://127.0.0.1:9",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        while "listening" not in proc.stderr.readline():
            assert proc.poll() is None, "the webhook did not start"
        peers = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(2)]
        peers[0].sendall(b"\x16\x03\x01")  # a TLS handshake begun, never finished
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0  # stopped, not killed by the signal
        for s in peers:
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_burst_of_connections_waits_in_the_backlog_not_in_syn_retries() -> None:
    """socketserver listens with a backlog of 5: the 7th connection of a burst to the webhook
    or the extender had its SYN dropped and retried a second later. They take the kernel's
    maximum, as the node daemon's socket does."""
    server = CacheBackedServer(("127.0.0.1", 0), ProbedHandler)  # bound, listening, not accepting
    burst = []
    try:
        for _ in range(64):
            burst.append(socket.create_connection(("127.0.0.1", server.port), timeout=0.5))
    finally:
        for s in burst:
            s.close()
        server.server_close()
    assert len(burst) == 64
