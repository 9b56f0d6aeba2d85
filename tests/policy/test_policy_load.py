"""Loading a policy directory: merge rules, provenance, quantities, every error with its place."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from appliance.policy.files import read_policy_dir
from appliance.policy.load import PolicyLoadError, build_policy, load_policy_dir, validate_paths
from appliance.policy.model import Backing, Limits, Mode, Policy, RealtimeCheckMode


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def errors_of(directory: Path, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyLoadError) as raised:
        load_policy_dir(directory, environ=environ or {})
    return [str(e) for e in raised.value.errors]


def test_empty_directory_is_the_builtin_defaults_of_the_model(tmp_path: Path) -> None:
    policy = load_policy_dir(tmp_path, environ={})
    provenance = ("sources", "document", "files", "content_hash")
    strip = {f.name: None for f in dataclasses.fields(Policy) if f.name in provenance}
    assert dataclasses.replace(policy, **strip) == dataclasses.replace(Policy(), **strip)
    assert policy.files == ()
    assert set(policy.sources.values()) == {"default"}
    assert policy.sources["/scheduler/timeQuantum"] == "default"


def test_files_merge_in_name_order_and_lists_concatenate(tmp_path: Path) -> None:
    write(
        tmp_path,
        "20-team.yaml",
        """
scheduler: {timeQuantum: 45s}
rules:
  - name: research
    match: {namespace: research, podLabels: {tier: batch}}
    memoryLimit: 4Gi
    coreLimit: 50
migFallback:
  chains: [["2g.35gb", "1g.18gb"]]
""",
    )
    write(
        tmp_path,
        "10-base.json",
        json.dumps(
            {
                "scheduler": {"mode": "auto", "timeQuantum": 20},
                "rules": [{"match": {"user": "alice"}, "mode": "off"}],
                "migFallback": {"chains": [["7g.141gb", "3g.71gb"], ["3g.71gb", "1g.18gb"]]},
                "memory": {"chunk": "32Mi", "reserve": 1024},  # a bare number is MiB
            }
        ),
    )
    write(tmp_path, ".hidden.yaml", "scheduler: {mode: off}\n")
    write(tmp_path, "README.txt", "not a policy\n")
    policy = load_policy_dir(tmp_path, environ={})

    assert policy.files == ("10-base.json", "20-team.yaml")
    assert policy.scheduler.mode is Mode.AUTO  # set by 10, not overridden by 20
    assert policy.scheduler.time_quantum_s == 45.0  # 20 overrides 10 key by key
    assert policy.memory.chunk_bytes == 32 << 20
    assert policy.memory.reserve_bytes == 1 << 30
    assert [r.name for r in policy.rules] == ["10-base.json#/rules/0", "research"]
    alice, research = policy.rules
    assert alice.match.user == "alice" and alice.mode is Mode.OFF
    assert research.source == "20-team.yaml#/rules/0"
    assert research.limits == Limits(memory_bytes=4 << 30, core_percent=50)
    assert dict(research.match.pod_labels) == {"tier": "batch"}
    assert policy.mig_fallback.chains == (("2g.35gb", "1g.18gb"),)  # replaced whole
    assert policy.sources["/scheduler/mode"] == "10-base.json"
    assert policy.sources["/scheduler/timeQuantum"] == "20-team.yaml"
    assert policy.sources["/rules/1/memoryLimit"] == "20-team.yaml"
    assert policy.sources["/migFallback/chains"] == "20-team.yaml"
    assert policy.sources["/metrics/address"] == "default"


def test_yaml_on_and_off_are_modes_not_booleans(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "scheduler:\n  mode: off\nrules:\n  - mode: on\n")
    policy = load_policy_dir(tmp_path, environ={})
    assert policy.scheduler.mode is Mode.OFF
    assert policy.rules[0].mode is Mode.ON
    write(tmp_path, "b.yaml", "metrics:\n  enabled: yes\n")
    assert errors_of(tmp_path) == [
        "b.yaml:2: /metrics/enabled: expected true or false, got a string 'yes'"
    ]


def test_every_error_of_every_file_is_reported_with_its_line(tmp_path: Path) -> None:
    write(
        tmp_path,
        "10-team.yaml",
        """scheduler:
  timeQuantum: 500ms
  quantum: 30s
