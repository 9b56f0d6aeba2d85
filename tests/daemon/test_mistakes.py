"""Every mistake gets a message: the real CLIs and a real daemon, given what users get wrong.

Each case used to end in a traceback, a silent success or a daemon that stole another's socket;
now it is one line that says what, where and what was kept, and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from appliance.cli.client import ControlClient
from appliance.wire import framing
from appliance.wire import protocol as p

from .conftest import BIN, RunningDaemon, start_daemon, track

GPU = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def run(program: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run(
        [str(BIN / program), *args],
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ctl(d: RunningDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    return run("nvsharectl", *args, env=d.env)


def one_line(text: str) -> str:
    """The single line a user sees; there must be no traceback around it."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def registered(d: RunningDaemon, **hints: str) -> ControlClient:
    c = ControlClient.as_hook(d.socket_dir, timeout=5)
    track(c._sock)
    reply = c.request(p.Register(pid=0, gpu_uuid=GPU, gpu_total_mem=80 << 30, **hints))  # type: ignore[arg-type]
    assert isinstance(reply, p.Registered)
    return c


# ------------------------------------------------------------------ nvsharectl, offline


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["limit", "set", "--pid", "-3", "1Gi"], "-3 is not in the range 1<=x<=4194304"),
        (["limit", "set", "--pid", "7", "99999999Pi"], "'99999999Pi' is too large"),
        (["limit", "set", "--pid", "7", "1ki"], "did you mean Ki?"),
        (["limit", "set", "--pid", "7", "0"], "must be greater than 0"),
        (["limit", "set", "--pod", "trainer", "1Gi"], "say default/trainer"),
        (["-T", "99999999999999"], "is not from 1 to 86400 seconds"),
        (["-T", "100000000"], "is not from 1 to 86400 seconds"),
        (["-T", "soon"], "'soon' is not a whole number of seconds, or 'policy'"),
        (["--socket-dir", "", "status"], "'--socket-dir': an empty path names no directory"),
        (["--control-dir", "", "status"], "'--control-dir': an empty path names no directory"),
        (
            ["limit", "set", "--pid", "99999999999999999999", "1Gi"],
            "99999999999999999999 is not in the range 1<=x<=4194304",
        ),
        (["policy", "explain", "--pid", "99999999999999999999"], "not in the range 1<=x<="),
        (["limit", "set", "--pid", "7", "-5Gi"], "-5Gi: a memory limit must be positive"),
        (["limit", "set", "-5", "--pid", "7"], "MEMORY: -5: a memory limit must be positive"),
        (["limit", "set", "--pid", "7", "--", "-5Gi"], "-5Gi: a memory limit must be positive"),
        (
            ["limit", "set", "--pod", "Default/trainer", "1Gi"],
            "namespace 'Default' is not a Kubernetes namespace: at most 63 lowercase letters",
        ),
        (
            ["limit", "set", "--pod", "default/UPPER_case", "1Gi"],
            "pod name 'UPPER_case' is not a Kubernetes pod name: at most 253 lowercase",
        ),
        (
            ["limit", "set", "--pod", "default/" + "a" * 300, "1Gi"],
            "a pod name of 300 characters ('aaaaaaaaaaaaaaaaaaaa'...) is longer than Kubernetes "
            "allows: at most 253 (a DNS-1123 subdomain)",
        ),
        (
            ["limit", "clear", "--pod", "n" * 64 + "/trainer"],
            "a namespace of 64 characters",
        ),
        (
            ["limit", "clear", "--pod", "ml/trainer", "--no-memory", "--no-core"],
            "--no-memory and --no-core together leave nothing to clear",
        ),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    r = run("nvsharectl", "--socket-dir", str(tmp_path), *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in " ".join(r.stderr.split())


@pytest.mark.parametrize("program", ["nvsharectl", "nvshare-scheduler"])
def test_both_clis_say_their_version(program: str) -> None:
    r = run(program, "--version")
    assert r.returncode == 0 and r.stdout.startswith(f"{program}, version ")


def test_help_summaries_are_whole_sentences() -> None:
    for group in ([], ["limit"], ["policy"]):
        listing = run("nvsharectl", *group, "--help").stdout.split("Commands:")[1]
        assert "..." not in listing and "(e.g." not in listing, listing


# ------------------------------------------------------------------ the daemon, at start


def start_briefly(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    policy = tmp_path / "policy"
    policy.mkdir(exist_ok=True)
    (policy / "p.yaml").write_text("metrics: {enabled: false}\n")
    environ = {**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path / "run"), **env}
    environ.pop("KUBERNETES_SERVICE_HOST", None)
    return run("nvshare-scheduler", "--policy-dir", str(policy), *args, env=environ)


def refusal(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "refusing to start" in x]
    return line


def test_a_socket_directory_whose_parent_is_missing_is_refused_not_made(tmp_path: Path) -> None:
    """A mistyped --socket-dir used to become a whole new tree (as root) where no hook looks."""
    wanted = tmp_path / "nonexistent" / "a" / "b" / "c"
    r = start_briefly(tmp_path, "--socket-dir", str(wanted))
    line = refusal(r)
    assert f"cannot create {wanted}: its parent {wanted.parent} does not exist" in line
    assert "NVSHARE_SOCKET_DIR (--socket-dir)" in line
    assert not (tmp_path / "nonexistent").exists()


def test_a_socket_directory_in_an_existing_parent_is_made(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)  # tmp_path/run: only the last component is new
    try:
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o755
        assert (tmp_path / "run-control" / "control.sock").exists()
    finally:
        d.stop()


def test_a_pod_watch_without_a_kubeconfig_is_refused_before_listening(tmp_path: Path) -> None:
    r = start_briefly(tmp_path, "--node-name", "n1", KUBECONFIG=str(tmp_path / "none"))
    line = refusal(r)
    assert "--node-name n1: no way to reach the Kubernetes API server" in line
    assert "--kube-api" in line
    assert not (tmp_path / "run" / "scheduler.sock").exists()


@pytest.mark.skipif(
    Path("/var/lib/kubelet/device-plugins").exists(), reason="this machine runs a kubelet"
)
def test_a_device_plugin_without_kubelet_is_refused_before_listening(tmp_path: Path) -> None:
    line = refusal(start_briefly(tmp_path, "--device-plugin"))
    assert "kubelet's device-plugin directory /var/lib/kubelet/device-plugins" in line
    assert not (tmp_path / "run" / "scheduler.sock").exists()


def test_an_admin_group_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    line = refusal(start_briefly(tmp_path, "--admin-group", "nosuchgroup"))
    assert "--admin-group 'nosuchgroup' is not a group on this machine" in line


def test_a_missing_policy_directory_says_how_to_give_one(tmp_path: Path) -> None:
    r = run(
        "nvshare-scheduler",
        "--policy-dir",
        str(tmp_path / "nowhere"),
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path / "run")},
    )
    line = refusal(r)
    assert "does not exist; give one with --policy-dir DIR (env NVSHARE_POLICY_DIR)" in line
    assert "cannot watch" not in r.stderr  # no confusing warning before it


