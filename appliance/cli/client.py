"""A blocking connection to the daemon: nvsharectl's, on the control socket; and, for tests,
benchmarks and drills, one that speaks as a hook on the hook socket (`ControlClient.as_hook`)."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

from appliance.wire import framing, socket_dirs
from appliance.wire import protocol as p
from appliance.wire.messages import Decoded, Message


class DaemonUnavailable(Exception):
    """No daemon answers on the socket; the message says where we looked."""


def _file_on_the_way(path: Path) -> Path:
    """The first of `path`'s parents that exists and is not a directory."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path.parent


class ControlClient:
    def __init__(
        self,
        socket_dir: Path | None = None,
        *,
        timeout: float = 10.0,
        control_dir: Path | None = None,
        path: Path | None = None,
    ) -> None:
        control = control_dir or socket_dirs.control_dir_for(
            socket_dir or socket_dirs.socket_dir_from_env()
        )
        self.path = path or control / socket_dirs.CONTROL_SOCKET_NAME
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self._sock.close()
            raise DaemonUnavailable(
                f"no nvshare scheduler is running at {self.path} ({exc.strerror}); start it "
                "(systemctl start nvshare-scheduler) or set NVSHARE_SOCKET_DIR"
            ) from None
        except PermissionError:
            self._sock.close()
            raise DaemonUnavailable(f"permission denied connecting to {self.path}") from None
        except NotADirectoryError:
            self._sock.close()
            raise DaemonUnavailable(
                f"no nvshare scheduler can be at {self.path}: {_file_on_the_way(self.path)} is "
                "not a directory (check --socket-dir, --control-dir, NVSHARE_SOCKET_DIR and "
                "NVSHARE_CONTROL_DIR)"
            ) from None
        except OSError as exc:  # a path too long for a Unix socket, and the like
            self._sock.close()
            raise DaemonUnavailable(
                f"cannot connect to a scheduler at {self.path}: {exc.strerror or exc}"
            ) from None
        self._seq = itertools.count(1)
        self._decoder = framing.FrameDecoder(max_document=framing.MAX_DOCUMENT)
        self._pending: list[framing.Frame | framing.ProtocolError] = []

    @classmethod
    def as_hook(cls, socket_dir: Path, *, timeout: float = 10.0) -> ControlClient:
        """A connection to the hook socket, to speak as a hook does (REGISTER, LOCK_REQUEST)."""
        return cls(socket_dir, timeout=timeout, path=socket_dir / socket_dirs.SOCKET_NAME)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def send(self, message: Message) -> int:
        seq = next(self._seq)
        self._sock.sendall(framing.encode(message, seq=seq))
        return seq

    def receive(self) -> tuple[int, Decoded]:
        """The next frame from the daemon, as (seq, decoded body)."""
        while not self._pending:
            data = self._sock.recv(65536)
            if not data:
                raise DaemonUnavailable(f"the scheduler at {self.path} closed the connection")
            self._pending += self._decoder.feed(data)
        item = self._pending.pop(0)
        if isinstance(item, framing.ProtocolError):
            return 0, p.Result(item.status, item.ref_type, str(item))
        return item.seq, framing.decode_body(item)

    def receive_read(self) -> list[Decoded]:
        """For a caller that waits on the socket (select): the next frame and every other one
        that the same read brought. One `receive` a wake-up would leave those in this buffer,
        where no select sees them (a grant read behind a `Lent` then waits forever)."""
        out = [self.receive()[1]]
        while self._pending:
            out.append(self.receive()[1])
        return out

    def request(self, message: Message) -> Decoded:
        """Send and wait for the reply carrying the same sequence number."""
        seq = self.send(message)
        while True:
            got, body = self.receive()
            if got == seq:
                return body
