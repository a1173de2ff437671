"""benchmarks/gpu_checks.sh off a GPU: it stops at once, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the script runs it all")
def test_without_a_gpu_the_script_stops_before_any_stage(tmp_path):
    # It ran every stage anyway: the whole test suite on the CPU, then serve.py's CPU
    # figures written where the GPU's go. The short limits bound this test if it does.
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               JAX_PLATFORMS="cpu", GPU_TEST_S="5", GPU_BENCH_S="5", GPU_SERVE_S="5",
               GPU_SERVE_1B_S="5")  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout[-2000:]
    assert "no GPU found (jax runs on cpu)" in run.stderr
    assert not (tmp_path / "out").exists()
