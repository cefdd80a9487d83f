"""benchmarks/gpu_speed.py: its rehearsal runs every way of every job on the CPU (so that a GPU session does not
discover a broken script), its packing and data are the same for every way, and the fast settings are read by
name from stoker's TrainingArguments."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_speed.py"


def gpu_speed():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports gpu_check from its folder, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("gpu_speed", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_without_a_gpu_it_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout


def test_packed_rows_are_full_with_positions_restarting_and_no_target_across_sequences():
    g = gpu_speed()
    rows = g.pack([[1, 2, 3], [4, 5, 6, 7], [8, 9]], seq_len=4)
    assert [r["input_ids"] for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the leftover [9] makes no row
    # a sequence cut at a row's end goes on in the next row as a sequence of its own
    assert [r["position_ids"] for r in rows] == [[0, 1, 2, 0], [0, 1, 2, 0]]
    assert rows[0]["labels"] == [-100, 2, 3, -100] and rows[1]["labels"] == [-100, 6, 7, -100]
    s = g.Sizes(rehearse=True)
    padded = g.row_lengths("padded", s)
    assert min(padded) >= s.min_len and max(padded) <= s.seq_len and len(set(padded)) > 1
    assert g.row_lengths("full", s) == [s.seq_len] * (s.steps * s.batch)
    # the padded job's real tokens per step: exactly the rows trained, without their padding
    per_step, attention = g.tokens_and_attention("padded", s)
    trained = padded[:s.steps * s.batch]
    assert per_step == sum(trained) / s.steps and s.min_len <= attention <= s.seq_len


def test_the_fast_settings_are_read_by_name_from_stokers_arguments(monkeypatch):
    g = gpu_speed()
    monkeypatch.setattr(g, "FAST_SETTINGS", {"torch_compile": True, "a_setting_stoker_lacks": 3,
                                             "dataloader_num_workers": 2})
    assert g.fast_settings(rehearse=False) == ({"torch_compile": True, "dataloader_num_workers": 2},
                                               ["a_setting_stoker_lacks"])
    assert g.fast_settings(rehearse=True)[0] == {"dataloader_num_workers": 2}  # no compiling on a CPU


@pytest.mark.slow
def test_the_rehearsal_gives_a_row_for_every_way_of_every_job():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rehearse"], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "0 failed (none)" in proc.stdout
    table = proc.stdout[proc.stdout.rindex("\njob "):].splitlines()[2:-1]
    g = gpu_speed()
    seen = {(line.split()[0], line.split()[1]): line for line in table}
    assert set(seen) == {(job, way) for job in g.JOBS for way in g.WAYS}
    for line in seen.values():
        tokens_per_s, loss = float(line.split()[2].replace(",", "")), float(line.split()[5])
        assert tokens_per_s > 0 and 3.0 < loss < 6.0  # ~ln(128) = 4.85 at the start: every way trained


def test_the_one_command_for_both_says_there_is_no_gpu_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_all.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_all: no CUDA GPU here" in proc.stdout


def test_the_timed_steps_synchronise_once_when_the_warm_up_ends_and_once_after_the_last(monkeypatch):
    """No synchronisation after every step, which would hide what the host and the device overlap (the deferred
    check, non-blocking copies): the same two for every way."""
    import torch

    g, synced = gpu_speed(), []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(len(synced)))
    times = g.StepTimes(torch.device("cuda"), steps=g.WARMUP_STEPS + 5)
    for _ in range(g.WARMUP_STEPS + 5):
        times.mark()
    assert len(synced) == 2 and times.steps_timed == 5 and len(times.ends) == 2
    assert times.seconds_per_step() == (times.ends[1] - times.ends[0]) / 5


def test_a_way_cut_off_by_its_share_keeps_the_jobs_it_finished_and_one_table_shows_both_scripts(monkeypatch,
                                                                                                   tmp_path):
    import json
    import subprocess as sp

    g = gpu_speed()
    done = {"job": "full", "way": "hand", "tokens_per_s": 1000.0, "mfu": 0.4, "peak_gb": 9.5, "loss": 4.2}

    def cut_off(cmd, **kw):
        raise sp.TimeoutExpired(cmd, kw["timeout"], output=f"RESULT {json.dumps(done)}\n".encode())

    monkeypatch.setattr(g.subprocess, "run", cut_off)
    results, stopped = g.measure(["full", "lora"], "hand", False, None, 60.0)
    assert results == [done] and stopped == "out of this way's share of the budget (60s)"
    path = str(tmp_path / "rows.jsonl")
    g.gpu_check.append_rows(path, [{"name": "check bf16", "status": "ok", "tokens_per_s": 5e4, "peak_gb": 3.0,
                                    "note": "loss 3.1"}])
    g.gpu_check.append_rows(path, g.table_rows({"full": {"hand": done}, "lora": {}}, {("lora", "hand"): stopped}, []))
    table = g.gpu_check.one_table(path).splitlines()
    assert [line.split()[0:3] for line in table[1:]] == [["check", "bf16", "ok"], ["speed", "full/hand", "ok"],
                                                         ["speed", "lora/hand", "SKIPPED"]]
    assert "40.0%" in table[2] and "9.50" in table[2] and stopped in table[3]
