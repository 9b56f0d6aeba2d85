"""nvsharectl's commands as the core decides them: bounds, targets, reply texts, who is logged.

Every request gets one `Reply` saying what changed or why nothing did. The time quantum and
the modes set here win over the policy until a policy reload changes that same value (the
newest writer wins; the log and status say what it replaced); a pid's limit override lives as
long as that process is connected, a pod's waits for the pod. State changes push new limits to
the hooks they concern through `refresh`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.actions import Outcome
from appliance.core.events import LimitTarget
from appliance.core.limits import gpu_settings
from appliance.core.names import pod_name_problem
from appliance.core.state import Client, DroppedOverride, NodeState
from appliance.policy.model import MAX_DURATION_S, MIN_TIME_QUANTUM_S, Limits, Mode, Policy
from appliance.policy.quantity import MAX_SIZE_BYTES, format_bytes

log = logging.getLogger("nvshare.scheduler")

MAX_TIME_QUANTUM_S = MAX_DURATION_S
MESSAGE_MAX = 240  # what a reply frame carries, with room to spare
Refresh = Callable[[float], list[act.Action]]


@dataclass(frozen=True, slots=True)
class _Problem:
    """Why a request names nothing to act on: the reply's text."""

    message: str


class Admin:
    def __init__(self, state: NodeState, *, refresh: Refresh) -> None:
        self._s = state
        self._refresh = refresh  # push changed limits to the hooks: what to send them

    # ------------------------------------------------------------ time quantum

    def set_time_quantum(self, e: ev.TimeQuantumSet, now: float) -> list[act.Action]:
        overrides = self._s.overrides
        policy_tq = self._s.policy.scheduler.time_quantum_s

        def reply(outcome: Outcome, message: str) -> act.Reply:
            return act.Reply(e.reply_to, outcome, message)

        if e.seconds is None:
            if overrides.time_quantum_s is None:
                return [reply(Outcome.DONE, "the time quantum already follows the policy")]
            log.info(
                "%s handed the time quantum back to the policy (%g s -> %g s)",
                e.by,
                overrides.time_quantum_s,
                policy_tq,
            )
            overrides.time_quantum_s = None
            message = f"the time quantum follows the policy again ({policy_tq:g} s)"
            return [reply(Outcome.DONE, message), *self._refresh(now)]
        if not MIN_TIME_QUANTUM_S <= e.seconds <= MAX_TIME_QUANTUM_S:
            message = (
                f"a time quantum of {e.seconds:g} s is outside {MIN_TIME_QUANTUM_S:g}-"
                f"{MAX_TIME_QUANTUM_S:g} s; nothing changed"
            )
            return [reply(Outcome.INVALID, message)]
        before = overrides.time_quantum_s
        overrides.time_quantum_s = e.seconds
        was = f"{before:g} s from nvsharectl" if before else f"{policy_tq:g} s from the policy"
        log.info("%s set the time quantum to %g s (was %s)", e.by, e.seconds, was)
        message = f"time quantum set to {e.seconds:g} s on every GPU (was {was})"
        return [reply(Outcome.DONE, message), *self._refresh(now)]

    # ------------------------------------------------------------ modes

    def set_mode(self, e: ev.ModeSet, now: float) -> list[act.Action]:
        modes = self._s.overrides.modes

        def reply(outcome: Outcome, message: str) -> act.Reply:
            return act.Reply(e.reply_to, outcome, message)

        uuid = ""
        if e.gpu_uuid:
            found = self._find_gpu(e.gpu_uuid)
            if isinstance(found, _Problem):
                return [reply(Outcome.NOT_FOUND, found.message[:MESSAGE_MAX])]
            uuid = found
        where = self._gpu_name(uuid) if uuid else "every GPU"
        if e.mode is None:
            keys = [uuid] if uuid else list(modes)
            if not any(k in modes for k in keys):
                return [reply(Outcome.DONE, f"the mode on {where} already follows the policy")]
            for key in keys:
                modes.pop(key, None)
            log.info("%s handed the mode on %s back to the policy", e.by, where)
            message = f"the mode on {where} follows the policy again"
            return [reply(Outcome.DONE, message), *self._refresh(now)]
        was = self._modes_now(uuid)
        if not uuid:
            modes.clear()
        modes[uuid] = e.mode
        log.info("%s set mode %s on %s (was %s)", e.by, e.mode.value, where, was)
        message = f"mode set to {e.mode.value} for {where} (was {was})"
        return [reply(Outcome.DONE, message[:MESSAGE_MAX]), *self._refresh(now)]

    def _known_gpus(self) -> list[str]:
        return sorted(set(self._s.gpus) | set(self._s.inventory))

    def _gpu_name(self, uuid: str) -> str:
        index = self._s.facts(uuid).index
        return uuid if index is None else f"GPU {index} ({uuid})"

    def _find_gpu(self, given: str) -> str | _Problem:
        """The GPU `given` names: its UUID, a prefix of it found nowhere else (with or without
        `GPU-`), or its index as NVML (and nvidia-smi) numbers it."""
        known = self._known_gpus()
        if given in known:
            return given
        if given.isdigit():
            found = [u for u in known if self._s.facts(u).index == int(given)]
        else:
            prefix = given.lower()
            found = [
                u
                for u in known
                if u.lower().startswith(prefix) or u.lower().partition("-")[2].startswith(prefix)
            ]
        if len(found) == 1:
            return found[0]
        if found:
            verdict = f"{given!r} names {len(found)} GPUs: give more of the UUID; nothing changed"
        else:
            verdict = f"no GPU {given} is known here; nothing changed"
        message = f"{verdict} (known: {', '.join(map(self._gpu_name, known)) or 'none yet'})"
        if len(message) > MESSAGE_MAX:  # a GPU's index and the start of its UUID, then
            message = f"{verdict} (known: {', '.join(map(self._gpu_short, known))})"
        return _Problem(message)

    def _gpu_short(self, uuid: str) -> str:
        index = self._s.facts(uuid).index
        return uuid[:12] if index is None else f"GPU {index} ({uuid[:12]})"

    def _modes_now(self, uuid: str) -> str:
        """ "on from the policy": the mode of that GPU, or of every GPU, and what set it."""
        modes, s = self._s.overrides.modes, self._s
        if not uuid and not s.gpus and not s.inventory:
            if "" in modes:
                return f"{modes[''].value} from nvsharectl"
            return f"{s.policy.scheduler.mode.value} from the policy"
        shown: dict[str, list[str]] = {}
        for gpu in [uuid] if uuid else self._known_gpus():
            source = "nvsharectl" if (gpu in modes or "" in modes) else "the policy"
            index = s.facts(gpu).index
            shown.setdefault(f"{s.gpu_mode(gpu).value} from {source}", []).append(
                gpu if index is None else f"GPU {index}"
            )
        if len(shown) == 1:
            return next(iter(shown))
        return "; ".join(f"{what} on {', '.join(gpus)}" for what, gpus in shown.items())

    # ------------------------------------------------------------ policy reloads

    def policy_changed(self, old: Policy, new: Policy, now: float) -> None:
        """A reload keeps what nvsharectl set unless it changes the very value that was set:
        the time quantum the policy gives (any GPU) for `-T`; the mode the policy gives that
        GPU (any GPU, for a mode set on every GPU) for a mode. A reload that only touches
        other settings (scheduler.idleRelease, limits, rules) keeps them. Where the policy's
        own value changed, the newest writer wins: the override goes, and the log and
        `status` say which one, when and why."""
        overrides = self._s.overrides
        gpus = sorted(set(self._known_gpus()) | {u for u in overrides.modes if u})
        before, after = self._settings(old, gpus), self._settings(new, gpus)
        mode_changes = {u: (before[u][0].value, after[u][0].value) for u in before}
        tq_changes = {u: (f"{before[u][1]:g}s", f"{after[u][1]:g}s") for u in before}
        mode_changes = {u: c for u, c in mode_changes.items() if c[0] != c[1]}
        tq_changes = {u: c for u, c in tq_changes.items() if c[0] != c[1]}
        dropped = []
        if overrides.time_quantum_s is not None and tq_changes:
            what = f"time quantum {overrides.time_quantum_s:g} s on every GPU"
            dropped.append((what, "time quantum", tq_changes, "scheduler.timeQuantum"))
            overrides.time_quantum_s = None
        for uuid, mode in sorted(overrides.modes.items()):
            relevant = {u: c for u, c in mode_changes.items() if not uuid or u == uuid}
            if relevant:
                where = self._gpu_name(uuid) if uuid else "every GPU"
                dropped.append(
                    (f"mode {mode.value} on {where}", "mode", relevant, "scheduler.mode")
                )
                del overrides.modes[uuid]
        for what, setting, changes, default in dropped:
            change = self._changes(changes, default)
            why = f"a policy reload changed the policy's {setting} ({change})"
            log.info("%s, so it replaces what nvsharectl set: %s", why, what)
            overrides.dropped.append(DroppedOverride(what=what, why=why, time=now))

    def _settings(self, policy: Policy, gpus: list[str]) -> dict[str, tuple[Mode, float]]:
        """The mode and time quantum a policy gives by default ("") and to each GPU."""
        settings = {"": (policy.scheduler.mode, policy.scheduler.time_quantum_s)}
        for uuid in gpus:
            given = gpu_settings(policy, self._s.facts(uuid))
            settings[uuid] = (given.mode, given.time_quantum_s)
        return settings

    def _changes(self, changes: dict[str, tuple[str, str]], default: str) -> str:
        """ "scheduler.mode on -> auto", or per GPU where only the `gpus` rules changed."""
        if "" in changes:
            return f"{default} {changes[''][0]} -> {changes[''][1]}"
        shown = [f"{self._gpu_name(u)} {a} -> {b}" for u, (a, b) in sorted(changes.items())]
        return ", ".join(shown[:2]) + (f", {len(shown) - 2} more" if len(shown) > 2 else "")

    # ------------------------------------------------------------ limits

    def set_limits(self, e: ev.AdminLimitSet, now: float) -> list[act.Action]:
        def reply(outcome: Outcome, message: str) -> act.Reply:
            return act.Reply(e.reply_to, outcome, message)

        if e.target is None:
            missing = "name a --pid, or a --pod as NAMESPACE/NAME; nothing changed"
            return [reply(Outcome.INVALID, missing)]
        matched = self._s.reached(e.target)
        if (refused := self._refusal(e, e.target, matched)) is not None:
            return [reply(*refused)]
        stored = self._s.overrides.limits
        current = stored.get(e.target, Limits())
        memory = None if e.clear_memory else (e.limits.memory_bytes or current.memory_bytes)
        core = None if e.clear_core else (e.limits.core_percent or current.core_percent)
        after = Limits(memory_bytes=memory, core_percent=core)
        if after == current:
            if e.clear_memory or e.clear_core:
                what = " or ".join(
                    w for w, asked in (("memory", e.clear_memory), ("core", e.clear_core)) if asked
                )
                message = (
                    f"nothing was set for {e.target}: it has no {what} override to clear; "
                    "nothing changed"
                )
                return [reply(Outcome.NOT_FOUND, message)]
            memory_shown, core_shown = _shown(after)
            message = f"{e.target} already has memory {memory_shown}, core {core_shown}; no change"
            return [reply(Outcome.DONE, message)]
        if after == Limits():
            stored.pop(e.target, None)
        else:
            stored[e.target] = after
        change = _describe_change(current, after)
        log.info("%s changed the limits of %s: %s", e.by, e.target, change)
        pushed = self._refresh(now)  # first: the note below reads the limits now in force
        reach = _reach(matched, watching_pods=self._s.watching_pods)
        message = f"{e.target}: {change}; {reach}{_env_note(matched)}"
        return [reply(Outcome.DONE, message), *pushed]

    def _refusal(
        self, e: ev.AdminLimitSet, target: LimitTarget, matched: list[Client]
    ) -> tuple[Outcome, str] | None:
        """Why an override for `target` cannot be kept, or None."""
        if (problem := _limit_problem(e.limits)) is not None:
            return Outcome.INVALID, f"{problem}; nothing changed"
        if target.kind == "pod":
            namespace, _, name = target.name.partition("/")
            if (problem := pod_name_problem(namespace, name)) is not None:
                return Outcome.INVALID, f"{problem[:200]}; nothing changed"
        if target.kind == "pid" and not matched:
            message = (
                f"no connected client has pid {target.name}; nothing changed (a pid override "
                "is kept only while that process is connected)"
            )
            return Outcome.NOT_FOUND, message
        clearing = e.clear_memory or e.clear_core
        if target.kind == "pod" and not matched and not clearing and not self._s.pods_nameable():
            message = (
                f"no process can be of pod {target.name}: this daemon watches no pods (no "
                "--node-name) and its policy trusts no uid's pod claims (trust.podClaimUids); "
                "nothing changed"
            )
            return Outcome.NOT_FOUND, message
        return None

    def client_gone(self, pid: int) -> None:
        """A pid override dies with its process: a later process reusing the pid starts clean."""
        key = LimitTarget.pid(pid)
        stored = self._s.overrides.limits
        if key not in stored or any(c.ident.pid == pid for c in self._s.clients.values()):
            return
        dropped = stored.pop(key)
        log.info(
            "dropped the nvsharectl override of pid %d (%s): the process disconnected",
            pid,
            _describe_change(dropped, Limits()),
        )


