"""GPU processes without the hook: NVML's compute processes against the registered hooks, so a
process that escaped sharing is reported instead of running unshared and unlimited in silence.

The hook can fail to load where nothing else would say so: in an image whose glibc is older
than the hook was built for (the loader prints one line into the container's log and goes on),
in a statically linked or musl (Alpine) program, in a container that lost its /etc/ld.so.preload
mount. Such a process still shows in NVML's list of a GPU's compute processes, by host PID. A
process listed for the policy's `unhookedProcesses.grace` without a hook registered from its
PID is reported once: a warning
in the log, a row in `nvsharectl status`, a count per GPU in /metrics, and, when it belongs to
a pod that asked for the sharing resource, a Warning Event on that pod.

The grace period covers a program between creating its CUDA context and registering, and
hooks reconnecting after a daemon restart (they retry at least every 5 s). PIDs are compared,
not (PID, GPU) pairs: a process that registered through the hook is hooked, whichever GPUs
NVML shows it on.
"""

from __future__ import annotations

import logging

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import PodInfo
from appliance.core.identity import ClientIdentity
from appliance.core.state import NodeState, UnhookedProcess

log = logging.getLogger("nvshare.scheduler")

HOOK_MIN_GLIBC = "2.28"  # what libnvshare.so is built against (deploy/Dockerfile checks it)
WARNING_REASON = "GpuProcessWithoutHook"  # the reason of the Event on the pod
REGISTERED = "registered with the scheduler after all"


class UnhookedWatch:
    """Follows every GPU process that has no hook, and reports it once past the grace period."""

    def __init__(self, state: NodeState) -> None:
        self._s = state

    def seen(self, e: ev.GpuProcessesSeen, now: float) -> list[act.Action]:
        s = self._s
        hooked = {c.ident.pid for c in s.clients.values()}
        listed: dict[int, tuple[ClientIdentity, dict[str, int | None]]] = {}
        for proc in e.processes:
            if proc.gpu_uuid in e.gpus and proc.ident.pid not in hooked:
                ident, memory = listed.setdefault(proc.ident.pid, (proc.ident, {}))
                memory[proc.gpu_uuid] = proc.memory_bytes
        for pid in list(s.unhooked):
            self._follow(pid, listed, e.gpus, hooked)
        for pid, (ident, memory) in listed.items():
            s.unhooked[pid] = UnhookedProcess(ident=ident, first_seen=now, memory=memory)
        out: list[act.Action] = []
        grace = s.policy.unhooked_processes.grace_s
        for known in s.unhooked.values():
            if not known.reported and now - known.first_seen >= grace:
                known.reported = True
                out += self._report(known)
        return out

    def _follow(
        self,
        pid: int,
        listed: dict[int, tuple[ClientIdentity, dict[str, int | None]]],
        gpus: frozenset[str],
        hooked: set[int],
    ) -> None:
        """Bring a followed process up to date with this listing; what remains in `listed`
        afterwards is new."""
        known = self._s.unhooked[pid]
        if pid in hooked:
            self.forget(pid, why=REGISTERED)
            return
        # The GPUs listed now say where it is; the others keep what they last said.
        memory = {gpu: n for gpu, n in known.memory.items() if gpu not in gpus}
        now_listed = listed.get(pid)
        if now_listed is not None and now_listed[0] == known.ident:
            memory.update(listed.pop(pid)[1])
        elif now_listed is not None:  # the PID was reused: another process, followed anew
            memory = {}
        known.memory = memory
        if not memory:
            self.forget(pid, why="is no longer on any GPU")

    def forget(self, pid: int, *, why: str) -> None:
        """Stop following `pid` (it registered, or left every GPU); say so if it was reported."""
        known = self._s.unhooked.pop(pid, None)
        if known is not None and known.reported:
            log.info("GPU process pid %d, reported without the hook, %s", pid, why)

    def _report(self, known: UnhookedProcess) -> list[act.Action]:
        s = self._s
        s.counters["unhooked_processes"] += 1
        ident = known.ident
        pod = s.pods.pods.get(ident.pod_uid) if ident.pod_uid else None
        resource = s.policy.device_plugin.resource_name
        shares = pod is not None and resource in pod.resources
        grace = s.policy.unhooked_processes.grace_s
        log.warning(
            "GPU process pid %d (%s) %s has used GPU %s for %gs without registering with the "
            "scheduler: it runs unshared and outside every limit. %s",
            ident.pid,
            ident.executable or "executable unknown",
            _whose(ident, pod),
            ", ".join(sorted(known.memory)),
            grace,
            _likely_cause(ident, pod, shares=shares, resource=resource),
        )
        if pod is None or not shares:
            return []
        return [act.PodWarning(pod.ref, WARNING_REASON, _pod_message(known, grace))]


def _whose(ident: ClientIdentity, pod: PodInfo | None) -> str:
    if pod is not None:
        return f"of pod {pod.namespace}/{pod.name}"
    if ident.pod_uid:
        return f"of pod UID {ident.pod_uid} (not among this node's pods)"
    return f"of uid {ident.uid}" + (f" in {ident.systemd_unit}" if ident.systemd_unit else "")


def _likely_cause(
    ident: ClientIdentity, pod: PodInfo | None, *, shares: bool, resource: str
) -> str:
    if ident.pod_uid is None:
        return (
            "Start it under the hook (LD_PRELOAD=/path/to/libnvshare.so), or preload the hook "
            "for every program (scripts/install.sh --preload)."
        )
    if pod is not None and not shares:
        return (
            f"The pod did not ask for {resource}: it reaches the GPU another way (another "
            "device plugin, NVIDIA_VISIBLE_DEVICES, a privileged container)."
        )
    return (
        f"The hook did not load in it: most likely its image's glibc is older than "
        f"{HOOK_MIN_GLIBC} (the container log then says the hook 'cannot be preloaded'), or it "
        "is statically linked or built on musl (Alpine)."
    )


def _pod_message(known: UnhookedProcess, grace: float) -> str:
    ident = known.ident
    where = f", container {ident.container_id[:12]}" if ident.container_id else ""
    return (
        f"A process of this pod ({ident.executable or 'executable unknown'}{where}) has used "
        f"GPU {', '.join(sorted(known.memory))} for {grace:g}s without the nvshare hook, so "
        "it runs unshared and outside this pod's GPU limits. The hook could not load: most "
        f"likely the image's glibc is older than {HOOK_MIN_GLIBC} (the container log then says "
        "'ld.so: object ... cannot be preloaded'), or the program is statically linked or "
        f"built on musl (Alpine). Use an image with glibc {HOOK_MIN_GLIBC} or newer (Debian "
        "10+, Ubuntu 20.04+, UBI 8+; not Ubuntu 18.04 or CentOS 7) and a dynamically linked "
        "program."
    )
