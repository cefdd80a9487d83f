"""benchmarks/gpu_kernels.py (packed attention, the fused loss and float8 on a GPU): its rehearsal, tiny sizes on
this CPU, runs every way and prints its table, so that the GPU run is not the first time the script runs: bfloat16
weights and float32 weights under bf16 autocast (the GPU default's), odd row lengths and a float8 job whose token
count is no multiple of 16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_rehearsal_runs_every_way_and_prints_the_table(tmp_path):
    pytest.importorskip("torchao", reason="the float8 way needs torchao (the dev extra installs it)")
    out = tmp_path / "kernels.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernels.py"), "--rehearse",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ways = [r["way"] for r in json.loads(out.read_text())["results"]]
    loss = [f"loss at vocab {v}, {w}: {way}" for v in (1024, 4096)
            for w in ("bf16 weights", "float32 weights + bf16 autocast") for way in ("plain", "chunked")]
    float8 = [f"float8 on tiny, {w}: {way}" for w in ("bf16 weights", "float32 weights + bf16 autocast")
              for way in ("bf16", "fp8 tensorwise")]
    assert ways == ["attention: packed, varlen (per_sequence)",
                    "attention: packed, varlen, float32 weights + bf16 autocast (per_sequence)",
                    "attention: packed, dense mask", "attention: padded", *loss, *float8]
    assert "(rehearsal: tiny sizes)" in proc.stdout and "tokens/s" in proc.stdout


def test_without_a_gpu_it_says_so_and_exits_0():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernels.py"), "--only", "loss"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA GPU here" in proc.stdout
