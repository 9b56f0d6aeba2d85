"""The published limits file: what a hook applies until it registers, kept current by the daemon.

Location: `<socket directory>/limits` (`/var/run/nvshare/limits`), beside `scheduler.sock` in the
one directory pods mount (read-only). The daemon writes it whole, to a new file renamed over
the old, so a reader sees one version or the next, never half. Mode 0644, owned by the daemon's
user, in a directory only that user can write (`socket_claim.ensure_private_directory`): tenants
read it, nobody else writes it. The hook trusts it only when it is a regular file owned by root
or by its own user, writable by no one else (`ld_hook/fallback.c`).

Format (text, one entry per line, so the hook parses it with sscanf and nothing more):

    nvshare-limits 1
    default <bytes>
    pod <pod-uid> <bytes>

`<bytes>` is the memory limit, 0 for none. A hook whose cgroup (or, in a private cgroup
namespace, whose kubelet mounts) names a pod listed here applies that pod's line, any other
hook the default. Lines it does not know are skipped, so later versions can add kinds. The
daemon reads the file back at start: a pod it has not listed yet keeps its last published
limit (`core.published`).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from appliance.core.published import PublishedLimits

log = logging.getLogger("nvshare.daemon")

LIMITS_NAME = "limits"  # in the hooks' socket directory, beside scheduler.sock
HEADER = "nvshare-limits 1"
MAX_BYTES = 4 << 20  # 60,000 pods; a file larger than this was not written by us


def render(limits: PublishedLimits) -> str:
    lines = [
        HEADER,
        "# written by nvshare-scheduler: what a hook applies until it registers (0 = no limit)",
        f"default {limits.default or 0}",
    ]
    lines += [f"pod {uid} {memory or 0}" for uid, memory in sorted(limits.pods.items())]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, int | None]:
    """The pods of a published file (pod UID -> bytes, None = no limit); ValueError if it is
    not one."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != HEADER:
        raise ValueError(f"its first line is not {HEADER!r}")
    pods: dict[str, int | None] = {}
    for line in lines[1:]:
        words = line.split()
        if len(words) == 3 and words[0] == "pod" and words[2].isdigit():
            pods[words[1]] = int(words[2]) or None
    return pods


class LimitsFile:
    """The sink of `LimitsPublished`: keeps `<directory>/limits` current."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LIMITS_NAME

    def write(self, limits: PublishedLimits) -> None:
        temporary = self.path.with_name(f".{LIMITS_NAME}.{os.getpid()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(temporary, flags, 0o644)
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(render(limits))
            os.chmod(temporary, 0o644)
            os.replace(temporary, self.path)
        except OSError as exc:
            log.error(
                "cannot write %s (%s): hooks that cannot register fall back to an older one",
                self.path,
                exc.strerror or exc,
            )

    def read_previous(self) -> Mapping[str, int | None]:
        """What the previous daemon published for each pod; nothing if the file is missing or
        could have been written by anyone else."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            problem = _ownership_problem(info)
            if problem is None:
                try:
                    pods = parse(f.read(MAX_BYTES + 1)[:MAX_BYTES].decode("ascii"))
                except (ValueError, UnicodeDecodeError) as exc:
                    problem = str(exc)
        if problem is not None:
            log.warning("ignoring %s left by an earlier daemon: %s", self.path, problem)
            return {}
        log.info(
            "%s: the last published limits of %d pod(s), until the pod watch lists them",
            self.path,
            len(pods),
        )
        return pods


def _ownership_problem(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}, not to this daemon's user"
    if info.st_mode & 0o022:
        return f"it is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_size > MAX_BYTES:
        return f"{info.st_size} bytes is more than a published file holds"
    return None
