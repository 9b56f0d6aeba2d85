"""nvsharectl's questions, answered on the event loop: status, policy show, explain, limit list.

The answers are the core's typed views (`appliance.core.views`), with what only the daemon
knows added to status: how the policy directory's hot reload is doing and whether NVML is
there. The metrics collector reads the same status, so `nvsharectl status` and /metrics never
disagree. Everything here runs on the loop (the socket server calls it there; other threads go
through `Engine.read` and `Engine.read_steps`), so the core is never read halfway through a
change; status is built a slice at a time, so no grant waits long behind it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from appliance.core import views
from appliance.core.node import NodeCore
from appliance.policy.model import Policy
from appliance.policy.watch import PolicyWatcher

Query = Callable[[Mapping[str, Any]], Any]  # a request's JSON -> a view; raises QueryError
STATUS_SLICE_S = 0.001  # status work done before the loop handles other events again
_ROWS = "\x00client rows\x00"  # where the rows go in the document
_PODS = "\x00pods\x00"  # and the pods


class Answers:
    def __init__(
        self,
        core: NodeCore,
        *,
        clock: Callable[[], float],
        watcher: PolicyWatcher,
        policy_dir: Path,
        nvml_available: bool,
        backstop: Callable[[], tuple[views.BackstopView, ...]] = tuple,
        backstop_for: Callable[[str, int], str] = lambda gpu, pid: "",
    ) -> None:
        self._core = core
        self._clock = clock
        self._watcher = watcher
        self._policy_dir = str(policy_dir)
        self._nvml = nvml_available
        self._backstop = backstop
        self._backstop_for = backstop_for
        self.queries: dict[str, Query] = {
            "policy": lambda request: self.policy(),
            "explain": lambda request: self.explain(views.ExplainQuery.from_request(request)),
            "overrides": lambda request: core.overrides(),
        }

    def status(self) -> views.StatusView:
        node = self._core.status(self._clock())
        return dataclasses.replace(
            node, policy=self.policy_status(), nvml=self._nvml, backstop=self._backstop()
        )

    def explain(self, query: views.ExplainQuery) -> views.ExplainView:
        """The core's answer, with the kernel-enforced limit on each client's cgroup."""
        rows = self._core.explain(query).clients
        return views.ExplainView(
            tuple(
                dataclasses.replace(row, backstop=self._backstop_for(row.gpu, row.pid))
                for row in rows
            )
        )

    def status_slices(self, slice_s: float = STATUS_SLICE_S) -> Iterator[views.StatusView | None]:
        """`status` built a slice of time at a time, as `status_document` builds its rows:
        None after each slice, then the view. What a metrics scrape reads (`Engine.read_steps`):
        the loop never spends more than a slice on it in one go, and the exposition (every
        series formatted) happens on the scraper's thread, off the loop."""
        now, clients = self._clock(), []
        started = time.perf_counter()
        for row in self._core.client_rows(now):
            clients.append(row)
            if time.perf_counter() - started >= slice_s:
                yield None
                started = time.perf_counter()
        node = self._core.status(now, tuple(clients))
        yield None
        yield dataclasses.replace(
            node, policy=self.policy_status(), nvml=self._nvml, backstop=self._backstop()
        )

    def status_document(self, slice_s: float = STATUS_SLICE_S) -> Iterator[bytes | None]:
        """`status` as the JSON nvsharectl gets, built a slice of time at a time: None after
        each slice (the loop handles other events, then comes back), then the document. With
        thousands of clients the whole takes tens of milliseconds, none of it in one piece:
        the client rows and the pods (one per client, on a busy node) are encoded in slices
        and spliced into the rest."""
        now, clients, rows, piece = self._clock(), [], [], []
        started = time.perf_counter()
        for row in self._core.client_rows(now):
            clients.append(row)
            piece.append(json.dumps(views.to_json(row), sort_keys=True))
            if time.perf_counter() - started >= slice_s:
                rows.append(", ".join(piece).encode("utf-8"))  # (a slice's rows, joined)
                piece = []
                yield None
                started = time.perf_counter()
        rows += [", ".join(piece).encode("utf-8")] if piece else []
        node = self._core.status(now, tuple(clients))  # the GPUs' queues, the pods
        yield None
        pods: list[str] = []
        started = time.perf_counter()
        for pod in node.pods:
            pods.append(json.dumps(views.to_json(pod), sort_keys=True))
            if time.perf_counter() - started >= slice_s:
                yield None
                started = time.perf_counter()
        rest = dataclasses.replace(
            node, clients=(), pods=(), policy=self.policy_status(), nvml=self._nvml
        )
        doc = views.to_json(rest)
        doc["clients"], doc["pods"] = _ROWS, _PODS
        text = json.dumps(doc, sort_keys=True).replace(json.dumps(_PODS), _listed(pods), 1)
        head, tail = text.split(json.dumps(_ROWS), 1)
        yield None
        # (the megabytes of rows are copied once here: each slice was joined and encoded)
        parts = [head.encode("utf-8"), b"["]
        for i, piece_of_rows in enumerate(rows):
            parts += [b", ", piece_of_rows] if i else [piece_of_rows]
        yield b"".join([*parts, b"]", tail.encode("utf-8")])

    def policy_status(self) -> views.PolicyStatus:
        w = self._watcher
        good = w.last_good
        sources = good.sources if good is not None else {}
        return views.PolicyStatus(
            dir=self._policy_dir,
            hash=good.content_hash if good else "",
            files=good.files if good else (),
            valid=not w.last_errors,
            watching=w.alive,
            last_error="; ".join(str(e) for e in w.last_errors) or None,
            last_reload_time=w.last_reload_time,
            reload_counts=dict(w.reload_counts),
            env_overrides={
                source.removeprefix("env "): path
                for path, source in sources.items()
                if source.startswith("env ")
            },
        )

    def policy(self) -> views.PolicyView:
        return views.policy_view(self._watcher.last_good or Policy(), self._policy_dir)


def _listed(encoded: list[str]) -> str:
    """A JSON list of items already encoded, as `json.dumps` writes one."""
    return "[" + ", ".join(encoded) + "]"
