"""Environment variables that override policy files, as nvshare and HAMi deployments set them.

Existing nvshare/HAMi manifests configure quotas and the real-time memory check through the
environment; honouring the same names lets them move to the appliance unchanged. An override wins
over every file, is recorded in `Policy.sources` as "env NAME", and a value that cannot be used is
a `PolicyError` whose file is "env NAME". An empty value counts as unset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.policy.errors import PolicyError


@dataclass(frozen=True, slots=True)
class EnvOverride:
    variable: str
    json_path: str
    value: Any  # a value the schema accepts at json_path


def _milliseconds(raw: str) -> Any:
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ValueError(f"{raw!r} is not a positive whole number of milliseconds")
    return f"{int(raw)}ms"


def _percent(raw: str) -> Any:
    if not raw.strip().isdigit() or int(raw) > 100:
        raise ValueError(f"{raw!r} is not a whole percentage from 0 to 100")
    return int(raw)


def _flag(raw: str) -> Any:
    word = raw.strip().lower()
    if word in ("1", "true"):
        return True
    if word in ("0", "false"):
        return False
    raise ValueError(f"{raw!r} is not a switch (expected 0, 1, true or false)")


def _realtime_mode(raw: str) -> Any:
    word = raw.strip().lower()
    if word not in ("strict", "warning", "disabled"):
        raise ValueError(f"{raw!r} is not one of strict, warning, disabled")
    return word


# (variable, JSON path, parser); where two variables set one path, the first one set wins.
ENV_OVERRIDES: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("NVSHARE_COMPUTE_WINDOW_MS", "/scheduler/computeWindow", _milliseconds),
    ("NVSHARE_QUOTA_SAMPLE_INTERVAL_MS", "/scheduler/quotaSampleInterval", _milliseconds),
    ("NVSHARE_QUOTA_CARRYOVER_PERCENT", "/scheduler/carryOverPercent", _percent),
    ("NVSHARE_DROP_TAIL_BILLING_PERCENT", "/scheduler/dropTailBillingPercent", _percent),
    ("NVSHARE_METRICS_ENABLE", "/metrics/enabled", _flag),
    ("NVSHARE_REALTIME_CHECK_MODE", "/realtimeCheck/mode", _realtime_mode),
    ("HAMI_REALTIME_CHECK_MODE", "/realtimeCheck/mode", _realtime_mode),
    # HAMi's global switch: on for every pod whose annotation does not say otherwise (in
    # strict unless a mode is set), off for every pod that does not opt in.
    ("NVSHARE_ENABLE_REALTIME_CHECK", "/realtimeCheck/enabledByDefault", _flag),
    ("HAMI_ENABLE_REALTIME_CHECK", "/realtimeCheck/enabledByDefault", _flag),
)


def env_overrides(environ: Mapping[str, str]) -> tuple[list[EnvOverride], list[PolicyError]]:
    """The overrides the environment asks for, and the errors in the values it gives."""
    overrides: list[EnvOverride] = []
    errors: list[PolicyError] = []
    taken: set[str] = set()
    for variable, json_path, parse in ENV_OVERRIDES:
        raw = environ.get(variable, "")
        if not raw or json_path in taken:
            continue
        taken.add(json_path)
        try:
            overrides.append(EnvOverride(variable, json_path, parse(raw)))
        except ValueError as e:
            errors.append(PolicyError(f"env {variable}", None, json_path, str(e)))
    return overrides, errors
