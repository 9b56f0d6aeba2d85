"""One size grammar: every case of tests/data/sizes.json read the same way by the appliance's
parser, a policy file, a pod annotation and nvsharectl (the hook: tests/hook/test_sizes.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes.utils import parse_quantity

from appliance.cli.nvsharectl import nvsharectl
from appliance.core.annotations import MEMORY_LIMIT, PodRef, resolve_overrides
from appliance.policy.load import load_policy_dir, validate_paths
from appliance.policy.model import AnnotationPolicy
from appliance.policy.quantity import MAX_SIZE_BYTES, QuantityError, parse_count, parse_size

ROOT = Path(__file__).resolve().parents[2]
TABLE = json.loads((ROOT / "tests" / "data" / "sizes.json").read_text())
CASES: list[dict[str, Any]] = TABLE["cases"]
ACCEPTED = [c for c in CASES if "bytes" in c]
POD = PodRef(uid="u1", namespace="ml", name="trainer")


def ids(case: dict[str, Any]) -> str:
    return repr(case["text"])


def test_the_table_covers_both_sides_of_every_rule() -> None:
    assert TABLE["maxBytes"] == MAX_SIZE_BYTES
    assert any(c.get("bytes") == MAX_SIZE_BYTES for c in CASES)  # the bound itself is accepted
    assert any("at most 1Ei" in c.get("error", "") for c in CASES)
    assert len(ACCEPTED) >= 20 and len(CASES) - len(ACCEPTED) >= 20


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_parse_size(case: dict[str, Any]) -> None:
    if "bytes" in case:
        assert parse_size(case["text"]) == case["bytes"]
    else:
        with pytest.raises(QuantityError) as e:
            parse_size(case["text"])
        assert case["error"] in str(e.value)
        assert repr(case["text"]) in str(e.value)  # says which value


@pytest.mark.parametrize("case", ACCEPTED, ids=ids)
def test_accepted_sizes_are_what_kubernetes_makes_of_them(case: dict[str, Any]) -> None:
    text = case["text"].strip()
    unitless = text[-1:].isdigit()
    quantity = parse_quantity(text + "Mi" if unitless else text)  # our one rule on top
    assert math.ceil(quantity) == case["bytes"]


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_a_policy_file_reads_the_table(case: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(f"defaults: {{memoryLimit: {json.dumps(case['text'])}}}\n")
    errors = [str(e) for e in validate_paths([tmp_path / "p.yaml"])]
    if "bytes" in case:
        assert errors == []
        assert load_policy_dir(tmp_path, environ={}).defaults.memory_bytes == case["bytes"]
    else:
        assert len(errors) == 1 and "/defaults/memoryLimit" in errors[0], errors
        assert case["error"] in errors[0]


@pytest.mark.parametrize(
    ("yaml_value", "expected"),
    [("4096", 4 << 30), ("1.5", 3 << 19), ("0", 0), ("1099511627776", MAX_SIZE_BYTES)],
)
def test_a_bare_yaml_number_is_mib(yaml_value: str, expected: int, tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(f"gpus: [{{memory: {yaml_value}}}]\n")
    assert load_policy_dir(tmp_path, environ={}).gpus[0].memory_bytes == expected


@pytest.mark.parametrize(
    ("yaml_value", "message"),
    [("1099511627777", "at most 1Ei"), ("-1", "must not be negative"), ("true", "not a size")],
)
def test_a_bare_yaml_number_past_the_bounds_is_refused(
    yaml_value: str, message: str, tmp_path: Path
) -> None:
    (tmp_path / "p.yaml").write_text(f"memory: {{reserve: {yaml_value}}}\n")
    (error,) = validate_paths([tmp_path / "p.yaml"])
    assert error.json_path == "/memory/reserve" and message in error.message


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_an_annotation_reads_the_table(case: dict[str, Any]) -> None:
    overrides, problems = resolve_overrides(
        {MEMORY_LIMIT: case["text"]}, pod=POD, policy=AnnotationPolicy(), previous=None
    )
    if case.get("bytes"):
        assert (overrides.memory_bytes, problems) == (case["bytes"], [])
        return
    (problem,) = problems
    assert overrides.memory_bytes is None and problem.key == MEMORY_LIMIT
    assert case.get("error", "greater than zero") in problem.message


def test_nvsharectl_reads_the_table(tmp_path: Path) -> None:
    runner = CliRunner()
    for case in CASES:
        result = runner.invoke(
            nvsharectl,
            ["--socket-dir", str(tmp_path), "limit", "set", "--pid", "7", "--", case["text"]],
        )
        if case.get("bytes"):  # parsed; then it looks for the daemon
            assert result.exit_code == 1, (case, result.output)
            assert "no nvshare scheduler is running" in result.output
        else:
            assert result.exit_code == 2, (case, result.output)
            # a negative size on the command line reads as a wish to lower the limit: the CLI
            # says how to remove one instead of the parser's "without a sign"
            negative = case["text"].startswith("-")
            expected = "must be positive" if negative else case.get("error", "greater than 0")
            assert expected in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("value", "count"), [("1", 1), ("2", 2), (4, 4), ("2k", 2000), ("0", 0), (" 3 ", 3)]
)
def test_device_counts_are_whole_quantities(value: object, count: int) -> None:
    assert parse_count(value) == count


@pytest.mark.parametrize("value", ["1.5", "1Gx", "-1", "500m", "", "lots"])
def test_a_device_count_that_is_not_whole_is_refused(value: str) -> None:
    with pytest.raises(QuantityError, match="not a whole number of devices"):
        parse_count(value)