def test_a_policy_directory_that_is_a_file_is_called_so(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("scheduler: {mode: 'on'}\n")
    r = run(
        "nvshare-scheduler",
        "--policy-dir",
        str(policy),
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(tmp_path / "run")},
    )
    line = refusal(r)
    assert f"--policy-dir {policy} is not a directory" in line and "does not exist" not in line


def test_a_control_directory_that_is_a_file_is_called_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = run("nvsharectl", "--control-dir", str(tmp_path / "file"), "status")
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        f"nvsharectl: no nvshare scheduler can be at {tmp_path}/file/control.sock: "
        f"{tmp_path}/file is not a directory (check --socket-dir, --control-dir, "
        "NVSHARE_SOCKET_DIR and NVSHARE_CONTROL_DIR)"
    )


def test_a_reader_that_stops_reading_ends_nvsharectl_quietly(daemon: RunningDaemon) -> None:
    """`nvsharectl status | head -2`: no message, and the shell's exit status for a program
    whose output pipe closed (128 + SIGPIPE), as `cat` gives."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line is written
    try:
        r = subprocess.run(
            [str(BIN / "nvsharectl"), "status"],
            env=daemon.env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
        )
    finally:
        os.close(write_end)
    assert r.stderr == "" and r.returncode == 128 + signal.SIGPIPE


def test_a_webhook_certificate_that_is_not_there_is_named(tmp_path: Path) -> None:
    key = tmp_path / "tls.key"
    key.write_text("")
    r = run(
        "nvshare-scheduler", "webhook", "--cert-file", "/nonexistent.pem", "--key-file", str(key)
    )
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        "nvshare-scheduler webhook: --cert-file /nonexistent.pem: no readable file there"
    )


def test_an_extender_without_a_kubeconfig_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "policy").mkdir()
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    r = run("nvshare-scheduler", "extender", "--policy-dir", str(tmp_path / "policy"), env=env)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "refusing to start: no way to reach the Kubernetes API server" in line
    assert "--kube-api" in line


def test_the_webhook_and_the_extender_refuse_a_missing_kubeconfig_alike(tmp_path: Path) -> None:
    """One start-up shape for both cluster programs: the same line, the same status."""
    (tmp_path / "policy").mkdir()
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("")
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    webhook = run(
        "nvshare-scheduler",
        "webhook",
        f"--policy-dir={tmp_path / 'policy'}",
        f"--cert-file={tmp_path / 'tls.crt'}",
        f"--key-file={tmp_path / 'tls.key'}",
        "--port=0",
        env=env,
    )
    extender = run("nvshare-scheduler", "extender", f"--policy-dir={tmp_path / 'policy'}", env=env)
    said = [one_line(r.stderr).split(": ", 1)[1] for r in (webhook, extender)]
    assert [r.returncode for r in (webhook, extender)] == [1, 1]
    assert said[0] == said[1]
    assert said[0].startswith("refusing to start: no way to reach the Kubernetes API server")


def test_an_unreachable_api_server_is_logged_in_short_lines(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, args=["--node-name", "n1", "--kube-api", "http://127.0.0.1:9"])
    try:
        deadline = time.monotonic() + 20
        while "failed (cannot reach the API server" not in d.output():
            assert time.monotonic() < deadline, d.output()
            time.sleep(0.1)
        warnings = [x for x in d.output().splitlines() if "WARNING" in x and "NVML" not in x]
        assert warnings and all(len(x) < 300 for x in warnings), warnings
        assert "Retrying" not in d.output()  # urllib3's own retries are off
    finally:
        d.stop()


# ------------------------------------------------------------------ one daemon per socket


def test_a_second_daemon_on_a_socket_is_refused_naming_the_first(
    tmp_path: Path, daemon: RunningDaemon
) -> None:
    r = run(
        "nvshare-scheduler",
        "--policy-dir",
        str(daemon.policy_dir),
        env={**os.environ, "NVSHARE_SOCKET_DIR": str(daemon.socket_dir)},
    )
    line = refusal(r)
    assert f"another nvshare scheduler (pid {daemon.proc.pid}) is serving" in line
    assert ctl(daemon, "status").returncode == 0  # the first still answers on its socket
    assert (daemon.socket_dir / "scheduler.sock").exists()


def test_a_hung_daemon_is_still_a_daemon(tmp_path: Path, daemon: RunningDaemon) -> None:
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        r = run(
            "nvshare-scheduler",
            "--policy-dir",
            str(daemon.policy_dir),
            env={**os.environ, "NVSHARE_SOCKET_DIR": str(daemon.socket_dir)},
        )
        assert f"(pid {daemon.proc.pid}) is serving" in refusal(r)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_socket_someone_else_answers_on_is_not_taken(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = track(socket.socket(socket.AF_UNIX))
    other.bind(str(run_dir / "scheduler.sock"))
    other.listen()  # a scheduler of another version, without the lock file
    line = refusal(start_briefly(tmp_path))
    assert f"another nvshare scheduler (pid {os.getpid()}) answers on" in line
    assert (run_dir / "scheduler.sock").exists()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(run_dir / "scheduler.sock"))
    dead.close()  # the file stays, nobody listens: a daemon killed with -9
    d = start_daemon(tmp_path)  # returns at once: the (stale) socket file is already there
    try:
        deadline = time.monotonic() + 20
        while ctl(d, "status").returncode != 0:
            assert d.proc.poll() is None and time.monotonic() < deadline, d.output()
            time.sleep(0.1)
    finally:
        d.stop()


def test_on_exit_a_socket_that_is_no_longer_ours_is_left_alone(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    path = d.socket_dir / "scheduler.sock"
    path.unlink()
    newer = track(socket.socket(socket.AF_UNIX))
    newer.bind(str(path))
    d.stop()
    assert path.exists()  # the daemon removed only what it had bound
    newer.close()
    path.unlink()
    d = start_daemon(tmp_path)
    d.stop()
    assert not path.exists()  # its own socket it does remove


def test_sigterm_does_not_wait_for_connections_that_never_registered(
    daemon: RunningDaemon,
) -> None:
    idle = track(socket.socket(socket.AF_UNIX))
    idle.connect(str(daemon.socket_dir / "scheduler.sock"))
    ctl(daemon, "status")  # the idle connection is accepted by now
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(10)
    assert time.monotonic() - started < 4  # it used to wait 5 s for such connections


# ------------------------------------------------------------------ control requests


def query(c: ControlClient, body: bytes) -> object:
    seq = 77
    c._sock.sendall(p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.QUERY, 0, len(body), seq) + body)
    got, answer = c.receive()
    assert got == seq
    return answer


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"query": "explain", "pid": "abc"}', p.Status.INVALID, "pid must be a positive"),
        (b'{"query": "explain", "pod": 5}', p.Status.INVALID, "pod must be NAMESPACE/NAME"),
        (b"[1]", p.Status.INVALID, "expected a QUERY object"),
        (b"[" * 20_000 + b"]" * 20_000, p.Status.BAD_BODY, "nested too deeply"),
        (b'{"query": ["x"]}', p.Status.NOT_FOUND, "unknown query"),
    ],
)
def test_malformed_queries_are_answered_and_the_connection_stays(
    daemon: RunningDaemon, body: bytes, status: p.Status, message: str
) -> None:
    c = ControlClient(daemon.socket_dir, timeout=5)
    track(c._sock)
    answer = query(c, body)
    assert isinstance(answer, p.Result) and answer.status is status and message in answer.message
    assert isinstance(c.request(p.StatusRequest()), p.JsonBody)  # still connected
    assert "Traceback" not in daemon.output()


def test_state_changes_say_what_changed_and_refuse_what_names_nothing(
    daemon: RunningDaemon,
) -> None:
    c = registered(daemon)
    me = str(os.getpid())  # the kernel's pid of the registered connection
    r = ctl(daemon, "limit", "set", "--pid", "999999", "4Gi")
    assert r.returncode == 1
    assert "no connected client has pid 999999; nothing changed" in one_line(r.stderr)
    r = ctl(daemon, "limit", "set", "--pid", me, "2Gi")
    assert r.returncode == 0
    assert one_line(r.stdout) == (
        f"pid {me}: memory override 2Gi (was none); applies to 1 connected client(s), pid {me}"
    )
    listed = ctl(daemon, "limit", "list").stdout
    assert f"pid {me}" in listed and "2Gi" in listed
    r = ctl(daemon, "limit", "clear", "--pod", "ml/nothing-here")
    assert r.returncode == 1 and one_line(r.stderr) == (
        "nvsharectl: the scheduler refused: nothing was set for pod ml/nothing-here: it has no "
        "memory or core override to clear; nothing changed"
    )
    r = ctl(daemon, "limit", "clear", "--pod", "ml/nothing-here", "--no-memory")
    assert r.returncode == 1 and "it has no core override to clear" in r.stderr
    r = ctl(daemon, "mode", "on", "--gpu", "GPU-nosuch")
    assert r.returncode == 1
    assert f"no GPU GPU-nosuch is known here; nothing changed (known: {GPU})" in r.stderr
    assert ctl(daemon, "-T", "45").stdout.strip() == (
        "time quantum set to 45 s on every GPU (was 2 s from the policy)"
    )
    assert ctl(daemon, "mode", "auto").returncode == 0
    listed = ctl(daemon, "limit", "list").stdout
    assert "time quantum: 45 s" in listed and "mode: auto on every GPU" in listed
    assert ctl(daemon, "-T", "policy").stdout.strip() == (
        "the time quantum follows the policy again (2 s)"
    )
    assert ctl(daemon, "mode", "policy").stdout.strip() == (
        "the mode on every GPU follows the policy again"
    )
    log = daemon.output()
    assert f"pid {me}" in log and "set the time quantum to 45 s" in log  # who, and what
    assert f"changed the limits of pid {me}: memory override 2Gi (was none)" in log
    c.close()
    deadline = time.monotonic() + 10
    while "no limit overrides" not in ctl(daemon, "limit", "list").stdout:
        assert time.monotonic() < deadline, "the override outlived its process"
        time.sleep(0.05)


def test_the_daemon_refuses_an_override_for_a_pod_name_kubernetes_would_refuse(
    daemon: RunningDaemon,
) -> None:
    """Whatever the client checked: the daemon keeps no override for a pod that cannot exist."""
    with ControlClient(daemon.socket_dir, timeout=5) as c:
        reply = c.request(p.LimitSet(0, p.LIMIT_SET_HAS_MEM, 1 << 30, 0, "ml", "Trainer_1"))
    assert isinstance(reply, p.Result) and reply.status is p.Status.INVALID
    assert reply.message.startswith("pod name 'Trainer_1' is not a Kubernetes pod name")
    assert reply.message.endswith("; nothing changed")
    assert "no limit overrides" in ctl(daemon, "limit", "list").stdout


def test_an_untrusted_claim_without_a_pod_watch_is_explained_once(daemon: RunningDaemon) -> None:
    registered(daemon, pod_namespace="ml", pod_name="trainer")
    registered(daemon, pod_namespace="ml", pod_name="trainer")
    deadline = time.monotonic() + 5
    said = f"uid {os.getuid()} is not in the policy's trust.podClaimUids, so the name is ignored"
    while said not in daemon.output():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert daemon.output().count(said) == 1


def test_status_with_thousands_of_clients_is_streamed(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = 3500  # about 1.3 MB of status: more than one frame holds
    if hard < 2 * clients + 200:
        pytest.skip(f"the open-file limit ({hard}) is too low for {clients} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the daemon inherits it
    try:
        d = start_daemon(tmp_path, "connections: {perUid: 5000}\n")
        try:
            for _ in range(clients):
                registered(d)
            r = ctl(d, "status", "--json")
            assert r.returncode == 0, r.stderr
            assert len(r.stdout) > framing.MAX_BODY
            assert len(json.loads(r.stdout)["clients"]) == clients
        finally:
            d.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
