"""The hook's side of the one size grammar: ld_hook/size.c against every case of
tests/data/sizes.json, and NVSHARE_GPU_MEMORY_LIMIT as a program under the hook sees it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, Variant, assert_clean

CASES = json.loads((ROOT / "tests" / "data" / "sizes.json").read_text())["cases"]


@pytest.mark.parametrize("build", ["", "asan"])
def test_size_c_agrees_with_the_table(built: Path, build: str) -> None:
    assert all("\n" not in c["text"] for c in CASES)  # one case per line
    answers = subprocess.run(
        [str(built / build / "size_cases")],
        input="".join(c["text"] + "\n" for c in CASES),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(answers) == len(CASES)
    for case, answer in zip(CASES, answers, strict=True):
        if "bytes" in case:
            assert answer == f"ok {case['bytes']}", case
        else:
            expected = "too-large" if "at most 1Ei" in case["error"] else "syntax"
            assert answer == expected, case


@pytest.mark.parametrize("text", ["1", "512Ki", "1.5Gi", "8G", "0.5", "1ki", "512m", "2Ei"])
def test_the_env_limit_is_what_the_table_says(
    plain: Variant, start_probe, sock_dir: str, text: str
) -> None:
    (case,) = [c for c in CASES if c["text"] == text]
    p = start_probe(plain, plain.env(NVSHARE_GPU_MEMORY_LIMIT=text, NVSHARE_SOCKET_DIR=sock_dir))
    if "bytes" in case:
        p.ok("init")
        total = int(p.ok("total").split()[1])
    else:  # refused, said so once, and CUDA does not start: never the whole GPU unasked
        assert p.do("init") == "err 1"
    rc, err = p.finish()
    assert_clean(rc, err)
    if "bytes" in case:
        assert total == case["bytes"]
        assert "NVSHARE_GPU_MEMORY_LIMIT" not in err
    else:
        assert err.count(f"NVSHARE_GPU_MEMORY_LIMIT={text} is ") == 1
        assert "CUDA is not started" in err