rules:
  - name: a
    memoryLimit: 4Gx
    coreLimit: 0
""",
    )
    write(
        tmp_path,
        "20-gpu.json",
        '{\n  "gpus": [\n    {"match": {"index": -1}}\n  ],\n  "version": 2\n}\n',
    )
    write(tmp_path, "30-broken.yaml", "metrics: {address: [\n")
    write(tmp_path, "40-dup.yaml", "memory:\n  chunk: 1Mi\n  chunk: 2Mi\n")
    write(tmp_path, "50-two.yaml", "version: 1\n---\nversion: 1\n")
    write(tmp_path, "60-list.yaml", "- version: 1\n")
    errors = errors_of(tmp_path)
    # libyaml and PyYAML's own parser word a syntax error differently; both give file and line
    assert errors[6].startswith("30-broken.yaml:2: not valid YAML: while parsing a flow node")
    errors[6] = "30-broken.yaml:2: not valid YAML: ..."
    assert errors == [
        "10-team.yaml:2: /scheduler/timeQuantum: '500ms' is too short: the time quantum must be "
        "at least 1s (nvshare measured throughput collapse below about 10s)",
        "10-team.yaml:3: /scheduler/quantum: unknown field 'quantum' (did you mean 'timeQuantum'?)",
        "10-team.yaml:6: /rules/0/memoryLimit: '4Gx' is not a size: "
        "unknown unit 'Gx' (units: Ki Mi Gi Ti Pi Ei (1024s), k M G T P E (1000s); "
        "a bare number is MiB)",
        "10-team.yaml:7: /rules/0/coreLimit: 0 is less than the minimum of 1",
        "20-gpu.json:3: /gpus/0/match/index: -1 is less than the minimum of 0",
        "20-gpu.json:5: /version: 2 is not supported (the only policy version is 1)",
        "30-broken.yaml:2: not valid YAML: ...",
        "40-dup.yaml:3: /memory/chunk: duplicate key 'chunk'",
        "50-two.yaml:3: a policy file holds one YAML document, found several",
        "60-list.yaml:1: expected a mapping of policy settings at the top level, got a list",
    ]


def test_errors_across_files_name_the_file_that_set_the_value(tmp_path: Path) -> None:
    write(tmp_path, "10-a.yaml", "scheduler:\n  computeWindow: 1s\nrules:\n  - name: web\n")
    write(
        tmp_path, "20-b.yaml", "# b\nscheduler:\n  quotaSampleInterval: 2s\nrules:\n  - name: web\n"
    )
    assert errors_of(tmp_path) == [
        "20-b.yaml:3: /scheduler/quotaSampleInterval: '2s' is longer than "
        "/scheduler/computeWindow ('1s')",
        "20-b.yaml:5: /rules/0/name: rule name 'web' is already used by 10-a.yaml#/rules/0",
    ]


def test_environment_overrides_win_and_are_recorded(tmp_path: Path) -> None:
    write(tmp_path, "10.yaml", "scheduler: {computeWindow: 5s, carryOverPercent: 20}\n")
    environ = {
        "NVSHARE_COMPUTE_WINDOW_MS": "1500",
        "NVSHARE_QUOTA_SAMPLE_INTERVAL_MS": "50",
        "NVSHARE_QUOTA_CARRYOVER_PERCENT": "0",
        "NVSHARE_DROP_TAIL_BILLING_PERCENT": "100",
        "NVSHARE_METRICS_ENABLE": "false",
        "HAMI_REALTIME_CHECK_MODE": "warning",
        "NVSHARE_REALTIME_CHECK_MODE": "",  # empty: unset
    }
    policy = load_policy_dir(tmp_path, environ=environ)
    assert policy.scheduler.compute_window_s == 1.5
    assert policy.scheduler.quota_sample_interval_s == 0.05
    assert policy.scheduler.carry_over_percent == 0
    assert policy.scheduler.drop_tail_billing_percent == 100
    assert policy.metrics.enabled is False
    assert policy.realtime_check.mode is RealtimeCheckMode.WARNING
    assert policy.sources["/scheduler/computeWindow"] == "env NVSHARE_COMPUTE_WINDOW_MS"
    assert policy.sources["/realtimeCheck/mode"] == "env HAMI_REALTIME_CHECK_MODE"
    both = {"HAMI_REALTIME_CHECK_MODE": "warning", "NVSHARE_REALTIME_CHECK_MODE": "strict"}
    assert load_policy_dir(tmp_path, environ=both).realtime_check.mode is RealtimeCheckMode.STRICT


def test_invalid_environment_values_are_errors_naming_the_variable(tmp_path: Path) -> None:
    environ = {
        "NVSHARE_COMPUTE_WINDOW_MS": "2s",
        "NVSHARE_QUOTA_CARRYOVER_PERCENT": "150",
        "NVSHARE_METRICS_ENABLE": "maybe",
        "NVSHARE_REALTIME_CHECK_MODE": "loose",
    }
    assert errors_of(tmp_path, environ) == [
        "env NVSHARE_COMPUTE_WINDOW_MS: /scheduler/computeWindow: "
        "'2s' is not a positive whole number of milliseconds",
        "env NVSHARE_QUOTA_CARRYOVER_PERCENT: /scheduler/carryOverPercent: "
        "'150' is not a whole percentage from 0 to 100",
        "env NVSHARE_METRICS_ENABLE: /metrics/enabled: "
        "'maybe' is not a switch (expected 0, 1, true or false)",
        "env NVSHARE_REALTIME_CHECK_MODE: /realtimeCheck/mode: "
        "'loose' is not one of strict, warning, disabled",
    ]
    # A valid variable that breaks a cross-field rule is blamed on the variable.
    assert errors_of(tmp_path, {"NVSHARE_QUOTA_SAMPLE_INTERVAL_MS": "5000"}) == [
        "env NVSHARE_QUOTA_SAMPLE_INTERVAL_MS: /scheduler/quotaSampleInterval: "
        "'5000ms' is longer than /scheduler/computeWindow ('500ms')"
    ]


def test_quantities_are_parsed_once_into_bytes_and_seconds(tmp_path: Path) -> None:
    write(
        tmp_path,
        "p.yaml",
        """