def _limit_problem(limits: Limits) -> str | None:
    """What makes a requested override unusable, if anything."""
    if limits.memory_bytes is not None and not 0 < limits.memory_bytes <= MAX_SIZE_BYTES:
        return "a memory limit must be greater than 0 and at most 1Ei (`limit clear` removes one)"
    if limits.core_percent is not None and not 1 <= limits.core_percent <= 100:
        return f"core limit {limits.core_percent} is outside 1-100"
    return None


def _shown(limits: Limits) -> tuple[str, str]:
    memory = "none" if limits.memory_bytes is None else format_bytes(limits.memory_bytes)
    core = "none" if limits.core_percent is None else f"{limits.core_percent}%"
    return memory, core


def _describe_change(before: Limits, after: Limits) -> str:
    """ "memory 4Gi (was none)", only for what changed."""
    parts = []
    for what, old, new in zip(("memory", "core"), _shown(before), _shown(after), strict=True):
        if old != new:
            parts.append(f"{what} override {new} (was {old})")
    return ", ".join(parts)


def _reach(matched: list[Client], *, watching_pods: bool) -> str:
    if matched:
        pids = sorted({c.ident.pid for c in matched})
        return f"applies to {len(matched)} connected client(s), pid {', '.join(map(str, pids))}"
    if not watching_pods:
        return (
            "no process claims that pod yet; the override waits for one (without a pod watch, "
            "a process of a uid in trust.podClaimUids that names the pod through "
            "NVSHARE_POD_NAMESPACE/NVSHARE_POD_NAME is of it, and shares its ledger)"
        )
    return "no client of that pod is connected yet; the override waits for it"


def _env_note(matched: list[Client]) -> str:
    """Say when a process's own, lower environment limit still wins over the override."""
    notes = []
    for c in matched:
        if c.limits.sources.memory.startswith("env "):
            own = f"NVSHARE_GPU_MEMORY_LIMIT={format_bytes(c.env_memory)}"
            notes.append(f"pid {c.ident.pid}'s own {own} is lower and still applies")
        if c.limits.sources.core.startswith("env "):
            own = f"NVSHARE_GPU_CORE_LIMIT={c.env_core}%"
            notes.append(f"pid {c.ident.pid}'s own {own} is lower and still applies")
    return "; " + "; ".join(dict.fromkeys(notes)) if notes else ""
