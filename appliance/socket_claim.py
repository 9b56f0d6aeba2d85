"""One daemon per socket: claim the scheduler socket's path, and give it back only if still ours.

A second daemon started on the same socket directory used to delete the first one's live socket
and listen in its place (the first kept running, unreachable by every hook and by nvsharectl),
then delete the path again on exit. Now, at start:

- a lock file next to the socket (`scheduler.sock.lock`, flock) settles daemons that start at
  the same moment, and holds the PID of the daemon that has it;
- a socket that answers belongs to a live daemon, even a hung one (the kernel queues the
  connection): refused, naming that daemon's PID from SO_PEERCRED;
- a socket nobody answers on was left by a daemon that died: replaced;
- anything else at that path (a file, a directory) is refused, never deleted.

On exit the path is removed only if it is still the socket this daemon bound (same inode).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from appliance.host.peer import peer_credentials
from appliance.protocol import SOCKET_NAME

LOCK_NAME = SOCKET_NAME + ".lock"
_BACKLOG = 128


class SocketUnavailable(Exception):
    """The socket cannot be served by this daemon; the message says why and what to do."""


@dataclass(slots=True)
class SocketClaim:
    """A bound, listening socket at `path`, and the lock that makes it this daemon's."""

    path: Path
    sock: socket.socket
    _lock_fd: int
    _inode: tuple[int, int]

    def release(self) -> None:
        """Remove the socket file if it is still the one we bound, then drop the lock."""
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def claim_socket(directory: Path) -> SocketClaim:
    """Bind and listen on `directory/scheduler.sock`, or raise `SocketUnavailable`."""
    _ensure_directory(directory)
    path = directory / SOCKET_NAME
    lock_fd = _take_lock(directory)
    try:
        _clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o666)  # any local user may connect; identity comes from the kernel
            sock.listen(_BACKLOG)
            info = os.lstat(path)
        except OSError as e:
            sock.close()
            raise SocketUnavailable(_os_problem(f"cannot listen on {path}", e)) from None
    except BaseException:
        os.close(lock_fd)
        raise
    return SocketClaim(path, sock, lock_fd, (info.st_dev, info.st_ino))


def _ensure_directory(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: said below
    except OSError as e:
        raise SocketUnavailable(_os_problem(f"cannot create {directory}", e)) from None
    if not directory.is_dir():
        raise SocketUnavailable(
            f"{directory} is not a directory; point NVSHARE_SOCKET_DIR (--socket-dir) at a "
            "directory for scheduler.sock"
        )


def _take_lock(directory: Path) -> int:
    lock_path = directory / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise SocketUnavailable(_os_problem(f"cannot open {lock_path}", e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SocketUnavailable(
            f"another nvshare scheduler (pid {holder}) is serving {directory}; stop it first, "
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
            "; run as root, or point NVSHARE_SOCKET_DIR (--socket-dir) at a directory you can write"
        )
    elif e.errno == errno.ENOTDIR:
        hint = "; point NVSHARE_SOCKET_DIR (--socket-dir) at a directory for scheduler.sock"
    return f"{what}: {e.strerror or e}{hint}"