memory: {backing: managed, singleProcessOversubscription: true, reserve: 1.5Gi}
realtimeCheck: {mode: strict, safetyMargin: 256Mi, maxSampleAge: 2500ms}
defaults: {memoryLimit: 8G}
annotations: {maxMemoryLimit: 16Gi, coreLimitRange: {min: 10, max: 90}}
gpus:
  - match: {uuid: GPU-8f6e0c52-1b2c-4d3e-9f00-123456789abc}
    timeQuantum: 2m
    memory: 40Gi
""",
    )
    policy = load_policy_dir(tmp_path, environ={})
    assert policy.memory.backing is Backing.MANAGED
    assert policy.memory.reserve_bytes == 3 << 29
    assert policy.realtime_check.safety_margin_bytes == 256 << 20
    assert policy.realtime_check.max_sample_age_s == 2.5
    assert policy.defaults == Limits(
        memory_bytes=8 * 10**9, core_percent=100, priority=0, core_request=0
    )
    assert policy.annotations.max_memory_bytes == 16 << 30
    assert (policy.annotations.min_core_percent, policy.annotations.max_core_percent) == (10, 90)
    gpu = policy.gpus[0]
    assert (gpu.time_quantum_s, gpu.memory_bytes, gpu.mode) == (120.0, 40 << 30, None)


def test_content_hash_follows_names_and_contents(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "scheduler: {timeQuantum: 20s}\n")
    first = load_policy_dir(tmp_path, environ={}).content_hash
    assert load_policy_dir(tmp_path, environ={}).content_hash == first
    (tmp_path / "a.yaml").rename(tmp_path / "b.yaml")
    renamed = load_policy_dir(tmp_path, environ={}).content_hash
    write(tmp_path, "b.yaml", "scheduler: {timeQuantum: 21s}\n")
    edited = load_policy_dir(tmp_path, environ={}).content_hash
    assert len({first, renamed, edited}) == 3


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    assert errors_of(tmp_path / "nope") == [
        f"{tmp_path / 'nope'}: the policy directory does not exist"
    ]


def test_validate_paths_reads_directories_files_and_configmap_manifests(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    write(good, "10.yaml", "scheduler: {mode: auto}\n")
    single = write(tmp_path, "one.yaml", "scheduler: {mode: sometimes}\n")
    manifest = write(
        tmp_path,
        "cm.yaml",
        """apiVersion: apps/v1
