"""Who may change the node's state: host processes run by root, the admin group or the
daemon's own user, nobody else.

Authority comes from the node, never from a pod: a process whose cgroup names a pod is a
tenant whatever its uid (most CUDA images run as root), so it may read status but never set a
quantum, a mode or anyone's limits. The one pod that counts as the host is the daemon's own
(an operator's `kubectl exec` into it already has the node). A process whose cgroup could not
be read is not known to be on the host, so it is refused too. The control socket is never
mounted into pods, so this is the second wall, not the only one.

A daemon a user started for themselves (a workstation without root) answers to that user: the
same uid could kill it and start another with any settings, so refusing them guards nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core import events as ev
from appliance.core.identity import ClientIdentity

# What each state change is called in a refusal ("... may not <what>; nothing changed").
STATE_CHANGES: dict[type, str] = {
    ev.TimeQuantumSet: "set the time quantum",
    ev.ModeSet: "change the scheduling mode",
    ev.AdminLimitSet: "change limits",
}


@dataclass(frozen=True, slots=True)
class Authority:
    admin_group: str | None = None  # --admin-group: its members may change state like root
    own_pod_uid: str | None = None  # the daemon's own pod, from its own cgroup
    daemon_uid: int = 0  # the user the daemon runs as: its host processes may steer it

    def refusal(self, ident: ClientIdentity | None, what: str) -> str | None:
        """Why `ident` may not do `what`, or None when it may."""
        if ident is None:
            return f"only a host process may {what}; nothing changed"
        if not ident.cgroup_known:
            return (
                f"pid {ident.pid}'s cgroup could not be read, so it is not known to run on the "
                f"host; only host processes may {what}; nothing changed"
            )
        if ident.pod_uid and ident.pod_uid != self.own_pod_uid:
            return (
                f"pid {ident.pid} runs in pod {ident.pod_uid}: a process in a pod is a tenant "
                f"whatever its uid and may not {what}; nothing changed"
            )
        if ident.uid in (0, self.daemon_uid):
            return None
        if self.admin_group and self.admin_group in ident.groups:
            return None
        allowed = ["root"]
        if self.daemon_uid != 0:
            allowed.append(f"the daemon's own user (uid {self.daemon_uid})")
        if self.admin_group:
            allowed.append(f"members of group {self.admin_group!r}")
        who = allowed[-1] if len(allowed) == 1 else ", ".join(allowed[:-1]) + " or " + allowed[-1]
        return f"only {who} may {what}; nothing changed"
