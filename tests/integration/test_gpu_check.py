"""benchmarks/gpu_check.sh: exits 0 with a message where there is no GPU, and its checks' code runs (tiny,
on the CPU) so that a GPU session does not discover a broken script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert listed.stdout.split() == ["bf16", "nan_skip", "syncs", "fp16", "tf32", "compile", "fsdp2", "adamw_8bit",
                                     "qlora", "mfu_100m",
                                     "checkpoint", "fp16_overflow", "chunked_loss", "packing", "shared_prefix",
                                     "ddp_2proc", "parallelism"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, script, "--rehearse", "--only", "qlora"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "qlora              ok" in proc.stdout and "0 failed" in proc.stdout


def gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_budget_is_what_is_left_of_the_total_less_the_reserve():
    g = gpu_check()
    clock = Clock()
    budget = g.Budget(total=480, reserve=15, clock=clock)
    assert budget.left() == 465 and budget.may_start() and budget.child_timeout() == 465
    clock.now += 400
    assert budget.left() == budget.child_timeout() == 65  # a child gets what is left, not a fixed 480 s
    clock.now += 60
    assert budget.left() == 5 and not budget.may_start()
    clock.now += 100
    assert budget.left() == 0 == budget.child_timeout()


def test_checks_past_the_budget_are_skipped_an_overrunning_one_is_interrupted_and_the_table_is_printed(
        capsys, monkeypatch):
    import time

    g = gpu_check()
    monkeypatch.setattr(g, "MIN_START_S", 2)  # the real-time part waits for the budget to run out: 2 s, not 20
    clock = Clock()
    budget = g.Budget(total=100, reserve=10, clock=clock)

    def quick():
        clock.now += 89  # leaves 1 s, under MIN_START_S
        return [{"name": "quick", "tokens_per_s": 1.0, "peak_gb": 0.5, "note": "fine"}]

    table = {"quick": quick, "late": lambda: [], "broken": lambda: 1 / 0}
    assert g.run_checks(table, ["quick", "late", "broken"], budget) == []
    out = capsys.readouterr().out
    table_part = out[out.rindex("check "):]
    assert "quick              ok" in table_part and "late               SKIPPED" in table_part
    assert "broken             SKIPPED" in table_part and "0 failed" in out

    def forever():
        while True:
            time.sleep(0.01)

    real = g.Budget(total=g.MIN_START_S + 0.5, reserve=0.0)  # half a second more than a start needs
    started = time.perf_counter()
    assert g.run_checks({"forever": forever, "broken": lambda: 1 / 0}, ["forever", "broken"], real) == ["forever"]
    assert time.perf_counter() - started < g.MIN_START_S + 5  # interrupted when the time left ran out
    out = capsys.readouterr().out
    assert "forever            TIMEOUT" in out and "broken             SKIPPED" in out and "1 failed (forever)" in out


def test_a_torchrun_child_gets_the_time_left_as_its_timeout(monkeypatch):
    import subprocess as sp

    g = gpu_check()
    clock = Clock()
    monkeypatch.setattr(g, "BUDGET", g.Budget(total=480, reserve=15, clock=clock))
    clock.now += 423
    seen = {}

    def run(cmd, **kw):
        seen.update(cmd=cmd, timeout=kw["timeout"])
        return sp.CompletedProcess(cmd, 0, stdout='ROW {"name": "fsdp2"}\n', stderr="")

    monkeypatch.setattr(g.subprocess, "run", run)
    assert g.torchrun_child("fsdp2", 1) == [{"name": "fsdp2"}]
    assert seen["timeout"] == 42 and seen["cmd"][-2:] == ["--child", "fsdp2"]

    def slow(cmd, **kw):
        raise sp.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(g.subprocess, "run", slow)
    import pytest

    with pytest.raises(g.OutOfTime, match="ran out of the time left"):
        g.torchrun_child("ddp_2proc", 2)


def test_the_fp16_overflow_verdict():
    g = gpu_check()
    good = [{"scale": 65536.0, "schedule": 1, "params": 1.0}, {"scale": 65536.0, "schedule": 2, "params": 2.0},
            {"scale": 32768.0, "schedule": 2, "params": 2.0}, {"scale": 32768.0, "schedule": 3, "params": 3.0}]
    assert g.overflow_verdict(good, injected=3) is None
    applied = [dict(r) for r in good]
    applied[2].update(params=2.5, schedule=3, scale=65536.0)  # the overflowed step applied as if nothing happened
    applied[3].update(schedule=4)
    assert g.overflow_verdict(applied, injected=3) == (
        "the overflowed step changed the parameters; the loss scale did not drop (65536.0 -> 65536.0); "
        "the schedule advanced (2 -> 3)")
    stuck = [dict(r) for r in good]
    stuck[3].update(params=2.0, schedule=2)
    assert g.overflow_verdict(stuck, injected=3) == ("the step after the overflow did not apply; the schedule did "
                                                    "not advance after the overflow")


@pytest.mark.slow
def test_the_cpu_capable_checks_run_checkpoint_chunked_loss_packing_shared_prefix_and_two_processes():
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    names = ["checkpoint", "chunked_loss", "packing", "shared_prefix", "ddp_2proc", "parallelism"]
    proc = subprocess.run([sys.executable, script, "--rehearse", "--only", *names], env=env, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    table = proc.stdout[proc.stdout.rindex("check "):]
    for name in names[:-1]:
        assert f"{name:<18} ok" in table
    # on a CPU every comparison is exact: the checkpoints are the live state of their step, resume is bit-exact
    # with and without full_determinism, and two identical runs do not differ
    assert "checkpoint-3 = live step 3 exactly (sync, async)" in table
    assert "full_determinism resumed max |diff| 0.0e+00 sync, 0.0e+00 async" in table
    assert "without it: run-to-run noise 0.0e+00, resumed 0.0e+00" in table
    assert "2 ranks on cpu:0 and cpu:0, gloo" in table and "0 failed" in table
    # the tiny model's 7 projections per layer and its tied embedding and head are sharded; one loss on both ranks
    assert re.search(r"tp_2proc +ok .* tp_size=2 on cpu:0 and cpu:0, gloo: 15 DTensor parameters; loss [0-9.]+ on "
                     r"every rank", table)


def test_a_row_not_run_is_said_with_its_reason_and_is_not_a_failure(capsys):
    g = gpu_check()
    table = {"pair": lambda: [{"name": "one", "tokens_per_s": 1.0, "peak_gb": 0.5, "note": "fine"},
                              {"name": "two", "not_run": "needs 2 GPUs"}]}
    assert g.run_checks(table, ["pair"], g.Budget(total=100, reserve=10, clock=Clock())) == []
    out = capsys.readouterr().out
    table_part = out[out.rindex("check "):]
    assert "one                ok" in table_part and "two                not run" in table_part
    assert "needs 2 GPUs" in table_part and "0 failed (none), 1 not run on this machine (two)" in out


@pytest.mark.parametrize("gpus", [1, 2])
def test_ddp_on_one_gpu_runs_one_rank_and_says_two_are_not_run(gpus, monkeypatch):
    """Two ranks on one GPU are not a valid DDP setup (Accelerate wraps rank 1 with device_ids=[1]): with one GPU
    the check runs one rank and reports the two-rank agreement as not run; with two, two ranks over NCCL."""
    g = gpu_check()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(g.torch.cuda, "device_count", lambda: gpus)
    asked = []

    def child(check, processes, rehearse=False):
        asked.append(processes)
        return [{"world": processes, "losses": [2.5] * processes, "devices": [f"cuda:{i}" for i in range(processes)],
                 "backend": "nccl", "wrapped": "DistributedDataParallel", "tokens_per_s": 10.0, "peak_gb": 1.0}]

    monkeypatch.setattr(g, "torchrun_child", child)
    rows = g.check_ddp_2proc(g.TINY, 3, 2, 16)
    assert asked == [gpus]
    if gpus == 1:
        assert [r["name"] for r in rows] == ["ddp_1proc", "ddp_2proc"]
        assert rows[0]["note"] == "1 rank on cuda:0, nccl, DistributedDataParallel; loss 2.5000"
        assert "device_ids=[1]" in rows[1]["not_run"]
    else:
        assert [r["name"] for r in rows] == ["ddp_2proc"] and "not_run" not in rows[0]
        assert rows[0]["note"].startswith("2 ranks on cuda:0 and cuda:1, nccl")


def test_budget_sets_the_scripts_time_so_that_gpu_all_can_share_ten_minutes():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--rehearse", "--only", "bf16",
                           "--budget", "10"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "bf16               SKIPPED  " in proc.stdout  # 10 s less the reserve: under MIN_START_S, not started


@pytest.mark.parametrize("gpus", [1, 2])
def test_parallelism_on_one_gpu_runs_tp_size_1_and_says_what_needs_two(gpus, monkeypatch):
    """With one GPU the check runs tp_size=1 under torchrun and reports tensor, sequence and context parallelism
    over 2 ranks as not run (nothing claims a figure not measured); with two, tp_size=2 over NCCL."""
    g = gpu_check()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(g.torch.cuda, "device_count", lambda: gpus)
    asked = []

    def child(check, processes, rehearse=False):
        asked.append((check, processes))
        return [{"world": processes, "losses": [2.5] * processes, "devices": [f"cuda:{i}" for i in range(processes)],
                 "backend": "nccl", "dtensors": 15 if processes > 1 else 0, "tokens_per_s": 10.0, "peak_gb": 1.0}]

    monkeypatch.setattr(g, "torchrun_child", child)
    rows = g.check_parallelism(g.TINY, 3, 2, 16)
    assert asked == [("parallelism", gpus)]
    assert rows[0]["name"] == f"tp_{gpus}gpu" and rows[0]["note"].startswith(f"tp_size={gpus} on cuda:0")
    if gpus == 1:
        assert [r["name"] for r in rows[1:]] == ["tp_2gpu", "sp_2gpu", "cp_2gpu"]
        assert all("takes a device per rank" in r["not_run"] for r in rows[1:])
    else:
        assert len(rows) == 1 and "15 DTensor parameters" in rows[0]["note"]
