"""Pods as the core sees them, the limits their annotations ask for, and the table of both.

The pod watcher (`appliance.kube.pod_watch`) turns API objects into `PodInfo`; this module
judges a pod's annotations into `PodOverrides` under the policy's `AnnotationPolicy`, and
`PodTable` keeps every pod of this node with its overrides: the one owner of both, judged again
when the policy changes. It is pure: no I/O, no clock, so every annotation rule is a plain
function call in tests.

A bad annotation never replaces a good value: the field keeps its previous override (when
that is still allowed by the current policy) and an `AnnotationProblem` says what was wrong,
on which pod and key, and what was kept. The core logs problems and asks for them to be
reported on the pod as Kubernetes Events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from appliance.core.identity import ClientIdentity
from appliance.policy.model import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITY_NAMES,
    AnnotationPolicy,
    priority_name,
)
from appliance.policy.quantity import QuantityError, format_bytes, parse_size

MEMORY_LIMIT = "nvshare.com/gpu-memory-limit"
CORE_LIMIT = "nvshare.com/gpu-core-limit"
PRIORITY = "nvshare.com/gpu-priority"
CORE_REQUEST = "nvshare.com/gpu-core-request"
REALTIME_CHECK = "nvshare.com/realtime-check"
HAMI_REALTIME_CHECK = "hami.io/enable-realtime-check"

_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PodRef:
    """Enough to name a pod in logs and to attach an Event to it."""

    uid: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the scheduler needs from one pod bound to this node."""

    uid: str
    namespace: str
    name: str
    node: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    resources: frozenset[str] = frozenset()  # extended resources its containers ask for

    @property
    def ref(self) -> PodRef:
        return PodRef(uid=self.uid, namespace=self.namespace, name=self.name)


@dataclass(frozen=True, slots=True)
class PodOverrides:
    """Limits a pod asks for through annotations; None means "the policy decides"."""

    memory_bytes: int | None = None
    core_percent: int | None = None
    realtime_check: bool | None = None
    priority: int | None = None
    core_request: int | None = None


NO_OVERRIDES = PodOverrides()


@dataclass(frozen=True, slots=True)
class AnnotationProblem:
    """An annotation that was not applied: what, where, and what is in force instead."""

    pod: PodRef
    key: str
    value: str
    message: str
    kept: str

    def __str__(self) -> str:
        return (
            f"pod {self.pod}: annotation {self.key}={self.value!r} ignored: {self.message}; "
            f"kept {self.kept}"
        )


def resolve_overrides(
    annotations: Mapping[str, str],
    *,
    pod: PodRef,
    policy: AnnotationPolicy,
    previous: PodOverrides | None,
) -> tuple[PodOverrides, list[AnnotationProblem]]:
    """The overrides a pod's annotations ask for, and the annotations that were refused.

    A missing annotation means no override. A refused one keeps the previous override for that
    field if the current policy still allows it, else no override (the policy value applies).
    """
    prev = previous or NO_OVERRIDES
    problems: list[AnnotationProblem] = []
    overrides = PodOverrides(
        memory_bytes=_MEMORY.judge(annotations, pod, policy, prev.memory_bytes, problems),
        core_percent=_CORE.judge(annotations, pod, policy, prev.core_percent, problems),
        realtime_check=_REALTIME.judge(annotations, pod, policy, prev.realtime_check, problems),
        priority=_PRIORITY.judge(annotations, pod, policy, prev.priority, problems),
        core_request=_CORE_REQUEST.judge(annotations, pod, policy, prev.core_request, problems),
    )
    return overrides, problems


@dataclass(frozen=True, slots=True)
class Refused:
    """Why an annotation's value was not taken (what a parser returns instead of a value)."""

    message: str


_DISABLED = Refused("annotations are disabled by policy (annotations.allowed is false)")


@dataclass(frozen=True, slots=True)
class _Field(Generic[T]):
    """One annotation: the keys it is read from (the first present), how its text is parsed (a
    value or why it was refused; only asked while the policy allows annotations), whether a
    value is still allowed under the policy, and how a kept value is shown."""

    keys: tuple[str, ...]
    parse: Callable[[str, AnnotationPolicy], T | Refused]
    allowed: Callable[[T, AnnotationPolicy], bool]
    show: Callable[[T], str]

    def judge(
        self,
        annotations: Mapping[str, str],
        pod: PodRef,
        policy: AnnotationPolicy,
        previous: T | None,
        problems: list[AnnotationProblem],
    ) -> T | None:
        """The override this field takes: the annotation's value, none when it is absent, or,
        when it is refused, the previous override if still allowed (the refusal added to
        `problems`)."""
        key = next((k for k in self.keys if k in annotations), None)
        if key is None:
            return None
        raw = annotations[key]
        parsed = self.parse(raw, policy) if policy.allowed else _DISABLED
        if not isinstance(parsed, Refused):
            return parsed
        kept = previous
        if kept is not None and not (policy.allowed and self.allowed(kept, policy)):
            kept = None
        shown = "the policy value" if kept is None else f"previous override {self.show(kept)}"
        problems.append(
            AnnotationProblem(pod=pod, key=key, value=raw, message=parsed.message, kept=shown)
        )
        return kept


def _percent(value: int) -> str:
    return f"{value}%"


