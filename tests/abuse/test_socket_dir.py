"""The socket directory is ours or refused: a directory someone else made first, or one others
can write, or a link to either, is refused with a message that says why and what to do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import Stage

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory needs root")


def refused(stage: Stage) -> str:
    with pytest.raises(RuntimeError, match="did not start") as failed:
        stage.start()
    assert stage.daemon is not None and stage.daemon.wait(10) != 0
    assert "Traceback" not in str(failed.value)
    assert not (stage.socket_dir / "scheduler.sock").exists()
    return str(failed.value)


@needs_root
def test_a_directory_another_user_made_first_is_refused(stage: Stage) -> None:
    stage.socket_dir.mkdir(mode=0o755)
    os.chown(stage.socket_dir, 65534, 65534)  # the attacker's, ready for an impostor socket
    message = refused(stage)
    assert f"{stage.socket_dir}: it belongs to uid 65534" in message
    assert "another user could replace the daemon's sockets there" in message


def test_a_directory_others_can_write_is_refused(stage: Stage) -> None:
    stage.socket_dir.mkdir()
    stage.socket_dir.chmod(0o777)
    assert "it is writable by others (mode 0777)" in refused(stage)


@needs_root
def test_a_link_to_someone_elses_directory_is_refused(stage: Stage, tmp_path: Path) -> None:
    theirs = stage.base / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    stage.socket_dir.symlink_to(theirs)
    assert "it belongs to uid 65534" in refused(stage)


def test_a_directory_it_makes_is_the_daemons_and_closed_to_others(stage: Stage) -> None:
    old = os.umask(0o077)  # a strict umask still gives other users' hooks a way in, no more
    try:
        stage.start()
    finally:
        os.umask(old)
    for directory in (stage.socket_dir, stage.control_dir):
        info = directory.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o755)
    assert (stage.socket_dir / "limits").stat().st_mode & 0o777 == 0o644
    assert (stage.socket_dir / "scheduler.sock").stat().st_mode & 0o777 == 0o666
