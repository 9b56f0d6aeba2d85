"""The C header is the one definition of the wire format; the Python mirror must match it.

A C probe is compiled from `ld_hook/nvshare_proto.h` and prints sizeof/offsetof for every field;
the Python side computes the same numbers from its struct formats.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from appliance.wire import messages, protocol, protocol_view

ROOT = Path(__file__).resolve().parents[2]

FIELDS = {
    "nvs_header": ["magic", "version", "type", "flags", "body_len", "seq"],
    "nvs_register": [
        "pid",
        "env_core_limit",
        "gpu_total_mem",
        "env_mem_limit",
        "gpu_uuid",
        "pod_namespace",
        "pod_name",
    ],
    "nvs_priority_hint": ["priority", "reserved"],
    "nvs_limits": ["mem_limit", "core_limit", "mode", "backing", "flags"],
    "nvs_registered": [
        "client_id",
        "limits.mem_limit",
        "limits.core_limit",
        "limits.mode",
        "limits.backing",
        "limits.flags",
    ],
    "nvs_lock_grant": ["tq_ms", "idle_release_us", "queue_us"],
    "nvs_lock_released": ["reason", "reserved"],
    "nvs_set_tq": ["seconds", "flags"],
    "nvs_set_mode": ["mode", "flags", "gpu_uuid"],
    "nvs_result": ["status", "ref_type", "message"],
    "nvs_mem_reserve": ["bytes", "used"],
    "nvs_mem_grant": ["granted", "reserved"],
    "nvs_mem_return": ["bytes", "used"],
    "nvs_limit_set": [
        "pid",
        "flags",
        "mem_limit",
        "core_limit",
        "reserved",
        "pod_namespace",
        "pod_name",
    ],
    "nvs_mem_observed": ["nvml_used", "allowance"],
    "nvs_ledger_peers": ["clients", "reserved"],
    "nvs_mem_refusals": ["count", "reserved", "largest"],
    "nvs_view_request": ["gpu_uuid", "gpu_total_mem", "pod_namespace", "pod_name"],
    "nvs_view_process": ["pid", "flags", "used"],
    "nvs_view": [
        "mem_limit",
        "used",
        "process_count",
        "unlisted",
        *(
            f"processes[{i}].{field}"
            for i in range(protocol_view.VIEW_MAX_PROCESSES)
            for field in ("pid", "flags", "used")
        ),
    ],
    "nvs_gang_hint": ["name"],
    "nvs_gang_cut": ["cut_id", "collectives"],
}


def python_offsets(fmt: struct.Struct) -> list[int]:
    """Offsets of each item of a little-endian struct format (no padding with '<')."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt.format.lstrip("<"))
    offsets, prefix = [], "<"
    for count, code in items:
        offsets.append(struct.calcsize(prefix))
        prefix += f"{count}{code}"
    return offsets


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler on PATH: cannot compile the layout probe")
    out = tmp_path_factory.mktemp("probe")
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        '#include "nvshare_proto.h"',
        "int main(void) {",
    ]
    for name, fields in FIELDS.items():
        lines.append(f'printf("{name} %zu\\n", sizeof(struct {name}));')
        for f in fields:
            lines.append(f'printf("{name}.{f} %zu\\n", offsetof(struct {name}, {f}));')
    lines += ["return 0;", "}"]
    src = out / "probe.c"
    src.write_text("\n".join(lines))
    exe = out / "probe"
    subprocess.run(
        [cc, "-std=c11", "-Wall", "-Werror", "-I", str(ROOT / "ld_hook"), str(src), "-o", str(exe)],
        check=True,
    )
    text = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in text.splitlines())}


def test_every_struct_of_the_message_table_is_probed() -> None:
    assert set(messages.BODY_FORMATS) == set(FIELDS)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_struct_matches_c_header(name: str, c_layout: dict[str, int]) -> None:
    fmt = messages.BODY_FORMATS[name]
    assert fmt.size == c_layout[name], f"{name}: Python {fmt.size} bytes, C {c_layout[name]}"
    offsets = python_offsets(fmt)
    assert len(offsets) == len(FIELDS[name])
    for field, off in zip(FIELDS[name], offsets, strict=True):
        assert off == c_layout[f"{name}.{field}"], f"{name}.{field}"


def test_constants_match_c_header() -> None:
    header = (ROOT / "ld_hook" / "nvshare_proto.h").read_text()
    enums = dict(re.findall(r"NVS_MSG_(\w+) = (\d+)", header))
    assert {k: int(v) for k, v in enums.items()} == {m.name: m.value for m in protocol.MsgType}
    statuses = dict(re.findall(r"NVS_(?:OK|ERR_(\w+)) = (\d+)", header))
    assert {k: int(v) for k, v in statuses.items() if k} == {
        s.name: s.value for s in protocol.Status if s.name != "OK"
    }
    assert f"0x{protocol.MAGIC:08X}u" in header
    assert f"#define NVS_VIEW_MAX_PROCESSES {protocol_view.VIEW_MAX_PROCESSES}\n" in header
    assert f"#define NVS_VIEW_SELF 0x{protocol_view.VIEW_SELF}u " in header