kind: Deployment
metadata: {name: unrelated}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: nvshare-policy
data:
  notes.txt: anything
  10-a.yaml: |
    scheduler:
      timeQuantum: 30s
  20-b.yaml: |
    rules:
      - name: x
        memoryLimit: 4Gx
""",
    )
    assert validate_paths([good]) == []
    assert [str(e) for e in validate_paths([good, single, manifest, tmp_path / "gone.yaml"])] == [
        f"{single}:1: /scheduler/mode: 'sometimes' is not one of: on, off, auto",
        f"{manifest}: data[20-b.yaml]:17: /rules/0/memoryLimit: '4Gx' is not a size: "
        "unknown unit 'Gx' (units: Ki Mi Gi Ti Pi Ei (1024s), k M G T P E (1000s); "
        "a bare number is MiB)",
        f"{tmp_path / 'gone.yaml'}: cannot read: No such file or directory",
    ]


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "10-pipe.yaml")  # would block a plain open()
    (tmp_path / "20-dir.yaml").mkdir()
    write(tmp_path, "40-real.yaml", "scheduler: {mode: auto}\n")
    policy = load_policy_dir(tmp_path, environ={})
    assert policy.files == ("40-real.yaml",)
    assert policy.scheduler.mode is Mode.AUTO


def test_a_name_whose_symlink_dangles_is_an_error_not_a_removed_file(tmp_path: Path) -> None:
    # What kubelet's mount shows between removing ..data and renaming the new one in.
    (tmp_path / "policy.yaml").symlink_to("..data/policy.yaml")
    snapshot = read_policy_dir(tmp_path)
    assert snapshot.dangling == ("policy.yaml",)
    with pytest.raises(PolicyLoadError) as e:
        build_policy(snapshot, environ={})
    assert "policy.yaml: is a symlink to a file that does not exist" in str(e.value)


def test_priorities_and_requests_are_read_by_name_or_number(tmp_path: Path) -> None:
    write(
        tmp_path,
        "p.yaml",
        """
defaults: {priority: low, coreRequest: 10}
rules:
  - {name: serving, match: {namespace: serving}, priority: high, coreRequest: 60}
  - {name: tuned, match: {namespace: lab}, priority: -5}
annotations: {priorityRange: {min: -20, max: normal}, maxCoreRequest: 50}
""",
    )
    policy = load_policy_dir(tmp_path, environ={})
    assert (policy.defaults.priority, policy.defaults.core_request) == (-100, 10)
    assert [(r.limits.priority, r.limits.core_request) for r in policy.rules] == [
        (100, 60),
        (-5, None),
    ]
    ann = policy.annotations
    assert (ann.min_priority, ann.max_priority, ann.max_core_request) == (-20, 0, 50)
    write(tmp_path, "p.yaml", "annotations: {priorityRange: {min: high, max: low}}\n")
    assert errors_of(tmp_path, {}) == [
        "p.yaml:1: /annotations/priorityRange/min: min high is above max low"
    ]
    write(tmp_path, "p.yaml", "rules: [{priority: urgent}]\n")
    assert len(errors_of(tmp_path, {})) == 1
