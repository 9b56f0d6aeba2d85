"""The appliance as shipped: the wheel, installed into a fresh virtualenv away from the checkout.

Every other test imports `appliance` from the source tree, where a file the wheel forgot (the
policy schema once was only a symlink into `schema/`) is still found. Here the wheel is built
from the files the image build copies (`pyproject.toml`, `README.md`, `appliance/`), installed
into a new virtualenv in a temp directory, and every program is run from there with the
temp directory as its working directory, so nothing can be picked up from the checkout.

Dependencies come through pip as configured on the machine (its cache and indexes, the same
ones `make test` used for `.venv`), each at the version `requirements.lock` names, as the image
and `make install` take them; bytecode compilation is skipped to keep this fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip"]


@dataclass(frozen=True)
class Installed:
    venv: Path
    home: Path  # a working directory outside the checkout

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "PATH": f"{self.venv / 'bin'}:{env.get('PATH', '')}", **extra}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.home, env=self.env(), capture_output=True, text=True, timeout=timeout
        )


def _pip(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [*PIP, "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("installed")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    # Links are copied as links, as `COPY` and an sdist would keep them: a link that points
    # out of the package must not get by here.
    shutil.copytree(
        ROOT / "appliance",
        source / "appliance",
        symlinks=True,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    wheels = work / "wheels"
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), ".", cwd=source)
    (wheel,) = wheels.glob("nvshare_appliance-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pins = work / "pins.txt"
    pins.write_text(
        subprocess.run(
            ["bash", str(ROOT / "scripts/pins.sh")], check=True, capture_output=True, text=True
        ).stdout
    )
    _pip(
        "--python",
        str(venv / "bin" / "python"),
        "install",
        "-q",
        "--no-compile",
        "-c",
        str(pins),
        str(wheel),
        cwd=work,
    )
    shutil.rmtree(source)
    home = work / "home"
    home.mkdir()
    return Installed(venv=venv, home=home)


def test_the_package_is_imported_from_the_install_and_carries_its_schema(
    installed: Installed,
) -> None:
    probe = (
        "import json, appliance, appliance.policy.schema as s;"
        "print(json.dumps([appliance.__file__, str(s.SCHEMA_FILE), s.SCHEMA_FILE.is_symlink()]))"
    )
    done = installed.run(installed.bin("python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    package, schema, is_link = json.loads(done.stdout)
    assert Path(package).is_relative_to(installed.venv) and not is_link
    assert Path(schema).read_bytes() == (ROOT / "schema" / "policy.schema.json").read_bytes()


def test_every_installed_package_is_at_its_locked_version(installed: Installed) -> None:
    probe = (
        "import json, importlib.metadata as m;"
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    done = installed.run(installed.bin("python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    got = {_canonical(name): version for name, version in json.loads(done.stdout).items()}
    locked = _locked_versions()
    assert {"pyyaml", "jsonschema", "kubernetes", "grpcio"} <= got.keys()
    off = {n: (v, locked.get(n)) for n, v in got.items() if n != "nvshare-appliance"}
    assert {n: vs for n, vs in off.items() if vs[0] != vs[1]} == {}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _locked_versions() -> dict[str, str]:
    """name -> version for this Python, from the lock's `name==version ; marker` lines."""
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    versions: dict[str, str] = {}
    for line in lines:
        if not line[:1].isalnum():
            continue
        pin, _, marker = line.rstrip(" \\").partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate():
            continue
        name, _, version = pin.strip().partition("==")
        versions[_canonical(name)] = version
    return versions


def test_nvsharectl_policy_validate_checks_against_the_installed_schema(
    installed: Installed, tmp_path: Path
) -> None:
    good = installed.run(
        installed.bin("nvsharectl"), "policy", "validate", str(ROOT / "configmaps/default")
    )
    assert good.returncode == 0, good.stdout + good.stderr
    (tmp_path / "bad.yaml").write_text("scheduler:\n  mode: sometimes\n", encoding="utf-8")
    bad = installed.run(installed.bin("nvsharectl"), "policy", "validate", str(tmp_path))
    assert bad.returncode != 0
    assert "bad.yaml" in bad.stdout + bad.stderr and "Traceback" not in bad.stderr


def test_the_webhook_loads_its_chains_from_the_installed_package(
    installed: Installed, tmp_path: Path
) -> None:
    (tmp_path / "50-mig.yaml").write_text(
        'migFallback:\n  chains:\n    - ["3g.40gb", "2g.20gb"]\n', encoding="utf-8"
    )
    probe = (
        "import sys; from pathlib import Path; from appliance.cluster.webhook import policy_chains;"
        "print([list(c) for c in policy_chains(Path(sys.argv[1]))])"
    )
    done = installed.run(installed.bin("python"), "-c", probe, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[['3g.40gb', '2g.20gb']]"


@pytest.fixture
def scheduler(installed: Installed, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    log = (tmp_path / "daemon.log").open("w+")
    proc = subprocess.Popen(
        [installed.bin("nvshare-scheduler"), "--policy-dir", str(ROOT / "configmaps/default")],
        cwd=installed.home,
        env=installed.env(NVSHARE_SOCKET_DIR=str(tmp_path / "run")),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_installed_daemon_starts_ready_and_stops_cleanly(
    installed: Installed, scheduler: subprocess.Popen[str], tmp_path: Path
) -> None:
    log = tmp_path / "daemon.log"
    deadline = time.monotonic() + 60
    while "scheduler ready" not in log.read_text():
        assert scheduler.poll() is None, f"the daemon exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"never ready:\n{log.read_text()}"
        time.sleep(0.05)

    def nvsharectl(*args: str) -> str:
        done = subprocess.run(
            [installed.bin("nvsharectl"), *args],
            cwd=installed.home,
            env=installed.env(NVSHARE_SOCKET_DIR=str(tmp_path / "run")),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(nvsharectl("status", "--json"))["policy"]["valid"] is True
    frame = nvsharectl("top", "--once", "-d", "0.2")
    assert frame.startswith("nvshare: 0 client(s)") and "policy valid" in frame
    scheduler.send_signal(signal.SIGTERM)
    assert scheduler.wait(30) == 0
    assert "Traceback" not in log.read_text()
