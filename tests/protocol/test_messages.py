"""The message table (`appliance.wire.messages`) and the C header's message enum say the same.

`ld_hook/nvshare_proto.h` writes each message as `NVS_MSG_NAME = number, /* sender: body ... */`;
a message missing on either side, or one with another number, sender or body struct, fails
here (the sizes of the structs are compared by test_wire_layout's compiled probe).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.serve.hooks import HookSessions
from appliance.wire import codec, framing, messages
from appliance.wire import protocol as p
from appliance.wire import protocol_view as pv

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(
    r"NVS_MSG_(\w+) = (\d+),\s*/\* ([a-z ]+?(?: -> [a-z]+)?): (struct nvs_\w+|empty|JSON|raw bytes)"
)


def header_messages(text: str) -> dict[str, tuple[int, str, str]]:
    return {name: (int(n), sender, body) for name, n, sender, body in ENTRY.findall(text)}


def table_messages() -> dict[str, tuple[int, str, str]]:
    return {m.type.name: (m.type.value, m.sender, m.c_body) for m in messages.MESSAGES}


def test_the_header_and_the_table_list_the_same_messages() -> None:
    header = (ROOT / "ld_hook" / "nvshare_proto.h").read_text()
    assert len(re.findall(r"NVS_MSG_\w+ = \d+", header)) == len(header_messages(header))
    assert header_messages(header) == table_messages()


def test_a_message_missing_or_renumbered_in_the_header_is_caught() -> None:
    header = (ROOT / "ld_hook" / "nvshare_proto.h").read_text()
    without = header.replace("NVS_MSG_LOCK_UNLENT = 82,", "")
    renumbered = header.replace("NVS_MSG_LOCK_LENT = 81,", "NVS_MSG_LOCK_LENT = 83,")
    other_struct = header.replace("struct nvs_mem_grant */", "struct nvs_mem_reserve */")
    for changed in (without, renumbered, other_struct):
        assert changed != header
        assert header_messages(changed) != table_messages()


def test_every_message_type_is_in_the_table_once() -> None:
    assert [m.type for m in messages.MESSAGES] == list(
        dict.fromkeys(m.type for m in messages.MESSAGES)
    )
    assert set(messages.BY_TYPE) == set(p.MsgType)


def test_every_body_class_is_registered_for_its_own_type() -> None:
    for m in messages.MESSAGES:
        if m.body is not None and m.body is not p.Result:
            assert m.body.TYPE is m.type
            assert framing.decode_body(framing.Frame(m.type, 0, bytes(m.body.FORMAT.size)))


def test_hooks_messages_turned_into_events_are_those_hooks_send() -> None:
    assert set(codec.HOOK_EVENTS) <= messages.SENT_BY_HOOKS


def hook_reader_shapes(text: str) -> dict[str, str]:
    """The messages the hook's reader (ld_hook/frames.c) accepts, with the body it expects."""
    shapes = re.findall(r"\{NVS_MSG_(\w+), (?:sizeof\((struct nvs_\w+)\)|0), NVS_EV_\w+", text)
    return {name: body or messages.EMPTY for name, body in shapes}


def test_the_hooks_reader_takes_every_message_sent_to_hooks_with_the_tables_body() -> None:
    reader = hook_reader_shapes((ROOT / "ld_hook" / "frames.c").read_text())
    to_hooks = {
        m.type.name: m.c_body
        for m in messages.MESSAGES
        if m.sender in (messages.TO_HOOK, messages.EITHER)
        and m.type is not p.MsgType.VIEW  # read by the one bounded question (dial.c)
    }
    assert reader == to_hooks


def test_every_message_a_hook_sends_is_answered_by_the_hooks_socket() -> None:
    """A message added to the table as sent by hooks names its core event there, or the hooks'
    socket answers it itself (REGISTER, HEARTBEAT, VIEW_REQUEST); one with neither is caught."""
    sessions = HookSessions(
        dispatch=lambda event: None,
        view=lambda *asked: pytest.fail("no view is asked for"),
        gpus=codec.NodeGpus,
        proc_root=Path("/proc"),
    )
    assert set(sessions.handlers) == messages.SENT_BY_HOOKS
    assert set(codec.HOOK_EVENTS) == messages.SENT_BY_HOOKS - {
        p.Register,
        p.Heartbeat,
        pv.ViewRequest,
    }
