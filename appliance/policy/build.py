"""The typed `Policy` from a valid merged document: one builder per policy section.

Quantities are parsed here, once ("4Gi" becomes bytes, "30s" seconds); everything downstream
reads the frozen model and never sees a string such as "4Gi".
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from appliance.policy import model
from appliance.policy.files import PolicySnapshot
from appliance.policy.merge import Merge
from appliance.policy.quantity import parse_seconds, parse_size


def _opt_bytes(value: Any) -> int | None:
    return None if value is None else parse_size(value)


def _opt_mode(value: Any) -> model.Mode | None:
    return None if value is None else model.Mode(value)


def to_policy(doc: dict[str, Any], merge: Merge, snapshot: PolicySnapshot) -> model.Policy:
    return model.Policy(
        version=doc["version"],
        scheduler=_scheduler(doc["scheduler"]),
        memory=_memory(doc["memory"]),
        realtime_check=_realtime_check(doc["realtimeCheck"], merge.sources),
        unhooked_processes=model.UnhookedProcesses(
            grace_s=parse_seconds(doc["unhookedProcesses"]["grace"])
        ),
        defaults=_limits(doc["defaults"]),
        rules=tuple(
            _rule(rule, merge.locate(f"/rules/{i}")) for i, rule in enumerate(doc["rules"])
        ),
        gpus=tuple(_gpu(gpu, merge.locate(f"/gpus/{i}")) for i, gpu in enumerate(doc["gpus"])),
        annotations=_annotations(doc["annotations"]),
        device_plugin=model.DevicePluginSettings(
            replicas_per_gpu=doc["devicePlugin"]["replicasPerGpu"],
            resource_name=doc["devicePlugin"]["resourceName"],
        ),
        mig_fallback=model.MigFallback(
            chains=tuple(tuple(chain) for chain in doc["migFallback"]["chains"]),
            annotation=doc["migFallback"]["annotation"],
        ),
        metrics=model.MetricsSettings(
            enabled=doc["metrics"]["enabled"], address=doc["metrics"]["address"]
        ),
        trust=model.TrustSettings(
            pod_claim_uids=frozenset(doc["trust"]["podClaimUids"]),
            hook_gpu_size=doc["trust"]["hookGpuSize"],
        ),
        connections=model.ConnectionSettings(
            per_uid=doc["connections"]["perUid"],
            per_pod=doc["connections"]["perPod"],
            new_per_second=doc["connections"]["newPerSecond"],
        ),
        sources=dict(merge.sources),
        overridden={path: tuple(files) for path, files in merge.overridden.items()},
        document=copy.deepcopy(doc),
        files=tuple(f.name for f in snapshot.files),
        content_hash=snapshot.content_hash,
    )


def _scheduler(sch: dict[str, Any]) -> model.SchedulerSettings:
    return model.SchedulerSettings(
        mode=model.Mode(sch["mode"]),
        time_quantum_s=parse_seconds(sch["timeQuantum"]),
        compute_window_s=parse_seconds(sch["computeWindow"]),
        request_window_s=parse_seconds(sch["requestWindow"]),
        quota_sample_interval_s=parse_seconds(sch["quotaSampleInterval"]),
        carry_over_percent=sch["carryOverPercent"],
        drop_tail_billing_percent=sch["dropTailBillingPercent"],
        idle_release_s=parse_seconds(sch["idleRelease"]),
        drop_deadline_s=parse_seconds(sch["dropDeadline"]),
        preempt_after_s=parse_seconds(sch["preemptAfter"]),
        starvation_limit_s=parse_seconds(sch["starvationLimit"]),
        idle_handoff_s=parse_seconds(sch["idleHandoff"]),
        reclaim_ahead_s=parse_seconds(sch["reclaimAhead"]),
        borrower_queue_s=parse_seconds(sch["borrowerQueue"]),
    )


def _memory(mem: dict[str, Any]) -> model.MemorySettings:
    return model.MemorySettings(
        backing=model.Backing(mem["backing"]),
        single_process_oversubscription=mem["singleProcessOversubscription"],
        reserve_bytes=parse_size(mem["reserve"]),
        chunk_bytes=parse_size(mem["chunk"]),
        kernel_backstop=mem["kernelBackstop"] == "on",
        backstop_allowance_bytes=parse_size(mem["kernelBackstopAllowance"]),
    )


def _realtime_check(rt: dict[str, Any], sources: Mapping[str, str]) -> model.RealtimeCheck:
    status = rt["nodeStatus"]
    mode_from = sources.get("/realtimeCheck/mode", "default")
    enabled_from = sources.get("/realtimeCheck/enabledByDefault", "default")
    return model.RealtimeCheck(
        mode=model.RealtimeCheckMode(rt["mode"]),
        safety_margin_bytes=parse_size(rt["safetyMargin"]),
        enabled_by_default=rt["enabledByDefault"],
        max_sample_age_s=parse_seconds(rt["maxSampleAge"]),
        node_status=model.NodeStatusSettings(
            publish=status["publish"],
            min_interval_s=parse_seconds(status["minInterval"]),
            refresh_interval_s=parse_seconds(status["refreshInterval"]),
            memory_change_bytes=parse_size(status["memoryChange"]),
        ),
        mode_set=mode_from != "default",
        enabled_set=enabled_from != "default",
    )


def _limits(entry: dict[str, Any]) -> model.Limits:
    """`memoryLimit`, `coreLimit`, `priority` and `coreRequest` of the defaults or a rule."""
    priority = entry.get("priority")
    return model.Limits(
        memory_bytes=_opt_bytes(entry.get("memoryLimit")),
        core_percent=entry.get("coreLimit"),
        priority=None if priority is None else model.priority_value(priority),
        core_request=entry.get("coreRequest"),
    )


def _rule(rule: dict[str, Any], origin: tuple[str, str]) -> model.Rule:
    source = "#".join(origin)  # "10-team.yaml#/rules/0": the file and the place in it
    match = rule.get("match", {})
    return model.Rule(
        name=rule.get("name") or source,
        match=model.RuleMatch(
            namespace=match.get("namespace"),
            pod_name=match.get("podName"),
            pod_labels=dict(match.get("podLabels") or {}),
            uid=match.get("uid"),
            user=match.get("user"),
            group=match.get("group"),
            systemd_unit=match.get("systemdUnit"),
            executable=match.get("executable"),
        ),
        limits=_limits(rule),
        mode=_opt_mode(rule.get("mode")),
        source=source,
    )


def _gpu(gpu: dict[str, Any], origin: tuple[str, str]) -> model.GpuRule:
    match = gpu.get("match", {})
    tq = gpu.get("timeQuantum")
    return model.GpuRule(
        match=model.GpuMatch(
            uuid=match.get("uuid"), index=match.get("index"), model=match.get("model")
        ),
        mode=_opt_mode(gpu.get("mode")),
        time_quantum_s=None if tq is None else parse_seconds(tq),
        memory_bytes=_opt_bytes(gpu.get("memory")),
        source="#".join(origin),
    )


def _annotations(ann: dict[str, Any]) -> model.AnnotationPolicy:
    return model.AnnotationPolicy(
        allowed=ann["allowed"],
        max_memory_bytes=_opt_bytes(ann["maxMemoryLimit"]),
        min_core_percent=ann["coreLimitRange"]["min"],
        max_core_percent=ann["coreLimitRange"]["max"],
        max_core_request=ann["maxCoreRequest"],
        min_priority=model.priority_value(ann["priorityRange"]["min"]),
        max_priority=model.priority_value(ann["priorityRange"]["max"]),
    )
