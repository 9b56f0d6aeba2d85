"""One daemon per socket directory, in directories that are ours: claim the hook socket and the
control socket, and give each back only if it is still ours.

A second daemon started on the same directory used to delete the first one's live socket and
listen in its place (the first kept running, unreachable by every hook and by nvsharectl),
then delete the path again on exit. And a directory someone else made (the README once
suggested `/tmp/nvshare`) let them swap in a socket of their own: a root program then took its
limits, and its lock, from an impostor. Now, at start:

- each directory (the hooks' socket directory, the control directory) is created by the daemon
  (mode 0755), or, if it exists, must belong to the daemon's user and be writable by nobody
  else, in a path no other user can rename (`ensure_private_directory`); else a clear refusal;
- a lock file in the control directory (`scheduler.lock`, flock) settles daemons that start at
  the same moment, and holds the PID of the daemon that has it;
- a socket that answers belongs to a live daemon, even a hung one (the kernel queues the
  connection): refused, naming that daemon's PID from SO_PEERCRED;
- a socket nobody answers on was left by a daemon that died: replaced;
- anything else at a socket's path (a file, a directory) is refused, never deleted.

On exit each path is removed only if it is still the socket this daemon bound (same inode).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from appliance.host.backlog import listen_backlog
from appliance.host.peer import peer_credentials
from appliance.wire.socket_dirs import CONTROL_SOCKET_NAME, SOCKET_NAME

LOCK_NAME = "scheduler.lock"


class SocketUnavailable(Exception):
    """The socket cannot be served by this daemon; the message says why and what to do."""


@dataclass(slots=True)
class BoundSocket:
    path: Path
    sock: socket.socket
    inode: tuple[int, int]

    def release(self) -> None:
        """Remove the socket file if it is still the one we bound."""
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self.inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


@dataclass(slots=True)
class SocketClaim:
    """The bound, listening sockets (hooks', nvsharectl's) and the lock that makes them ours."""

    hook: BoundSocket
    control: BoundSocket
    _lock_fd: int

    def release(self) -> None:
        self.hook.release()
        self.control.release()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def claim_sockets(socket_dir: Path, control_dir: Path) -> SocketClaim:
    """Bind and listen on the hook socket and the control socket, or raise `SocketUnavailable`."""
    ensure_private_directory(socket_dir)
    ensure_private_directory(control_dir)
    lock_fd = _take_lock(control_dir, socket_dir)
    bound: list[BoundSocket] = []
    try:
        for path in (socket_dir / SOCKET_NAME, control_dir / CONTROL_SOCKET_NAME):
            _clear_stale(path)
            bound.append(_listen(path))
    except BaseException:
        for b in bound:
            b.sock.close()
            b.release()
        os.close(lock_fd)
        raise
    return SocketClaim(bound[0], bound[1], lock_fd)


def _listen(path: Path) -> BoundSocket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o666)  # any local user may connect; identity comes from the kernel
        sock.listen(listen_backlog())
        info = os.lstat(path)
    except OSError as e:
        sock.close()
        raise SocketUnavailable(_os_problem(f"cannot listen on {path}", e)) from None
    return BoundSocket(path, sock, (info.st_dev, info.st_ino))


def ensure_private_directory(directory: Path) -> None:
    """Create `directory` (0755), or accept it only if it is ours and no one else can change
    it or what leads to it; else `SocketUnavailable` saying what is wrong.

    Only the last component is made: a mistyped path (`/var/rnu/nvshare`) would otherwise
    become a tree that no hook looks in, and the daemon would serve there unheard."""
    try:
        directory.mkdir(mode=0o755)
        directory.chmod(0o755)  # whatever the umask: other users' hooks must reach the socket
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise SocketUnavailable(
            f"cannot create {directory}: its parent {directory.parent} does not exist (only the "
            "last component is made, so a mistyped path is not served where no program looks); "
            "create the parent, or point NVSHARE_SOCKET_DIR (--socket-dir) and the programs' "
            "NVSHARE_SOCKET_DIR at an existing place"
        ) from None
    except OSError as e:
        raise SocketUnavailable(_os_problem(f"cannot create {directory}", e)) from None
    real = Path(os.path.realpath(directory))
    if not real.is_dir():
        raise SocketUnavailable(
            f"{directory} is not a directory; point NVSHARE_SOCKET_DIR (--socket-dir) at a "
            "directory for scheduler.sock"
        )
    problem = directory_problem(real, owner=os.geteuid())
    if problem is not None:
        raise SocketUnavailable(
            f"{directory}: {problem}; another user could replace the daemon's sockets there. "
            "Use a directory of your own (the default /var/run/nvshare as root), or fix its "
            "owner and mode"
        )


def directory_problem(real: Path, *, owner: int) -> str | None:
    """What lets someone other than `owner` (or root) change `real` or a directory above it."""
    info = os.stat(real)
    if info.st_uid != owner:
        return f"it belongs to uid {info.st_uid}, not to this daemon's user (uid {owner})"
    if info.st_mode & 0o022:
        return f"it is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    for parent in real.parents:
        info = os.stat(parent)
        if info.st_uid not in (0, owner):
            return f"{parent} above it belongs to uid {info.st_uid}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"{parent} above it is writable by others and not sticky"
    return None


def _take_lock(directory: Path, serving: Path) -> int:
    lock_path = directory / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise SocketUnavailable(_os_problem(f"cannot open {lock_path}", e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SocketUnavailable(
            f"another nvshare scheduler (pid {holder}) is serving {serving}; stop it first, "
            "or give this one another --socket-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _clear_stale(path: Path) -> None:
    """Remove a socket nobody answers on; refuse a live one or anything that is no socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketUnavailable(f"{path} exists and is not a socket; remove it or move it away")
    pid = answering_pid(path)
    if pid is not None:
        who = f"pid {pid}" if pid else "its pid unknown"
        raise SocketUnavailable(
            f"another nvshare scheduler ({who}) answers on {path}; stop it first, or give this "
            "one another --socket-dir"
        )
    path.unlink()


def answering_pid(path: Path) -> int | None:
    """The PID of whoever listens on the socket (0 if it answers but cannot say), None if no
    one does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return peer_credentials(probe)[0]
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    except OSError:  # a full backlog (EAGAIN) or a timeout: someone is there, and busy
        return 0
    finally:
        probe.close()


def _os_problem(what: str, e: OSError) -> str:
    hint = ""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = (
            "; run as root, or point NVSHARE_SOCKET_DIR (--socket-dir) at a directory of your "
            f"own (for example {_own_directory_example()}), and give your programs and "
            "nvsharectl the same NVSHARE_SOCKET_DIR"
        )
    elif e.errno == errno.ENOTDIR:
        hint = "; point NVSHARE_SOCKET_DIR (--socket-dir) at a directory for scheduler.sock"
    return f"{what}: {e.strerror or e}{hint}"


def _own_directory_example() -> str:
    """A socket directory a user can make without root: the login session's runtime directory
    where there is one (not `$XDG_RUNTIME_DIR`, which su, sudo, cron and containers leave
    empty), else one in the home directory."""
    runtime = Path(f"/run/user/{os.geteuid()}")
    if runtime.is_dir() and os.access(runtime, os.W_OK):
        return str(runtime / "nvshare")
    return os.path.join(os.path.expanduser("~"), ".nvshare")
