"""Real-GPU checks (PyTorch under the hook, limits, serialisation) where a GPU exists.

CI has no GPU: these skip there, saying why. On a GPU machine, run `bash tests/gpu/run.sh`
(it also builds the CUDA programs), or this file with pytest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _gpu_missing() -> str | None:
    if shutil.which("nvidia-smi") is None or not Path("/dev/nvidia0").exists():
        return "no NVIDIA GPU on this machine (no nvidia-smi or /dev/nvidia0)"
    if shutil.which("nvcc") is None:
        return "no nvcc to build tests/gpu/programs.cu"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed in this interpreter"
    return None


pytestmark = pytest.mark.gpu


@pytest.mark.timeout(900)
def test_real_gpu_checks_pass() -> None:
    reason = _gpu_missing()
    if reason:
        pytest.skip(f"{reason}; the real-GPU checks run on a GPU machine via tests/gpu/run.sh")
    r = subprocess.run(
        ["bash", str(HERE / "run.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
