"""nvsharectl policy validate/show/explain, hot reload into connected clients, and metrics."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from appliance.cli.client import ControlClient
from appliance.wire import protocol as p

from .conftest import BIN, ROOT, RunningDaemon, start_daemon, track

GiB = 1 << 30
GPU = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def ctl(d: RunningDaemon | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = d.env if d else dict(os.environ)
    return subprocess.run(
        [str(BIN / "nvsharectl"), *args], env=env, capture_output=True, text=True, timeout=30
    )


def registered(d: RunningDaemon) -> ControlClient:
    c = ControlClient.as_hook(d.socket_dir, timeout=5)
    track(c._sock)
    assert isinstance(
        c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 * GiB)), p.Registered
    )
    return c


def test_validate_lists_every_error_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  mode: sometimes\ndefaults:\n  memoryLimit: 4Gx\n")
    r = ctl(None, "policy", "validate", str(bad))
    assert r.returncode == 1
    assert "bad.yaml:2" in r.stderr and "/scheduler/mode" in r.stderr
    assert "bad.yaml:4" in r.stderr and "/defaults/memoryLimit" in r.stderr
    shipped = [ROOT / "configmaps" / "default", *(ROOT / "configmaps" / "examples").iterdir()]
    r = ctl(None, "policy", "validate", *map(str, shipped))
    assert r.returncode == 0, r.stderr


def validate(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "nvsharectl"), "policy", "validate", *args],
        input=stdin, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_the_shipped_examples_validate_as_the_configmaps_they_are() -> None:
    """`validate configmaps/examples` used to read each manifest as a policy file: 12 errors,
    `unknown field 'apiVersion' (did you mean 'version'?)`."""
    r = validate(str(ROOT / "configmaps" / "examples"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout == f"ok: {ROOT / 'configmaps' / 'examples'}\n"


def test_a_manifest_directory_names_the_file_key_and_line_of_each_error(tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "configmaps" / "examples", examples)
    manifest = examples / "team-quotas.yaml"
    lines = manifest.read_text().splitlines(keepends=True)
    [at] = [i for i, line in enumerate(lines) if "timeQuantum: 30s" in line]
    lines[at] = lines[at].replace("30s", "30 parsecs")
    manifest.write_text("".join(lines))
    r = validate(str(examples))
    assert r.returncode == 1
    errors = r.stderr.splitlines()
    assert errors[0].startswith(
        f"{manifest}: data[10-scheduler.yaml]:{at + 1}: /scheduler/timeQuantum: "
    ), errors
    assert errors[1:] == ["1 error(s)"]
    assert "apiVersion" not in r.stderr


def test_standard_input_is_read_for_a_dash() -> None:
    bad = "scheduler:\n  mode: sometimes\n"
    r = validate("-", stdin=bad)
    assert r.returncode == 1
    assert "<stdin>:2: /scheduler/mode: 'sometimes' is not one of" in r.stderr
    r = validate("-", stdin=(ROOT / "configmaps" / "examples" / "workstation.yaml").read_text())
    assert (r.returncode, r.stdout) == (0, "ok: standard input\n"), r.stderr


def test_a_rendered_deploy_validates_its_policy_and_says_what_it_skipped() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy")], capture_output=True, text=True, timeout=60
    )
    if rendered.returncode != 0:
        pytest.skip(f"`kubectl kustomize` cannot render deploy/ here: {rendered.stderr.strip()}")
    r = validate("-", stdin=rendered.stdout)
    assert (r.returncode, r.stdout) == (0, "ok: standard input\n"), r.stderr
    assert (
        "<stdin>: skipped ConfigMap nvshare-scheduler-config: labelled "
        "app.kubernetes.io/component=extender, not policy"
    ) in r.stderr
    assert "<stdin>: skipped what is not a ConfigMap: Namespace nvshare-system," in r.stderr
    assert "DaemonSet nvshare-node" in r.stderr
    live = "    #   perPod: 256"  # the default file shows every setting commented out
    assert live in rendered.stdout
    broken = rendered.stdout.replace("    # connections:", "    connections:").replace(
        live, "      perPod: lots"
    )
    r = validate("-", stdin=broken)
    assert r.returncode == 1, r.stderr
    assert "<stdin>: nvshare-policy data[00-default.yaml]:" in r.stderr  # two ConfigMaps: named
    assert "/connections/perPod" in r.stderr


def test_hot_reload_reaches_connected_clients_and_bad_files_keep_the_last_good(
    tmp_path: Path,
) -> None:
    d = start_daemon(tmp_path, "defaults: {memoryLimit: 1Gi}\n")
    try:
        c = registered(d)
        (d.policy_dir / "policy.yaml").write_text("defaults: {memoryLimit: 2Gi}\n")
        _, update = c.receive()
        assert isinstance(update, p.LimitUpdate) and update.limits.mem_limit == 2 * GiB
        (d.policy_dir / "policy.yaml").write_text("defaults: {memoryLimit: [oops\n")
        deadline = time.monotonic() + 5
        while True:
            doc = json.loads(ctl(d, "status", "--json").stdout)
            if not doc["policy"]["valid"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert doc["policy"]["valid"] is False and "policy.yaml" in doc["policy"]["last_error"]
        assert doc["clients"][0]["memory_limit"] == 2 * GiB  # the last good policy stays
        text = ctl(d, "status").stdout
        assert "INVALID (last good kept)" in text
    finally:
        d.stop()


def test_show_and_explain_say_where_each_value_came_from(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path,
        "scheduler: {timeQuantum: 12s}\n"
        "rules:\n- name: root-jobs\n  match: {uid: 0}\n  memoryLimit: 3Gi\n",
    )
    try:
        registered(d)
        show = ctl(d, "policy", "show")
        assert show.returncode == 0
        assert '/scheduler/timeQuantum = "12s"    # policy.yaml' in show.stdout
        explain = ctl(d, "policy", "explain", "--pid", str(os.getpid()))
        assert explain.returncode == 0, explain.stderr
        assert "3Gi (from rule 'root-jobs'" in explain.stdout
        missing = ctl(d, "policy", "explain", "--pid", "1")
        assert missing.returncode == 1 and "no connected client" in missing.stderr
    finally:
        d.stop()


def test_explain_without_a_client_says_which_file_won_each_field(tmp_path: Path) -> None:
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "00-default.yaml").write_text(
        (ROOT / "configmaps/default/00-default.yaml").read_text()
    )
    (policy_dir / "10-site.yaml").write_text("realtimeCheck: {mode: warning}\n")
    (policy_dir / "30-realtime.yaml").write_text(
        "realtimeCheck: {mode: strict, safetyMargin: 200Mi}\n"
    )
    d = start_daemon(tmp_path)
    try:
        explain = ctl(d, "policy", "explain")
        assert explain.returncode == 0, explain.stderr
        lines = explain.stdout.splitlines()
        assert lines[0] == (
            "# files in merge order (a later one wins): 00-default.yaml, 10-site.yaml, "
            "30-realtime.yaml, zz-test-metrics.yaml"
        )
        assert (
            '/realtimeCheck/mode = "strict"    # 30-realtime.yaml (overrides 10-site.yaml)' in lines
        )
        assert '/realtimeCheck/safetyMargin = "200Mi"    # 30-realtime.yaml' in lines
        assert not [line for line in lines if "/scheduler/" in line]  # defaults: not listed
        show = ctl(d, "policy", "show").stdout
        assert (
            '/realtimeCheck/mode = "strict"    # 30-realtime.yaml (overrides 10-site.yaml)' in show
        )
    finally:
        d.stop()


def test_limit_set_and_clear_from_the_cli(daemon: RunningDaemon) -> None:
    c = registered(daemon)
    r = ctl(daemon, "limit", "set", "--pid", str(os.getpid()), "512")  # bare number: MiB
    assert r.returncode == 0 and "1 connected client" in r.stdout
    _, update = c.receive()
    assert update.limits.mem_limit == 512 << 20
    r = ctl(daemon, "limit", "clear", "--pid", str(os.getpid()))
    assert r.returncode == 0
    _, update = c.receive()
    assert update.limits.mem_limit == 0
    # One log line per change pushed to the hook: who, old -> new, and what set it.
    changes = [line for line in daemon.output().splitlines() if "limits of client" in line]
    assert len(changes) == 2, changes
    assert f"(pid {os.getpid()}): memory unlimited -> 512Mi (from nvsharectl" in changes[0]
    assert "memory 512Mi -> unlimited (from " in changes[1]
    r = ctl(daemon, "limit", "set", "--pid", "5", "--core", "0")
    assert r.returncode == 2  # click refuses 0 before anything is sent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_and_health_endpoints(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path, f"metrics: {{enabled: true, address: '127.0.0.1:{port}'}}\n")
    try:
        registered(d)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                body = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert "nvshare_scheduler_clients 1.0" in body
        assert f'nvshare_gpu_mode{{gpu_uuid="{GPU}"}} 1.0' in body
        assert "nvshare_policy_valid 1.0" in body
        assert urllib.request.urlopen(f"{base}/healthz", timeout=5).status == 200
        assert urllib.request.urlopen(f"{base}/readyz", timeout=5).status == 200
    finally:
        d.stop()


def test_nvshare_environment_overrides_are_shown_as_such(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path, "scheduler: {computeWindow: 2s}\n", extra_env={"NVSHARE_COMPUTE_WINDOW_MS": "500"}
    )
    try:
        status = ctl(d, "status")
        assert (
            "override from environment: NVSHARE_COMPUTE_WINDOW_MS (/scheduler/computeWindow)"
            in status.stdout
        )
        show = ctl(d, "policy", "show").stdout
        assert "/scheduler/computeWindow" in show and "env NVSHARE_COMPUTE_WINDOW_MS" in show
    finally:
        d.stop()


def run_daemon_briefly(tmp_path: Path, policy: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "policy").mkdir(exist_ok=True)
    (tmp_path / "policy" / "policy.yaml").write_text(policy)
    return subprocess.run(
        [str(BIN / "nvshare-scheduler"), "--policy-dir", str(tmp_path / "policy"), *args],
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path / "run")},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_an_invalid_policy_at_start_is_refused_with_every_error(tmp_path: Path) -> None:
    r = run_daemon_briefly(tmp_path, "scheduler:\n  mode: sometimes\n  timeQuantum: 5 parsecs\n")
    assert r.returncode == 2
    assert "refusing to start" in r.stderr
    assert "policy.yaml:2" in r.stderr and "policy.yaml:3" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("where", "problem"), [("file", "is not a directory"), ("file/run", "Not a directory")]
)
def test_an_unusable_socket_directory_is_one_clear_error(
    tmp_path: Path, where: str, problem: str
) -> None:
    (tmp_path / "file").write_text("")
    r = run_daemon_briefly(
        tmp_path, "metrics: {enabled: false}\n", "--socket-dir", str(tmp_path / where)
    )
    assert r.returncode == 1
    (line,) = [x for x in r.stderr.splitlines() if "refusing to start" in x]
    assert problem in line and "point NVSHARE_SOCKET_DIR (--socket-dir) at a directory" in line
    assert "run as root" not in line and "Traceback" not in r.stderr


def test_a_busy_metrics_port_leaves_scheduling_running(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = start_daemon(tmp_path, f"metrics: {{enabled: true, address: '127.0.0.1:{port}'}}\n")
        try:
            registered(d)  # the socket server still serves
            assert "metrics disabled: cannot serve on" in d.output()
        finally:
            d.stop()
