"""The policy watcher on real inotify: what a running daemon sees when its policy changes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.policy.errors import PolicyError, PolicyLoadError
from appliance.policy.model import Policy
from appliance.policy.watch import PolicyWatcher

from .test_policy_bounds import ALIAS_BOMB

WAIT_S = 20.0  # generous: only a failure ever waits this long


class Recorder:
    """Collects what the watcher reports, and lets a test wait for a state."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.policies: list[Policy] = []
        self.errors: list[list[PolicyError]] = []
        self.results: list[str] = []

    def on_policy(self, policy: Policy) -> None:
        with self.cond:
            self.policies.append(policy)
            self.cond.notify_all()

    def on_error(self, errors: list[PolicyError]) -> None:
        with self.cond:
            self.errors.append(errors)
            self.cond.notify_all()

    def on_reload(self, result: str) -> None:
        with self.cond:
            self.results.append(result)
            self.cond.notify_all()

    def watcher(self, directory: Path, **options: Any) -> PolicyWatcher:
        """A watcher of `directory` that reports here: no environment, a short debounce."""
        settings: dict[str, Any] = {"environ": {}, "debounce_s": 0.02, **options}
        return PolicyWatcher(
            directory,
            on_policy=self.on_policy,
            on_error=self.on_error,
            on_reload=self.on_reload,
            **settings,
        )

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT_S), f"timed out waiting for {what}"

    def wait_tq(self, seconds: float) -> Policy:
        self.wait(
            lambda: bool(self.policies) and self.policies[-1].scheduler.time_quantum_s == seconds,
            f"a policy with timeQuantum {seconds}s",
        )
        return self.policies[-1]

    def wait_result(self, result: str, after: int) -> None:
        self.wait(lambda: result in self.results[after:], f"a reload that is {result!r}")


def write_atomically(path: Path, text: str) -> None:
    """An editor's save: write a temporary file, then rename it over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "policy.d"
    directory.mkdir()
    (directory / "10-base.yaml").write_text("scheduler:\n  timeQuantum: 45s\n")
    return directory


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def watcher(policy_dir: Path, recorder: Recorder) -> Iterator[PolicyWatcher]:
    w = recorder.watcher(policy_dir)
    w.start()
    yield w
    w.stop()


class Kubelet:
    """Kubelet's AtomicWriter for a ConfigMap volume, step by step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.generation = 0
        self.current: Path | None = None
        self.keys: set[str] = set()

    def project(self, files: dict[str, str]) -> None:
        self.generation += 1
        new = self.directory / f"..2026_11_21_23_00_{self.generation:02d}.{1000 + self.generation}"
        new.mkdir()
        for key, text in files.items():
            (new / key).write_text(text)
        tmp_link = self.directory / "..data_tmp"
        tmp_link.symlink_to(new.name)
        os.rename(tmp_link, self.directory / "..data")  # the atomic swap
        for key in files.keys() - self.keys:
            (self.directory / key).symlink_to(f"..data/{key}")
        for key in self.keys - files.keys():
            (self.directory / key).unlink()
        if self.current is not None:
            shutil.rmtree(self.current)
        self.current, self.keys = new, set(files)


def test_kubelet_configmap_update_reaches_on_policy(tmp_path: Path, recorder: Recorder) -> None:
    mount = tmp_path / "config"
    mount.mkdir()
    kubelet = Kubelet(mount)
    kubelet.project({"policy.yaml": "scheduler: {timeQuantum: 20s}\n"})
    with recorder.watcher(mount) as watcher:
        assert watcher.last_good is not None
        assert watcher.last_good.scheduler.time_quantum_s == 20.0
        kubelet.project({"policy.yaml": "scheduler: {timeQuantum: 25s}\n"})
        assert recorder.wait_tq(25.0).files == ("policy.yaml",)
        kubelet.project(
            {"policy.yaml": "scheduler: {timeQuantum: 25s}\n", "20-extra.yaml": "gpus: [{}]\n"}
        )
        recorder.wait(lambda: len(recorder.policies[-1].gpus) == 1, "the added key")
        assert recorder.policies[-1].files == ("20-extra.yaml", "policy.yaml")
    assert recorder.errors == []


