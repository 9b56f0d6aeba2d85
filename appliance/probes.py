"""Kubelet's two questions, answered so that they mean something.

`/healthz` (liveness: should kubelet restart this?) and `/readyz` (readiness: is it doing its
job yet?) both answer 200 "ok", or 503 with one line per reason, so `kubectl describe pod`
and a curl show why. Each program gives its reasons; the node daemon's are asked of its event
loop itself (`LoopProbes`): a loop wedged by a blocking call does not answer within
`LOOP_ANSWER_S`, /healthz fails, and kubelet restarts the daemon. A probe answered from a thread
of its own would say "ok" while no hook is served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reasons = Callable[[], list[str]]  # why not, one line each; empty when all is well

LOOP_ANSWER_S = 3.0  # well inside the probes' timeoutSeconds (5) in deploy/


def http_answer(reasons: list[str]) -> tuple[int, bytes]:
    if not reasons:
        return 200, b"ok\n"
    return 503, "".join(f"{reason}\n" for reason in reasons).encode()


class LoopProbes:
    """Probes whose reasons are gathered on the event loop (`read`: `Engine.read`)."""

    def __init__(
        self,
        read: Callable[..., Any],
        *,
        not_ready: Reasons,
        unhealthy: Reasons = lambda: [],
    ) -> None:
        self._read = read
        self._not_ready = not_ready
        self._unhealthy = unhealthy

    def health(self) -> list[str]:
        return self._on_loop(self._unhealthy)

    def readiness(self) -> list[str]:
        return self._on_loop(self._not_ready)

    def _on_loop(self, reasons: Reasons) -> list[str]:
        try:
            return list(self._read(reasons, timeout_s=LOOP_ANSWER_S))
        except Exception:  # a timeout, or a loop that is gone
            return [f"the event loop did not answer within {LOOP_ANSWER_S:g}s"]
