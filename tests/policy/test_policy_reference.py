"""The schema, the README reference and the shipped policies agree with each other."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.policy import schema
from appliance.policy.env import ENV_OVERRIDES
from appliance.policy.load import load_policy_dir, validate_paths
from appliance.policy.model import RealtimeCheckMode

ROOT = Path(__file__).resolve().parents[2]


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- policy-reference:start -->")
    end = text.index("<!-- policy-reference:end -->")
    return text[start:end]


def reference_rows() -> dict[str, list[str]]:
    rows = {}
    for line in readme_block().splitlines():
        m = re.match(r"^\| `(/[^`]*)` \|", line)
        if m:
            rows[m.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def test_readme_reference_lists_exactly_the_schema_fields_with_their_defaults() -> None:
    rows = reference_rows()
    properties = dict(schema.iter_properties())
    assert sorted(rows) == sorted(properties), "README policy reference and schema differ"
    for path, sub in properties.items():
        assert rows[path][2] == f"`{json.dumps(sub['default'])}`", f"default of {path}"


def test_readme_reference_names_every_environment_override() -> None:
    block = readme_block()
    for variable, json_path, _ in ENV_OVERRIDES:
        assert re.search(rf"\| `{variable}` \| `{json_path}` \|", block), variable


def _objects(node: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        if "properties" in node:
            found.append((where, node))
        for key, sub in node.items():
            found += _objects(sub, f"{where}/{key}")
    elif isinstance(node, list):
        for index, sub in enumerate(node):
            found += _objects(sub, f"{where}/{index}")
    return found


def test_every_schema_object_is_closed_and_every_field_documented() -> None:
    for where, node in _objects(schema.policy_schema(), "#"):
        assert node.get("additionalProperties") is False, f"{where} accepts unknown fields"
    for path, sub in schema.iter_properties():
        assert sub.get("description"), f"{path} has no description"
        assert "default" in sub, f"{path} has no default"


def test_the_bundled_default_policy_sets_nothing_beyond_the_builtin_defaults(
    tmp_path: Path,
) -> None:
    bundled = load_policy_dir(ROOT / "configmaps" / "default", environ={})
    empty = load_policy_dir(tmp_path, environ={})
    assert bundled.document == empty.document
    assert {path for path, source in bundled.sources.items() if source != "default"} == {"/version"}
    assert bundled.files == ("00-default.yaml",)


# Drop-in names the README and docs use as examples: each must win over the shipped default.
EXAMPLE_NAME = re.compile(r"\b(\d\d-[a-z][a-z-]*\.yaml)\b")


def test_the_drop_in_names_the_docs_suggest_override_the_shipped_default(
    tmp_path: Path,
) -> None:
    """An operator's 30-realtime.yaml next to the shipped file: every value it sets is in force
    (before, the shipped policy.yaml sorted after it and set every scalar back)."""
    texts = (ROOT / "README.md").read_text() + (ROOT / "docs" / "policy.md").read_text()
    texts += (ROOT / "docs" / "kubernetes.md").read_text()
    names = sorted(set(EXAMPLE_NAME.findall(texts)) - {"00-default.yaml"})
    assert "30-realtime.yaml" in names and "10-site.yaml" in names
    drop_in = (
        "scheduler: {mode: auto, timeQuantum: 45s}\n"
        "realtimeCheck: {mode: strict, safetyMargin: 200Mi, nodeStatus: {minInterval: 2s}}\n"
    )
    for name in names:
        directory = tmp_path / name
        shutil.copytree(ROOT / "configmaps" / "default", directory)
        (directory / name).write_text(drop_in)
        policy = load_policy_dir(directory, environ={})
        assert policy.files[0] == "00-default.yaml", name
        assert policy.realtime_check.mode is RealtimeCheckMode.STRICT, name
        assert policy.realtime_check.safety_margin_bytes == 200 << 20, name
        assert policy.realtime_check.node_status.min_interval_s == 2.0, name
        assert (policy.scheduler.mode.value, policy.scheduler.time_quantum_s) == ("auto", 45.0)
        assert policy.sources["/realtimeCheck/mode"] == name


SHIPPED = sorted((ROOT / "configmaps" / "default").glob("*.yaml")) + sorted(
    (ROOT / "configmaps" / "examples").glob("*.yaml")
)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_policy_is_valid(path: Path) -> None:
    assert [str(e) for e in validate_paths([path])] == []


def mount(manifest: Path, into: Path) -> Path:
    """What kubelet shows the daemon: each data key of the ConfigMap as a file."""
    (configmap,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "ConfigMap"]
    into.mkdir()
    for key, text in configmap["data"].items():
        (into / key).write_text(text)
    return into


def test_shipped_examples_do_what_they_say(tmp_path: Path) -> None:
    examples = ROOT / "configmaps" / "examples"
    teams = load_policy_dir(mount(examples / "team-quotas.yaml", tmp_path / "t"), environ={})
    assert {r.match.namespace for r in teams.rules} >= {"research", "serving", "notebooks"}
    desk = load_policy_dir(mount(examples / "workstation.yaml", tmp_path / "w"), environ={})
    assert {r.match.group for r in desk.rules} >= {"students"}
    assert {r.match.user for r in desk.rules} >= {"alice"}
    mig = load_policy_dir(mount(examples / "mig-fallback.yaml", tmp_path / "m"), environ={})
    assert ("3g.40gb", "2g.20gb", "1g.10gb") in mig.mig_fallback.chains
