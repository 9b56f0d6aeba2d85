"""Builds the hook and the fake driver once, and runs the probe program under the hook.

Every test drives a real process: tests/probe.c linked against the fake libcuda.so.1, with
libnvshare.so preloaded, optionally in its AddressSanitizer or ThreadSanitizer build.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import fake_scheduler as fs

ROOT = Path(__file__).resolve().parents[2]
LD_HOOK = ROOT / "ld_hook"
SANITIZER_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:exitcode=66:detect_leaks=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    build: Path
    runtime: str  # sanitizer runtime to preload first, or ""

    @property
    def probe(self) -> Path:
        return self.build / "probe"

    def env(self, **extra: str) -> dict[str, str]:
        preload = f"{self.runtime} {self.build / 'libnvshare.so'}".strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NVSHARE_")}
        env.update(SANITIZER_ENV)
        env.update(
            LD_PRELOAD=preload,
            LD_LIBRARY_PATH=str(self.build / "fake"),
            NVSHARE_FAKE_LAUNCH_US="1000",
        )
        env.update(extra)
        return env


def _runtime(lib: str) -> str:
    out = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture(scope="session")
def built() -> Path:
    subprocess.run(["make", "-s", "-C", str(LD_HOOK)], check=True)
    return LD_HOOK / "build"


@pytest.fixture(scope="session")
def plain(built: Path) -> Variant:
    return Variant("plain", built, "")


@pytest.fixture(scope="session", params=["plain", "asan", "tsan"])
def variant(request: pytest.FixtureRequest, built: Path) -> Variant:
    name = request.param
    if name == "plain":
        return Variant(name, built, "")
    return Variant(name, built / name, _runtime(f"lib{name}.so"))


@pytest.fixture
def sched(sock_dir: str) -> Iterator[fs.FakeScheduler]:
    """A fake scheduler with its default settings on `sock_dir`; dies with the test."""
    with fs.FakeScheduler(sock_dir) as scheduler:
        yield scheduler


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="nvs-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Probe:
    """One probe process; do() sends a command line and returns its one-line answer."""

    def __init__(self, variant: Variant, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self._err = open(log, "w")
        self.proc = subprocess.Popen(
            [str(variant.probe), *(args or ("run",))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )

    def send(self, line: str) -> None:
        """A command whose answer is read later (answer()): the probe may block meanwhile."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def answered(self, seconds: float) -> bool:
        """Whether an answer is waiting, after at most `seconds`."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        return bool(ready)

    def do(self, line: str) -> str:
        self.send(line)
        answer = self.answer()
        assert answer, f"probe died on {line!r}: {self.stderr()}"
        return answer

    def eventually(self, line: str, want: str) -> str:
        """Repeat `line` until its answer starts with `want`: the daemon's frames arrive on
        their own time. Bounded generously (a loaded CI machine)."""
        deadline = time.monotonic() + 20
        while not (got := self.do(line)).startswith(want):
            assert time.monotonic() < deadline, f"{line!r} still answers {got!r}, not {want!r}"
            time.sleep(0.02)
        return got

    def ok(self, line: str) -> str:
        answer = self.do(line)
        assert answer.startswith("ok"), f"{line!r} -> {answer!r}; stderr: {self.stderr()}"
        return answer

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text()

    def finish(self) -> tuple[int, str]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()
        return rc, self.log.read_text()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._err.close()


@pytest.fixture
def probes(tmp_path: Path) -> Iterator[list[Probe]]:
    started: list[Probe] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.kill()
        elif not p._err.closed:
            p._err.close()
            for f in (p.proc.stdin, p.proc.stdout):
                if f is not None and not f.closed:
                    f.close()


@pytest.fixture
def start_probe(probes: list[Probe], tmp_path: Path):  # type: ignore[no-untyped-def]
    def start(variant: Variant, env: dict[str, str], *args: str) -> Probe:
        p = Probe(variant, env, tmp_path / f"probe{len(probes)}.err", *args)
        probes.append(p)
        return p

    return start


def holder_and_waiter(
    start_probe: Callable[..., Probe], variant: Variant, env: dict[str, str]
) -> tuple[Probe, Probe]:
    """Two programs on one GPU: the holder launched and holds the lock; the waiter's launch is
    sent and blocks at the gate (its answer is read later)."""
    holder, waiter = start_probe(variant, env), start_probe(variant, env)
    holder.ok("init")
    holder.ok("launch 1")
    waiter.ok("init")
    waiter.send("launch 1")
    return holder, waiter


def assert_clean(rc: int, stderr: str) -> None:
    assert rc == 0, f"exit {rc}: {stderr}"
    assert "Sanitizer" not in stderr and "runtime error" not in stderr, stderr
