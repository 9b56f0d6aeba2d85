"""What Kubernetes accepts as a namespace and a pod name (DNS-1123), checked where a name is
typed: an override for a pod that cannot exist would otherwise wait for it forever."""

from __future__ import annotations

import re

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
NAMESPACE_MAX = 63  # a DNS-1123 label
POD_NAME_MAX = 253  # a DNS-1123 subdomain


def pod_name_problem(namespace: str, name: str) -> str | None:
    """Why NAMESPACE/NAME cannot name a pod, or None."""
    for what, text, most, kind in (
        ("namespace", namespace, NAMESPACE_MAX, "label"),
        ("pod name", name, POD_NAME_MAX, "subdomain"),
    ):
        if len(text) > most:
            return (
                f"a {what} of {len(text)} characters ({text[:20]!r}...) is longer than "
                f"Kubernetes allows: at most {most} (a DNS-1123 {kind})"
            )
    if not _DNS_LABEL.fullmatch(namespace):
        return (
            f"namespace {namespace!r} is not a Kubernetes namespace: at most "
            f"{NAMESPACE_MAX} lowercase letters, digits and '-', starting and ending with a "
            "letter or digit (a DNS-1123 label)"
        )
    if not _DNS_SUBDOMAIN.fullmatch(name):
        return (
            f"pod name {name!r} is not a Kubernetes pod name: at most {POD_NAME_MAX} "
            "lowercase letters, digits, '-' and '.', each part between dots starting and "
            "ending with a letter or digit (a DNS-1123 subdomain)"
        )
    return None
