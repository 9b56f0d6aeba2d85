"""The status document built in slices (`Answers.status_document`) is the document built in
one piece: the client rows and the pods, encoded a slice at a time, spliced where they go."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.core import events as ev
from appliance.core import views
from appliance.core.annotations import PodInfo
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.daemon.queries import Answers
from appliance.policy.model import Policy
from appliance.policy.watch import PolicyWatcher

GPU = "GPU-00000000-0000-0000-0000-0000000000d1"


def test_the_sliced_document_is_the_whole_one_with_pods_and_rows(tmp_path: Path) -> None:
    core = NodeCore(Policy(), inventory={GPU: GpuFacts(uuid=GPU, memory_total=80 << 30)})
    for uid in ("pod-a", "pod-b"):  # pods the pod watch lists (a cgroup alone names none)
        core.handle(ev.PodSeen(PodInfo(uid, "ns", uid, "node")), 5.0)
    for cid, pod in enumerate(["pod-a", "pod-a", "pod-b", None], start=1):
        ident = ClientIdentity(pid=7000 + cid, uid=1000, gid=1000, pod_uid=pod)
        core.handle(ev.ClientRegistered(cid, 1, ident, GPU, 80 << 30), 5.0)
        core.handle(ev.LockRequested(cid, 2), 5.0)
    (tmp_path / "policy").mkdir()
    watcher = PolicyWatcher(tmp_path / "policy", on_policy=print, on_error=print)
    answers = Answers(
        core, clock=lambda: 6.0, watcher=watcher, policy_dir=tmp_path, nvml_available=False
    )
    steps = list(answers.status_document(slice_s=0.0))  # a row, a pod at a time
    assert steps.count(None) == 4 + 2 + 2  # four rows, two pods, then the rest in two steps
    whole = json.dumps(views.to_json(answers.status()), sort_keys=True).encode("utf-8")
    assert steps[-1] == whole
    doc = json.loads(steps[-1])
    assert [p["clients"] for p in doc["pods"]] == [[1, 2], [3]]
    assert len(doc["clients"]) == 4
