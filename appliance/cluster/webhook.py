"""The MIG-fallback mutating admission webhook.

A pod that asks for a MIG profile no node can give (say `nvidia.com/mig-3g.40gb`) pends until
one frees up. When the policy lists that profile in a `migFallback.chains` chain, this webhook
rewrites the pod at CREATE to the next profile in the chain that some node has free, and
annotates the pod with what it did (`nvshare.com/mig-fallback: "3g.40gb->2g.20gb"`; the key is
the policy's `migFallback.annotation`, say seed 004's `gpu-webhook.k8s.io/fallback`), so the
user can see why their pod got a smaller slice.

It must never be the reason a pod is refused: every error of ours (API server unreachable,
malformed pod, a bug) answers "allowed, unchanged" with a warning, and the configuration
uses `failurePolicy: Ignore` for the case where the webhook is down altogether.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from appliance.placement.resources import pod_request
from appliance.placement.resources import resource_count as _count

log = logging.getLogger(__name__)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
FALLBACK_ANNOTATION = "nvshare.com/mig-fallback"
# The AdmissionReview's uid, on a pod whose devices a replica recorded in the shared admission
# ledger (`appliance.cluster.admission_ledger`): an informer that shows the pod retires the claim.
ADMISSION_ANNOTATION = "nvshare.com/mig-admission"
# A pod labelled `nvshare.com/mig-fallback: disabled` keeps the profile it asked for. The
# configuration's objectSelector keeps such pods away from the webhook; the webhook checks too.
OPT_OUT_LABEL = "nvshare.com/mig-fallback"
OPT_OUT_VALUE = "disabled"
WARNING_MAX_CHARS = 250

Chains = Sequence[Sequence[str]]
Availability = Callable[[str, int], bool]  # (resource name, count) -> some node has it free


Decision = Callable[[Availability], "Mapping[str, Any] | None"]  # -> the pod as admitted


class MigCapacity(Protocol):
    """Where the webhook learns what is free and records what it admitted.

    `admit` calls `decide` with what is free (perhaps more than once, when another replica
    admitted meanwhile) and makes the pod it returns (None: nothing to hold) count against what
    is free from then on, so that the next review (of the same burst, before anything is bound,
    on this replica or another) sees it taken. It returns annotations for the pod.
    """

    def admit(self, *, admission: str, namespace: str, decide: Decision) -> Mapping[str, str]: ...


@dataclass(frozen=True, slots=True)
class Fallback:
    """One rewrite: every request and limit of `requested` becomes `granted`."""

    requested: str  # resource names, "nvidia.com/mig-3g.40gb"
    granted: str

    @property
    def summary(self) -> str:
        return f"{profile_of(self.requested)}->{profile_of(self.granted)}"


def profile_of(name: str) -> str:
    """`nvidia.com/mig-3g.40gb` or `3g.40gb` -> `3g.40gb`."""
    return name.removeprefix(MIG_RESOURCE_PREFIX)


def resource_of(profile: str) -> str:
    """`3g.40gb` (as policy chains spell it) or a full resource name -> the resource name."""
    return profile if profile.startswith(MIG_RESOURCE_PREFIX) else MIG_RESOURCE_PREFIX + profile


def requested_mig_resources(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    names: dict[str, None] = {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            for name in resources.get(section) or {}:
                if name.startswith(MIG_RESOURCE_PREFIX):
                    names[name] = None
    return list(names)


def choose_fallbacks(
    pod: Mapping[str, Any], *, chains: Chains, available: Availability
) -> tuple[list[Fallback], list[str]]:
    """The rewrites this pod needs, and warnings for profiles that have no way out."""
    fallbacks: list[Fallback] = []
    warnings: list[str] = []
    for resource in requested_mig_resources(pod):
        count = pod_request(pod, resource)
        chain = next(
            (
                [resource_of(p) for p in c]
                for c in chains
                if resource in [resource_of(p) for p in c]
            ),
            None,
        )
        if chain is None or count == 0 or available(resource, count):
            continue
        later = chain[chain.index(resource) + 1 :]
        granted = next((r for r in later if available(r, count)), None)
        if granted is None:
            warnings.append(
                f"{resource} x{count} is not free on any node, nor is any fallback "
                f"({', '.join(profile_of(r) for r in later) or 'none after it'}); "
                "the pod is left unchanged and will wait"
            )
            continue
        fallbacks.append(Fallback(requested=resource, granted=granted))
    return fallbacks, warnings


def apply_fallbacks(pod: Mapping[str, Any], fallbacks: Sequence[Fallback]) -> dict[str, Any]:
    """The pod as `fallback_patch` leaves it (its resources; annotations are not needed)."""
    result = copy.deepcopy(dict(pod))
    spec = result.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            values = resources.get(section) or {}
            for fallback in fallbacks:
                if fallback.requested in values:
                    amount = _count(values.pop(fallback.requested))
                    values[fallback.granted] = str(amount + _count(values.get(fallback.granted, 0)))
    return result


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def fallback_patch(
    pod: Mapping[str, Any],
    fallbacks: Sequence[Fallback],
    *,
    annotation: str = FALLBACK_ANNOTATION,
    marks: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """RFC 6902 operations that move every request/limit and add the annotation (where
    anything moved) and `marks`."""
    ops: list[dict[str, Any]] = []
    spec = pod.get("spec") or {}
    for kind in ("containers", "initContainers"):
        for index, container in enumerate(spec.get(kind) or []):
            resources = container.get("resources") or {}
            for section in ("limits", "requests"):
                values = resources.get(section) or {}
                base = f"/spec/{kind}/{index}/resources/{section}"
                for fallback in fallbacks:
                    if fallback.requested not in values:
                        continue
                    amount = _count(values[fallback.requested])
                    amount += _count(values.get(fallback.granted, 0))
                    ops.append({"op": "remove", "path": f"{base}/{_escape(fallback.requested)}"})
                    ops.append(
                        {
                            "op": "add",
                            "path": f"{base}/{_escape(fallback.granted)}",
                            "value": str(amount),
                        }
                    )
    summary = ",".join(f.summary for f in fallbacks)
    annotations = {annotation: summary} if fallbacks else {}
    return ops + annotation_ops(pod, {**annotations, **(marks or {})})


def annotation_ops(pod: Mapping[str, Any], annotations: Mapping[str, str]) -> list[dict[str, Any]]:
    """RFC 6902 operations that add `annotations` to the pod."""
    if not annotations:
        return []
    if (pod.get("metadata") or {}).get("annotations") is None:
        return [{"op": "add", "path": "/metadata/annotations", "value": dict(annotations)}]
    return [
        {"op": "add", "path": f"/metadata/annotations/{_escape(key)}", "value": value}
        for key, value in annotations.items()
    ]


class MigFallbackWebhook:
    """AdmissionReview in, AdmissionReview out; no I/O except through `capacity`.

    Reviews arrive on many connections at once (a burst of pods); the decision and the
    reservation of what it admitted happen under one lock, so two reviews never both take the
    last free device of a profile.
    """

    def __init__(
        self,
        *,
        chains: Callable[[], Chains],
        capacity: MigCapacity,
        annotation: Callable[[], str] = lambda: FALLBACK_ANNOTATION,
    ) -> None:
        self._chains = chains
        self._capacity = capacity
        self._annotation = annotation
        self._deciding = threading.Lock()

    def review(self, body: Mapping[str, Any]) -> dict[str, Any]:
        request = body.get("request") or {}
        response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
        try:
            self._mutate(request, response)
        except NotSynced as exc:
            log.warning("MIG fallback skipped for %s: %s", _pod_name(request), exc)
            response["warnings"] = [warning_text(f"nvshare MIG fallback skipped ({exc})")]
        except Exception as exc:  # fail open: our error must not block anyone's pod
            log.exception("MIG fallback failed for %s; admitting unchanged", _pod_name(request))
            response.pop("patch", None)
            response.pop("patchType", None)
            response["warnings"] = [
                warning_text(f"nvshare MIG fallback skipped ({exc}); pod admitted unchanged")
            ]
        return {
            "apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
            "kind": "AdmissionReview",
            "response": response,
        }

    def _mutate(self, request: Mapping[str, Any], response: dict[str, Any]) -> None:
        pod = request.get("object") or {}
        if request.get("operation") != "CREATE" or pod.get("kind", "Pod") != "Pod":
            return
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(OPT_OUT_LABEL) == OPT_OUT_VALUE:
            return
        if not requested_mig_resources(pod):
            return
        chains = self._chains()
        decided: list[tuple[list[Fallback], list[str]]] = []

        def decide(available: Availability) -> Mapping[str, Any] | None:
            decided.append(choose_fallbacks(pod, chains=chains, available=available))
            # a dry run creates nothing: nothing to hold
            return None if request.get("dryRun") else apply_fallbacks(pod, decided[-1][0])

        with self._deciding:
            marks = self._capacity.admit(
                admission=str(request.get("uid", "")),
                namespace=str(request.get("namespace") or ""),
                decide=decide,
            )
        fallbacks, warnings = decided[-1]
        if warnings:
            response["warnings"] = [warning_text(w) for w in warnings]
            for warning in warnings:
                log.warning("pod %s: %s", _pod_name(request), warning)
        if fallbacks or marks:
            patch = fallback_patch(pod, fallbacks, annotation=self._annotation(), marks=marks)
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        if fallbacks:
            log.info(
                "pod %s: MIG fallback %s",
                _pod_name(request),
                ",".join(f.summary for f in fallbacks),
            )


def warning_text(text: str) -> str:
    """A warning the API server passes on: printable characters only, and short.

    It becomes an HTTP `Warning` header and a line on the user's terminal, so an exception's
    newlines, escapes or a pod name full of control characters must not reach it.
    """
    clean = "".join(c if c.isprintable() else " " for c in text)
    clean = " ".join(clean.split())
    if len(clean) > WARNING_MAX_CHARS:
        clean = clean[: WARNING_MAX_CHARS - 3] + "..."
    return clean


def _pod_name(request: Mapping[str, Any]) -> str:
    pod = request.get("object") or {}
    metadata = pod.get("metadata") or {}
    name = metadata.get("name") or metadata.get("generateName") or "<unnamed>"
    return f"{request.get('namespace') or metadata.get('namespace') or 'default'}/{name}"


class NotSynced(RuntimeError):
    """The caches have not finished their first list; admission cannot judge yet."""


def policy_chains(policy_dir: Path) -> Chains:
    """The merged policy's `migFallback.chains` (the loader validates and reports errors)."""
    from appliance.policy.load import load_policy_dir

    return load_policy_dir(policy_dir).mig_fallback.chains
