"""A hook that cannot register applies the limits the daemon last published, and trusts neither a
file nor a daemon that a tenant could have put in its way.

The C reader (ld_hook/fallback.c) is checked against the Python cgroup parser on the same
fixtures (tests/host/fixtures), and against the daemon's own writer
(appliance/daemon/limits_file.py);
then the real hook, with no daemon or with an impostor, against the fake driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from host.test_cgroup_identity import NOT_PODS, PODS

from appliance.core.published import PublishedLimits
from appliance.daemon.limits_file import render
from appliance.host.cgroup import parse_cgroup

from .conftest import Variant, assert_clean

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "ld_hook" / "build" / "fallback_cases"
FIXTURES = ROOT / "tests" / "host" / "fixtures"
GiB = 1 << 30
POD = "8d3f1c2a-5b6e-4f7a-9c0d-1e2f3a4b5c6d"


def c_reader(*args: str) -> str:
    done = subprocess.run([str(CASES), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize(
    "cgroup", sorted(FIXTURES.glob("*/proc/*/cgroup")), ids=lambda p: p.parts[-4]
)
def test_the_hook_finds_the_pod_the_daemon_finds(built: Path, cgroup: Path) -> None:
    expected = parse_cgroup(cgroup.read_text()).pod_uid or "-"
    assert c_reader("cgroup", str(cgroup)) == expected


@pytest.mark.parametrize("path", NOT_PODS + PODS)
def test_the_hook_takes_a_pod_only_from_the_kubelets_layout(
    built: Path, tmp_path: Path, path: str
) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(f"0::{path}\n")
    assert c_reader("cgroup", str(cgroup)) == (parse_cgroup(cgroup.read_text()).pod_uid or "-")


def test_in_a_private_cgroup_namespace_kubelets_mounts_name_the_pod(
    built: Path, tmp_path: Path
) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "1201 1180 0:350 / / rw,relatime - overlay overlay rw\n"
        "1210 1201 259:1 /var/lib/kubelet/pods/" + POD + "/etc-hosts /etc/hosts rw - ext4 x rw\n"
    )
    assert c_reader("mountinfo", str(mountinfo)) == POD
    mountinfo.write_text("1201 1180 0:350 / / rw,relatime - overlay overlay rw\n")
    assert c_reader("mountinfo", str(mountinfo)) == "-"


def test_the_hook_reads_what_the_daemon_writes(built: Path, tmp_path: Path) -> None:
    published = tmp_path / "limits"
    published.write_text(render(PublishedLimits(default=GiB, pods={POD: 3 * GiB, "x": None})))
    assert c_reader("limits", str(published), POD) == str(3 * GiB)
    assert c_reader("limits", str(published), "") == str(GiB)
    assert c_reader("limits", str(published), "x") == "0"  # published as no limit
    published.write_text("default 1\n")
    assert c_reader("limits", str(published), "") == "invalid"


@pytest.fixture
def lonely_dir() -> Iterator[Path]:
    """A socket directory with no daemon in it (as a restarting or absent one leaves it)."""
    d = Path(tempfile.mkdtemp(prefix="nvs-fb-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def publish(directory: Path, default: int) -> Path:
    path = directory / "limits"
    path.write_text(render(PublishedLimits(default=default)))
    path.chmod(0o644)
    return path


def test_without_a_daemon_the_published_default_applies(
    plain: Variant, start_probe, lonely_dir: Path
) -> None:
    publish(lonely_dir, GiB)
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=str(lonely_dir)))
    p.ok("init")
    assert p.do(f"alloc mem {2 * GiB}") == "err 2"  # CUDA_ERROR_OUT_OF_MEMORY
    p.ok(f"alloc mem {GiB // 2}")
    assert p.do("info").split()[2] == str(GiB)  # and it sees a GPU of that size
    assert_clean(*p.finish())


def test_a_published_file_others_could_write_is_ignored(
    plain: Variant, start_probe, lonely_dir: Path
) -> None:
    publish(lonely_dir, GiB).chmod(0o666)
    p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=str(lonely_dir)))
    p.ok("init")
    p.ok(f"alloc mem {2 * GiB}")  # no limit rather than a tenant's
    rc, err = p.finish()
    assert rc == 0 and "ignoring" in err and "writable by others" in err


# What another user can run: the system's Python (the test's may live in root's home).
OTHER_PYTHON = "/usr/bin/python3"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(OTHER_PYTHON, os.X_OK),
    reason="an impostor of another uid needs root and a system-wide python3",
)

IMPOSTOR = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()  # takes the hook's registration and answers nothing it could trust
"""


@needs_root
def test_a_daemon_of_another_user_is_not_trusted(
    plain: Variant, start_probe, lonely_dir: Path
) -> None:
    lonely_dir.chmod(0o777)  # the shared directory an attacker got to first
    impostor = subprocess.Popen(
        [OTHER_PYTHON, "-c", IMPOSTOR, str(lonely_dir / "scheduler.sock")],
        user=65534,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "listening"
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=str(lonely_dir)))
        p.ok("init")
        p.ok("launch 3")  # never waits on it
        rc, err = p.finish()
        assert rc == 0 and "served by a process of another user" in err
    finally:
        impostor.kill()
        impostor.wait()
        if impostor.stdout is not None:
            impostor.stdout.close()
