"""benchmarks/gpu_check.sh: exits 0 with a message where there is no GPU, and its checks' code runs (tiny,
on the CPU) so that a GPU session does not discover a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_exits_0():
    # hiding the GPUs tests the same path on a machine that has them
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout


def test_the_checks_are_listed_and_the_qlora_path_runs_on_the_cpu():
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    listed = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True, timeout=120)
    assert listed.stdout.split() == ["bf16", "fp16", "tf32", "compile", "fsdp2", "adamw_8bit", "qlora", "mfu_100m"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, script, "--rehearse", "--only", "qlora"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "qlora              ok" in proc.stdout and "0 failed" in proc.stdout
