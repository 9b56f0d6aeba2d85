"""Reading a policy is bounded: depth, aliases, file size, list lengths and durations, each
refused with a message that names the bound, before it can cost the daemon its memory or time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from appliance.policy.load import PolicyLoadError, load_policy_dir

# Under 400 bytes that expand to 9^9 (387 million) strings: PyYAML alone grows without bound.
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def errors(directory: Path, **env: str) -> list[str]:
    started = time.monotonic()
    with pytest.raises(PolicyLoadError) as e:
        load_policy_dir(directory, environ=env)
    assert time.monotonic() - started < 30  # bounded work, not a hang (generous for CI)
    return [str(err) for err in e.value.errors]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000),
        ("shallow-but-17.json", json.dumps({"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]})),
        ("shallow-but-17.yaml", "a: " + "[" * 17 + "1" + "]" * 17 + "\n"),
    ],
)
def test_deep_nesting_is_refused(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    (error,) = errors(tmp_path)
    assert error.startswith(name) and "nested deeper than 16 levels" in error


def test_yaml_nested_thousands_deep_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    # Which check speaks first depends on the YAML library (libyaml has a nesting limit of its
    # own since PyYAML 6.0.4); what the user gets does not: refused, with the file and the line.
    (tmp_path / "deep.yaml").write_text("# a comment\na: " + "[" * 5000)
    (error,) = errors(tmp_path)
    assert error.startswith("deep.yaml:2: ")


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    assert len(ALIAS_BOMB) < 500
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    (error,) = errors(tmp_path)
    assert "more than 500,000 values once YAML aliases are expanded" in error


def test_aliases_within_the_bound_are_fine(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "rules:\n"
        "- {match: &team {namespace: ml, podLabels: {team: a}}, memoryLimit: 4Gi}\n"
        "- {match: *team, coreLimit: 50}\n"
    )
    rules = load_policy_dir(tmp_path, environ={}).rules
    assert rules[0].match == rules[1].match


def test_a_file_larger_than_a_configmap_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text("# padding\n" * 120_000)  # 1.2 MB
    (error,) = errors(tmp_path)
    assert error == "big.yaml: cannot read: larger than 1 MiB (what a ConfigMap can hold); not read"


def rules_file(path: Path, count: int) -> None:
    path.write_text(
        "rules:\n"
        + "".join(f"- {{match: {{namespace: n{i}}}, coreLimit: 5}}\n" for i in range(count))
    )


def test_more_than_ten_thousand_rules_in_one_file_are_refused(tmp_path: Path) -> None:
    rules_file(tmp_path / "all.yaml", 10_001)
    assert errors(tmp_path) == [
        "all.yaml:1: /rules: 10,001 entries here make more than 10,000 in all files; at most 10,000"
    ]


def test_the_rule_bound_counts_every_file(tmp_path: Path) -> None:
    rules_file(tmp_path / "10-a.yaml", 6_000)
    rules_file(tmp_path / "20-b.yaml", 4_001)
    (error,) = errors(tmp_path)
    assert error.startswith("20-b.yaml:1: /rules: 4,001 entries here make more than 10,000")
    (tmp_path / "20-b.yaml").unlink()
    rules_file(tmp_path / "20-b.yaml", 4_000)
    assert len(load_policy_dir(tmp_path, environ={}).rules) == 10_000


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("scheduler: {timeQuantum: 1200h}", "/scheduler/timeQuantum"),
        ("scheduler: {idleRelease: 1200h}", "/scheduler/idleRelease"),
        ("scheduler: {computeWindow: 86401}", "/scheduler/computeWindow"),
        ("scheduler: {requestWindow: 25h}", "/scheduler/requestWindow"),
        ("gpus: [{timeQuantum: 25h}]", "/gpus/0/timeQuantum"),
        ("realtimeCheck: {maxSampleAge: 1441m}", "/realtimeCheck/maxSampleAge"),
    ],
)
def test_durations_past_a_day_are_refused(tmp_path: Path, text: str, path: str) -> None:
    (tmp_path / "p.yaml").write_text(text + "\n")
    (error,) = errors(tmp_path)
    assert f"p.yaml:1: {path}: " in error
    assert "is too long: durations are at most 24h" in error


@pytest.mark.parametrize(
    ("field", "why"),
    [
        ("computeWindow", "the compute window must be longer than 0"),
        ("requestWindow", "the request window must be longer than 0"),
        ("quotaSampleInterval", "the sample interval must be longer than 0"),
    ],
)
def test_an_empty_window_is_refused_saying_why(tmp_path: Path, field: str, why: str) -> None:
    # a zero window would divide every budget by nothing: refused, the last good policy kept
    (tmp_path / "p.yaml").write_text(f"scheduler: {{{field}: 0s}}\n")
    (error,) = errors(tmp_path)
    assert f"p.yaml:1: /scheduler/{field}: " in error and why in error


def test_an_environment_override_is_bounded_too(tmp_path: Path) -> None:
    (error,) = errors(tmp_path, NVSHARE_COMPUTE_WINDOW_MS="99999999999")
    assert error.startswith("env NVSHARE_COMPUTE_WINDOW_MS: /scheduler/computeWindow: ")
    assert "at most 24h" in error


def test_a_day_itself_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("scheduler: {timeQuantum: 24h, idleRelease: 86400}\n")
    policy = load_policy_dir(tmp_path, environ={})
    assert policy.scheduler.time_quantum_s == policy.scheduler.idle_release_s == 86400
