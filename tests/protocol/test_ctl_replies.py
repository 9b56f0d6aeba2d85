"""nvsharectl facing a daemon whose reply is not the one it asked for: one line, exit 1."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from click.testing import CliRunner

from appliance.cli.nvsharectl import nvsharectl
from appliance.wire import framing
from appliance.wire import protocol as p
from appliance.wire.socket_dirs import CONTROL_SOCKET_NAME


def answer_once(listener: socket.socket, reply: p.Result) -> None:
    """Read one frame and answer it with `reply`, as a daemon would, under the frame's seq."""
    conn, _ = listener.accept()
    with conn:
        decoder = framing.FrameDecoder()
        frames: list[framing.Frame | framing.ProtocolError] = []
        while not frames:
            frames = decoder.feed(conn.recv(65536))
        (frame,) = frames
        assert isinstance(frame, framing.Frame)
        conn.sendall(framing.encode(reply, seq=frame.seq))


def ask(tmp_path: Path, reply: p.Result, *args: str) -> tuple[int, str]:
    control = tmp_path / "control"
    control.mkdir()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(control / CONTROL_SOCKET_NAME))
        listener.listen(1)
        daemon = threading.Thread(target=answer_once, args=(listener, reply), daemon=True)
        daemon.start()
        result = CliRunner().invoke(nvsharectl, ["--control-dir", str(control), *args])
        daemon.join(timeout=10)
    return result.exit_code, result.output


def test_an_ok_where_a_query_answer_was_due_is_an_error_not_a_crash(tmp_path: Path) -> None:
    code, out = ask(tmp_path, p.Result(p.Status.OK, p.MsgType.QUERY, "done"), "policy", "show")
    assert code == 1
    assert "unexpected reply from the scheduler to a policy query" in out
    assert "Traceback" not in out and "AttributeError" not in out


def test_a_refused_query_says_why(tmp_path: Path) -> None:
    refusal = p.Result(p.Status.PERMISSION, p.MsgType.QUERY, "not yours")
    code, out = ask(tmp_path, refusal, "limit", "list")
    assert (code, out.strip().splitlines()[-1]) == (
        1,
        "nvsharectl: the scheduler refused: not yours",
    )
