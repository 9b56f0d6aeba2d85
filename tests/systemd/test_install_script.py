"""scripts/install.sh run for real into a staging root (--root), then removed again."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from appliance.policy.load import load_policy_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install.sh"
LIB = "/opt/nvshare/lib/libnvshare.so"


def tree(root: Path) -> dict[str, str]:
    """Everything under root: path -> kind, mode and content digest (or link target)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = "/" + str(path.relative_to(root))
        st = path.lstat()
        if path.is_symlink():
            found[rel] = f"link {os.readlink(path)}"
        elif path.is_dir():
            found[rel] = f"dir {st.st_mode:o}"
        else:
            found[rel] = f"file {st.st_mode:o} {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return found


def install(root: Path, *args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["bash", str(script), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    """A root that already holds things the installer must leave alone."""
    root = tmp_path / "root"
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    (root / "etc" / "ld.so.preload").write_text("/usr/lib/other-preload.so\n")
    (root / "etc" / "systemd" / "system" / "sshd.service").write_text("[Service]\n")
    (root / "opt").mkdir()
    return root


@pytest.fixture
def hook(tmp_path: Path) -> Path:
    lib = tmp_path / "libnvshare.so"
    lib.write_bytes(b"\x7fELF not really, but install.sh only copies it\n")
    return lib


def test_install_then_uninstall_leaves_only_what_was_there(staging: Path, hook: Path) -> None:
    before = tree(staging)
    install(staging, "--no-venv", "--preload", "--hook", str(hook))
    installed = staging / LIB.lstrip("/")
    assert installed.read_bytes() == hook.read_bytes()
    unit = (staging / "etc/systemd/system/nvshare-scheduler.service").read_text()
    assert (
        "ExecStart=/opt/nvshare/venv/bin/nvshare-scheduler --policy-dir /etc/nvshare/policy.d"
        in unit
    )
    policy_dir = staging / "etc/nvshare/policy.d"
    assert (policy_dir / "00-default.yaml").read_text() == (
        ROOT / "configmaps/default/00-default.yaml"
    ).read_text()
    assert load_policy_dir(policy_dir, environ={}).files == ("00-default.yaml",)
    preload = (staging / "etc/ld.so.preload").read_text().splitlines()
    assert preload == ["/usr/lib/other-preload.so", LIB]

    install(staging, "--no-venv", "--preload", "--hook", str(hook))  # again: an upgrade
    assert (staging / "etc/ld.so.preload").read_text().splitlines().count(LIB) == 1

    install(staging, "--uninstall")
    assert tree(staging) == before


def test_preload_file_created_by_the_installer_is_removed_with_it(
    tmp_path: Path, hook: Path
) -> None:
    root = tmp_path / "bare"
    root.mkdir()
    install(root, "--no-venv", "--preload", "--hook", str(hook), "--prefix", "/usr/local/nvshare")
    assert (root / "etc/ld.so.preload").read_text() == "/usr/local/nvshare/lib/libnvshare.so\n"
    install(root, "--prefix", "/usr/local/nvshare", script=ROOT / "scripts" / "uninstall.sh")
    assert tree(root) == {}


def test_an_edited_policy_survives_uninstall(staging: Path, hook: Path) -> None:
    install(staging, "--no-venv", "--hook", str(hook))
    edited = staging / "etc/nvshare/policy.d/00-default.yaml"
    edited.write_text("scheduler: {timeQuantum: 20s}\n")
    result = install(staging, "--uninstall")
    assert "keeping /etc/nvshare/policy.d/00-default.yaml" in result.stdout
    assert edited.read_text() == "scheduler: {timeQuantum: 20s}\n"
    assert not (staging / LIB.lstrip("/")).exists()
    assert not (staging / "etc/systemd/system/nvshare-scheduler.service").exists()


def test_dry_run_changes_nothing(staging: Path, hook: Path) -> None:
    before = tree(staging)
    result = install(staging, "--dry-run", "--preload", "--hook", str(hook))
    assert f"would append to {staging}/etc/ld.so.preload: {LIB}" in result.stdout
    assert "would run: python3 -m venv" in result.stdout
    made = [line for line in result.stdout.splitlines() if "mkdir" in line]
    assert f"would run: mkdir -m 0755 {staging}/opt/nvshare" in made  # words, not "mkdir/-m/"
    assert len(made) == len(set(made))  # each directory once
    assert result.stdout.rstrip().endswith("install.sh: dry run: nothing was installed")
    assert "installed under" not in result.stdout
    assert tree(staging) == before


def test_given_venv_is_used_and_kept(staging: Path, hook: Path, tmp_path: Path) -> None:
    # A scripted stand-in for an existing venv: its pip records what it was asked to install.
    venv = staging / "srv/tools-venv"
    (venv / "bin").mkdir(parents=True)
    log, pins = tmp_path / "pip.log", tmp_path / "pins.txt"
    keep_pins = f'while [ $# -gt 0 ]; do [ "$1" = -c ] && cp "$2" {pins}; shift; done'
    for name, body in (("python", "exit 0"), ("pip", f'echo "$@" >> {log}; {keep_pins}')):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    before = tree(staging)
    result = install(staging, "--venv", "/srv/tools-venv", "--hook", str(hook))
    argv = log.read_text().split()
    assert argv[0] == "install" and argv[-1] == str(ROOT)
    # Every package at its locked version: the lock's pins, without hashes, as constraints.
    assert argv[argv.index("-c") + 1] != str(pins) and "pyyaml==" in pins.read_text().lower()
    assert "--hash" not in pins.read_text() and "\\" not in pins.read_text()
    unit = (staging / "etc/systemd/system/nvshare-scheduler.service").read_text()
    assert "ExecStart=/srv/tools-venv/bin/nvshare-scheduler --policy-dir" in unit
    # The commands on the PATH.
    for cmd in ("nvsharectl", "nvshare-scheduler"):
        assert os.readlink(staging / "usr/local/bin" / cmd) == f"/srv/tools-venv/bin/{cmd}"
    assert "nvsharectl and nvshare-scheduler are in /usr/local/bin" in result.stdout
    install(staging, "--uninstall")
    assert tree(staging) == before


def test_a_command_of_another_install_on_the_path_is_left_alone(staging: Path, hook: Path) -> None:
    venv = staging / "srv/v"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "pip"):
        (venv / "bin" / name).write_text("#!/bin/sh\nexit 0\n")
        (venv / "bin" / name).chmod(0o755)
    (staging / "usr/local/bin").mkdir(parents=True)
    (staging / "usr/local/bin/nvsharectl").write_text("#!/bin/sh\necho mine\n")
    result = install(staging, "--venv", "/srv/v", "--hook", str(hook))
    assert "keeping /usr/local/bin/nvsharectl: it is not ours" in result.stdout
    assert (staging / "usr/local/bin/nvsharectl").read_text() == "#!/bin/sh\necho mine\n"
    install(staging, "--uninstall")
    assert (staging / "usr/local/bin/nvsharectl").read_text() == "#!/bin/sh\necho mine\n"
    assert not (staging / "usr/local/bin/nvshare-scheduler").exists()


def test_uninstall_without_a_manifest_removes_nothing(staging: Path) -> None:
    before = tree(staging)
    result = subprocess.run(
        ["bash", str(SCRIPT), "--root", str(staging), "--uninstall"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no install manifest" in result.stderr
    assert tree(staging) == before


def test_an_existing_policy_is_not_joined_by_the_default(staging: Path, hook: Path) -> None:
    policy_dir = staging / "etc/nvshare/policy.d"
    policy_dir.mkdir(parents=True)
    (policy_dir / "10-site.yaml").write_text("scheduler: {mode: auto}\n")
    before = tree(staging)
    result = install(staging, "--no-venv", "--hook", str(hook))
    assert "already holds a policy" in result.stdout
    assert sorted(p.name for p in policy_dir.iterdir()) == ["10-site.yaml"]
    install(staging, "--uninstall")
    assert tree(staging) == before