def test_invalid_file_keeps_last_good_and_logs_once(
    policy_dir: Path,
    recorder: Recorder,
    watcher: PolicyWatcher,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = watcher.last_good
    assert good is not None
    caplog.set_level(logging.INFO, logger="nvshare.policy")
    write_atomically(policy_dir / "20-team.yaml", "rules:\n  - name: a\n    memoryLimit: 4Gx\n")
    recorder.wait(lambda: bool(recorder.errors), "on_error")
    assert [str(e) for e in recorder.errors[-1]] == [
        "20-team.yaml:3: /rules/0/memoryLimit: '4Gx' is not a size: "
        "unknown unit 'Gx' (units: Ki Mi Gi Ti Pi Ei (1024s), k M G T P E (1000s); "
        "a bare number is MiB)"
    ]
    assert watcher.last_good is good
    assert recorder.policies == [good]  # only the first load
    # Another event with the same broken content: counted, not logged or reported again.
    invalid_before = recorder.results.count("invalid")
    os.utime(policy_dir / "20-team.yaml")  # an event, the same content
    recorder.wait(lambda: recorder.results.count("invalid") > invalid_before, "a second reload")
    complaints = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(complaints) == 1
    message = complaints[0].getMessage()
    assert "20-team.yaml:3: /rules/0/memoryLimit" in message
    assert f"keeping the last good policy {good.content_hash[:12]}" in message
    assert len(recorder.errors) == 1
    assert watcher.last_errors == recorder.errors[0]
    # Fixing the file applies it.
    write_atomically(policy_dir / "20-team.yaml", "rules:\n  - name: a\n    memoryLimit: 4Gi\n")
    recorder.wait(lambda: len(recorder.policies) == 2, "the fixed policy")
    assert recorder.policies[-1].rules[0].limits.memory_bytes == 4 << 30
    assert watcher.last_errors == []


def test_half_written_file_is_never_applied(
    policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    full = "scheduler: {timeQuantum: 50s, mode: auto}\n"
    with open(policy_dir / "20-new.yaml", "w") as f:
        f.write(full[:28])  # "scheduler: {timeQuantum: 50s" : cut inside the flow mapping
        f.flush()
        assert watcher.reload_now() == "invalid"
        assert watcher.last_good is not None
        assert watcher.last_good.scheduler.time_quantum_s == 45.0
        f.write(full[28:])
    recorder.wait_tq(50.0)
    assert [p.scheduler.time_quantum_s for p in recorder.policies] == [45.0, 50.0]
    assert recorder.policies[-1].scheduler.mode.value == "auto"


def test_a_thousand_rapid_changes_end_in_the_final_state(
    policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    target = policy_dir / "10-base.yaml"
    for i in range(1, 1001):
        text = f"scheduler:\n  timeQuantum: {i}s\n"
        if i % 2:
            write_atomically(target, text)
        else:
            target.write_text(text)  # in place: acted on at close, never half-read
    recorder.wait_tq(1000.0)
    seen = [p.scheduler.time_quantum_s for p in recorder.policies[1:]]
    assert seen == sorted(seen), "policies were applied out of order"


def test_removing_every_file_gives_the_builtin_defaults(
    policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    (policy_dir / "10-base.yaml").unlink()
    policy = recorder.wait_tq(30.0)
    assert policy.files == ()
    assert set(policy.sources.values()) == {"default"}


def test_directory_deleted_and_recreated(
    policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    shutil.rmtree(policy_dir)
    recorder.wait(lambda: bool(recorder.errors), "the missing directory to be reported")
    assert "does not exist" in str(recorder.errors[-1][0])
    assert watcher.last_good is not None
    assert watcher.last_good.scheduler.time_quantum_s == 45.0
    policy_dir.mkdir()
    write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 55s}\n")
    recorder.wait_tq(55.0)
    # The new directory is watched, not only the parent.
    write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 56s}\n")
    recorder.wait_tq(56.0)


def test_sighup_reload_sees_what_inotify_cannot(
    tmp_path: Path, policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    # Bare metal: a drop-in that is a symlink to a file elsewhere; editing it there makes no
    # event in the policy directory.
    elsewhere = tmp_path / "site-policy.yaml"
    elsewhere.write_text("scheduler: {timeQuantum: 60s}\n")
    (policy_dir / "50-site.yaml").symlink_to(elsewhere)
    recorder.wait_tq(60.0)
    write_atomically(elsewhere, "scheduler: {timeQuantum: 61s}\n")
    results: list[str] = []
    previous = signal.signal(signal.SIGHUP, lambda *_: results.append(watcher.reload_now()))
    try:
        os.kill(os.getpid(), signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert results == ["applied"]
    assert recorder.policies[-1].scheduler.time_quantum_s == 61.0
    assert watcher.reload_now() == "unchanged"


def test_periodic_rehash_is_a_safety_net(tmp_path: Path, recorder: Recorder) -> None:
    directory = tmp_path / "policy.d"
    directory.mkdir()
    elsewhere = tmp_path / "site-policy.yaml"
    elsewhere.write_text("scheduler: {timeQuantum: 60s}\n")
    (directory / "50-site.yaml").symlink_to(elsewhere)
    with recorder.watcher(directory, rehash_interval_s=0.05):
        write_atomically(elsewhere, "scheduler: {timeQuantum: 62s}\n")
        recorder.wait_tq(62.0)


def test_periodic_rehash_never_reads_a_file_still_being_written(
    tmp_path: Path, recorder: Recorder
) -> None:
    directory = tmp_path / "policy.d"
    directory.mkdir()
    target = directory / "10-base.yaml"
    target.write_text("scheduler: {timeQuantum: 45s}\n")
    with recorder.watcher(directory, rehash_interval_s=0.02):
        recorder.wait_tq(45.0)
        with target.open("w") as f:
            f.write("scheduler:\n  timeQuantum: 4")  # a valid prefix of the real content
            f.flush()
            threading.Event().wait(0.5)  # 25 re-hash periods while the writer is busy
            assert [p.scheduler.time_quantum_s for p in recorder.policies] == [45.0]
            f.write("7s\n")
        recorder.wait_tq(47.0)
    assert [p.scheduler.time_quantum_s for p in recorder.policies] == [45.0, 47.0]


def test_rewriting_the_same_content_does_not_call_on_policy(
    policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    same = (policy_dir / "10-base.yaml").read_text()
    before = len(recorder.results)
    write_atomically(policy_dir / "10-base.yaml", same)
    (policy_dir / "10-base.yaml").write_text(same)
    recorder.wait_result("unchanged", before)
    write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 46s}\n")
    recorder.wait_tq(46.0)
    assert [p.scheduler.time_quantum_s for p in recorder.policies] == [45.0, 46.0]
    assert watcher.reload_counts["applied"] == 2  # the start and the real change


def test_start_refuses_an_invalid_directory(tmp_path: Path, recorder: Recorder) -> None:
    directory = tmp_path / "policy.d"
    directory.mkdir()
    (directory / "10-bad.yaml").write_text("scheduler:\n  mode: sometimes\n")
    watcher = recorder.watcher(directory)
    with pytest.raises(PolicyLoadError) as raised:
        watcher.start()
    assert str(raised.value.errors[0]) == (
        "10-bad.yaml:2: /scheduler/mode: 'sometimes' is not one of: on, off, auto"
    )
    assert recorder.policies == []
    watcher.stop()  # harmless after a failed start


def test_directory_swapped_by_rename(
    tmp_path: Path, policy_dir: Path, recorder: Recorder, watcher: PolicyWatcher
) -> None:
    staged = tmp_path / "policy.d.new"
    staged.mkdir()
    (staged / "10-base.yaml").write_text("scheduler: {timeQuantum: 70s}\n")
    policy_dir.rename(tmp_path / "policy.d.old")
    staged.rename(policy_dir)
    recorder.wait_tq(70.0)
    # The watch follows the path, not the old directory that moved away.
    write_atomically(tmp_path / "policy.d.old" / "10-base.yaml", "scheduler: {timeQuantum: 5s}\n")
    write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 71s}\n")
    recorder.wait_tq(71.0)
    assert 5.0 not in [p.scheduler.time_quantum_s for p in recorder.policies]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("20-chunk.yaml", "memory: {chunk: 1ki}\n", "did you mean Ki?"),
        ("20-tq.yaml", "scheduler: {timeQuantum: 1200h}\n", "at most 24h"),
        ("20-idle.yaml", "scheduler: {idleRelease: 1200h}\n", "at most 24h"),
        ("20-deep.yaml", "a: " + "[" * 5000 + "\n", "20-deep.yaml:1: "),
        ("20-deep.json", "[" * 100_000 + "]" * 100_000, "nested deeper than 16 levels"),
        ("20-bomb.yaml", ALIAS_BOMB, "once YAML aliases are expanded"),
    ],
)
def test_inputs_that_used_to_end_hot_reload_are_reported_and_later_edits_apply(
    policy_dir: Path,
    recorder: Recorder,
    watcher: PolicyWatcher,
    name: str,
    text: str,
    message: str,
) -> None:
    write_atomically(policy_dir / name, text)
    recorder.wait(lambda: bool(recorder.errors), "the error to be reported")
    assert message in str(recorder.errors[-1][0]) and name in str(recorder.errors[-1][0])
    assert watcher.last_good is not None and watcher.last_good.scheduler.time_quantum_s == 45.0
    (policy_dir / name).unlink()
    write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 40s}\n")
    recorder.wait_tq(40.0)
    assert watcher.alive and watcher.last_errors == []


def test_names_that_dangle_are_in_flux_never_an_empty_directory(
    tmp_path: Path, recorder: Recorder
) -> None:
    mount = tmp_path / "config"
    mount.mkdir()
    kubelet = Kubelet(mount)
    kubelet.project({"policy.yaml": "defaults: {memoryLimit: 2Gi}\n"})
    with recorder.watcher(mount, flux_grace_s=0.5) as watcher:
        (mount / "..data").unlink()  # policy.yaml -> ..data/policy.yaml now points at nothing
        recorder.wait(lambda: bool(recorder.errors), "the dangling name to be reported")
        assert "policy.yaml: is a symlink to a file that does not exist" in str(
            recorder.errors[-1][0]
        )
        assert len(recorder.policies) == 1  # never the built-in defaults
        assert watcher.last_good is not None and watcher.last_good.defaults.memory_bytes == 2 << 30
        assert kubelet.current is not None
        (mount / "..data").symlink_to(kubelet.current.name)  # the same content is back
        recorder.wait(lambda: watcher.last_errors == [], "the directory to settle")
        assert len(recorder.policies) == 1


class FlakyEnviron(dict[str, str]):
    """An environment whose reads fail while `broken`: a stand-in for any loader bug."""

    broken = False

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        if self.broken:
            raise RuntimeError("simulated loader bug")
        return super().get(key, default)


def test_a_loader_failure_is_reported_and_the_watch_goes_on(
    policy_dir: Path, recorder: Recorder
) -> None:
    environ = FlakyEnviron()
    with recorder.watcher(policy_dir, environ=environ) as watcher:
        environ.broken = True
        write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 41s}\n")
        recorder.wait(lambda: bool(recorder.errors), "the failure to be reported")
        assert "could not be loaded (RuntimeError('simulated loader bug'))" in str(
            recorder.errors[-1][0]
        )
        environ.broken = False
        write_atomically(policy_dir / "10-base.yaml", "scheduler: {timeQuantum: 42s}\n")
        recorder.wait_tq(42.0)
        assert watcher.alive
