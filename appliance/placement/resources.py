"""A pod as the API serves it, read: what the core knows of it (`pod_info`), and how much of an
extended resource it holds.

Pure (no client, no I/O): the MIG webhook, the scheduler extender and its pod cache all count
the same way, the way kube-scheduler does for extended resources: a container's limit (or its
request: for extended resources the two must be equal, and a pod may spell either alone), the
containers summed, and the pod holding the larger of that sum and any one init container's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from appliance.core.annotations import PodInfo
from appliance.policy.quantity import QuantityError, parse_count

log = logging.getLogger(__name__)


def resource_count(value: Any, resource: str = "a resource") -> int:
    """An extended resource's amount as Kubernetes writes it ("1", "2", "5k"). One that is not a
    whole number counts as 0, logged, so a malformed pod is left alone rather than judged on a
    guess."""
    try:
        return parse_count(value)
    except QuantityError as e:
        log.warning("ignoring the amount of %s: %s", resource, e)
        return 0


def _container_amount(container: Mapping[str, Any], resource: str) -> int:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if resource in values:
            return resource_count(values[resource], resource)
    return 0


def pod_request(pod: Mapping[str, Any], resource: str) -> int:
    """How much of `resource` a pod holds: the larger of its containers' sum and any init."""
    spec = pod.get("spec") or {}
    containers = sum(_container_amount(c, resource) for c in spec.get("containers") or [])
    inits = [_container_amount(c, resource) for c in spec.get("initContainers") or []]
    return max([containers, *inits])


def pod_info(obj: Mapping[str, Any]) -> PodInfo:
    """A PodInfo from a pod as the API serves it (JSON, camelCase)."""
    meta = obj.get("metadata") or {}
    return PodInfo(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=str((obj.get("spec") or {}).get("nodeName") or ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        resources=_extended_resources(obj.get("spec") or {}),
    )


def _extended_resources(spec: Mapping[str, Any]) -> frozenset[str]:
    """The extended resources (names with a domain, like nvshare.com/gpu) any container of the
    pod requests or limits."""
    names: set[str] = set()
    for kind in ("containers", "initContainers"):
        for container in spec.get(kind) or []:
            resources = container.get("resources") or {}
            for amounts in (resources.get("limits") or {}, resources.get("requests") or {}):
                names.update(str(name) for name in amounts if "/" in str(name))
    return frozenset(names)
