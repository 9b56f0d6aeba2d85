"""`make sim` (tests/kube/sim_seed_004.py) runs seed 004's three tests to the end and passes its
own checks: no pod pending on 2g.20gb while 1g.10gb is free, 5 of the Deployment's 16 pods and
the Job's 4 fell back, annotated with the seed's key, and it says it is a simulation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_make_sim_runs_the_seeds_three_tests_and_passes_its_checks() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kube" / "sim_seed_004.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    assert out.startswith("=== SIMULATION of seed 004's cluster")
    assert "Simulated: the API server" in out and "Real:      kubectl" in out
    for command in (
        "$ kubectl apply -f tests/kube/seed_004/test-medium-gpu.yaml",
        "$ kubectl apply -f tests/kube/seed_004/test-deployment.yaml",
        "$ kubectl apply -f tests/kube/seed_004/test-job.yaml",
    ):
        assert command in out
    assert "NAME                        FALLBACK           GPU-REQUEST" in out
    assert out.count("2g.20gb->1g.10gb   map[nvidia.com/mig-1g.10gb:1]") == 9
    assert "ok   pods pending on 2g.20gb while 1g.10gb is free: 0 (expected 0)" in out
    assert "FAIL" not in out