class PodTable:
    """The pods bound to this node, by UID, and the overrides their annotations ask for; and,
    after a restart, the memory limits the previous daemon published for pods the pod watch has
    not listed yet (`remembered`: pod UID -> bytes, None = no limit)."""

    def __init__(self, remembered: Mapping[str, int | None] | None = None) -> None:
        self.pods: dict[str, PodInfo] = {}
        self.overrides: dict[str, PodOverrides] = {}
        self.remembered: dict[str, int | None] = dict(remembered or {})

    def seen(self, pod: PodInfo, policy: AnnotationPolicy) -> list[AnnotationProblem]:
        """A pod appeared or changed: judge its annotations; the problems are what was refused."""
        self.pods[pod.uid] = pod
        self.remembered.pop(pod.uid, None)  # what the API says now replaces what was published
        self.overrides[pod.uid], problems = resolve_overrides(
            pod.annotations, pod=pod.ref, policy=policy, previous=self.overrides.get(pod.uid)
        )
        return problems

    def removed(self, ref: PodRef) -> None:
        self.pods.pop(ref.uid, None)
        self.overrides.pop(ref.uid, None)
        self.remembered.pop(ref.uid, None)

    def listed(self, uids: frozenset[str]) -> None:
        """The pod watch listed every pod of the node: a remembered pod not among them is gone."""
        self.remembered = {uid: m for uid, m in self.remembered.items() if uid in uids}

    def judge_again(self, policy: AnnotationPolicy) -> list[AnnotationProblem]:
        """The annotation caps may have changed: judge every pod's annotations again."""
        problems: list[AnnotationProblem] = []
        for pod in list(self.pods.values()):
            problems += self.seen(pod, policy)
        return problems

    def pod_of(self, ident: ClientIdentity, *, claims: bool) -> tuple[PodInfo | None, str]:
        """A client's pod and how it is known: "cgroup" (the kernel's word) or "claimed" (the
        pod name the client gave, counted only where `claims` says the policy trusts it, and
        flagged as such wherever it is shown)."""
        if ident.pod_uid and ident.pod_uid in self.pods:
            return self.pods[ident.pod_uid], "cgroup"
        if claims and ident.claimed_pod:
            for pod in self.pods.values():
                if pod.name == ident.claimed_pod and pod.namespace == ident.claimed_namespace:
                    return pod, "claimed"
        return None, ""

    def overrides_of(self, pod: PodInfo | None) -> PodOverrides | None:
        return self.overrides.get(pod.uid) if pod is not None else None


# Each parser returns the value or why it was refused; it is only asked for an annotation
# present while the policy allows annotations.


def _memory(raw: str, policy: AnnotationPolicy) -> int | Refused:
    try:
        value = parse_size(raw)
    except QuantityError as e:
        return Refused(str(e))
    if value <= 0:
        return Refused("a memory limit must be greater than zero")
    if not _memory_allowed(value, policy):
        assert policy.max_memory_bytes is not None
        return Refused(
            f"{format_bytes(value)} is above the policy cap annotations.maxMemory="
            f"{format_bytes(policy.max_memory_bytes)}"
        )
    return value


def _memory_allowed(value: int, policy: AnnotationPolicy) -> bool:
    return policy.max_memory_bytes is None or value <= policy.max_memory_bytes


def _core(raw: str, policy: AnnotationPolicy) -> int | Refused:
    text = raw.strip()
    if not text.isdigit():
        return Refused(f"{raw!r} is not a whole number of percent (expected 1-100)")
    value = int(text)
    if not 1 <= value <= 100:
        return Refused(f"{value} is outside 1-100")
    if not _core_allowed(value, policy):
        return Refused(
            f"{value} is outside the policy range {policy.min_core_percent}-"
            f"{policy.max_core_percent}"
        )
    return value


def _core_allowed(value: int, policy: AnnotationPolicy) -> bool:
    return policy.min_core_percent <= value <= policy.max_core_percent


def _realtime(raw: str, policy: AnnotationPolicy) -> bool | Refused:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return Refused(f"{raw!r} is not a boolean (expected true or false)")


def _priority(raw: str, policy: AnnotationPolicy) -> int | Refused:
    text = raw.strip().lower()
    if text in PRIORITY_NAMES:
        value = PRIORITY_NAMES[text]
    elif text.lstrip("-").isdigit():
        value = int(text)
    else:
        return Refused(f"{raw!r} is not a priority (expected low, normal, high or a whole number)")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        return Refused(f"{value} is outside {MIN_PRIORITY} to {MAX_PRIORITY}")
    if not _priority_allowed(value, policy):
        return Refused(
            f"{priority_name(value)} is outside the policy range annotations.priorityRange "
            f"{priority_name(policy.min_priority)} to {priority_name(policy.max_priority)}"
        )
    return value


def _priority_allowed(value: int, policy: AnnotationPolicy) -> bool:
    return policy.min_priority <= value <= policy.max_priority


def _core_request(raw: str, policy: AnnotationPolicy) -> int | Refused:
    text = raw.strip()
    if not text.isdigit() or int(text) > 100:
        return Refused(f"{raw!r} is not a whole number of percent (expected 0-100)")
    if not _request_allowed(int(text), policy):
        return Refused(
            f"{text} is above the policy cap annotations.maxCoreRequest={policy.max_core_request}"
        )
    return int(text)


def _request_allowed(value: int, policy: AnnotationPolicy) -> bool:
    return value <= policy.max_core_request


def _any_value(value: bool, policy: AnnotationPolicy) -> bool:
    return True


_MEMORY = _Field((MEMORY_LIMIT,), _memory, _memory_allowed, format_bytes)
_CORE = _Field((CORE_LIMIT,), _core, _core_allowed, _percent)
# HAMi's name for the same switch, read where ours is absent
_REALTIME = _Field(
    (REALTIME_CHECK, HAMI_REALTIME_CHECK), _realtime, _any_value, lambda v: str(v).lower()
)
_PRIORITY = _Field((PRIORITY,), _priority, _priority_allowed, priority_name)
_CORE_REQUEST = _Field((CORE_REQUEST,), _core_request, _request_allowed, _percent)
