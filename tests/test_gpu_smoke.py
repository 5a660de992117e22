"""``benchmarks/gpu.py --smoke``: the script that runs every GPU check and figure runs on the CPU at tiny sizes (the
Triton kernel under its interpreter), every check passing or skipped with its reason, and prints its table. What the
GPU itself gives is read from the script's own run there (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_gpu_script_runs_every_check_on_the_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("\ncheck ", 1)[1]
    for name in (
        "bf16 capture",
        "fp16 capture",
        "generation, static cache",
        "accelerate, cuda:0 + cpu",
        "torch.compile",
        "monitor, training step",
        "sdpa kernels with their lse",
        "Triton kernel vs eager engine",
        "figure: weights-only",
    ):
        row = next(line for line in table.splitlines() if line.startswith(name))
        assert " ok " in row or " skip " in row, row
    assert "FAIL" not in table
