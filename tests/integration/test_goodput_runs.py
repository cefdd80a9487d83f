"""The goodput ledger of real runs (a tiny Llama on CPU): the parts add up to the wall time of train(), each loss
lands in its part (evaluations, saves, async saves, a resume, the steps a resumed run redoes after a crash), and
the ledger is in metrics.jsonl's final record and on the console, never in train()'s metrics (transformers'
keys)."""

from __future__ import annotations

import json
import time

import pytest

from stoker import Trainer, TrainerCallback
from stoker.goodput import PARTS

LOSSES = [p for p in PARTS if p != "productive"]


def final_record(output_dir) -> dict:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(records) if "train_runtime" in r)


def timed_train(trainer, **kwargs) -> float:
    started = time.perf_counter()
    trainer.train(**kwargs)
    return time.perf_counter() - started


class CrashAt(TrainerCallback):
    """Raises at the end of a step, as a process killed there would stop (before that step's log)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def test_the_parts_add_up_to_the_wall_time_of_train(tiny_llama, clm_rows, make_args, tmp_path, capsys):
    args = make_args(max_steps=8, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
                     log_level="info")
    trainer = Trainer(tiny_llama(), args, train_dataset=clm_rows(64), eval_dataset=clm_rows(8, seed=1))
    started = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - started
    record = final_record(tmp_path / "out")
    parts = {p: record[f"time_{p}"] for p in PARTS}
    assert sum(parts.values()) == pytest.approx(wall, rel=0.02)
    assert sum(parts.values()) == pytest.approx(record["time_wall"], abs=1e-3)
    assert parts["evaluation"] > 0 and parts["checkpoint"] > 0 and parts["productive"] > 0
    assert parts["resume"] == parts["recomputed"] == parts["rollback"] == 0
    assert 0 < record["goodput"] <= 1
    assert record["goodput"] == pytest.approx(parts["productive"] / record["time_wall"], abs=1e-3)
    # train()'s metrics hold the ledger; the logged record keeps transformers' keys (tests/parity compare them)
    assert {k: out.metrics[k] for k in record if k.startswith("time_") or k == "goodput"} == {
        k: v for k, v in record.items() if k.startswith("time_") or k == "goodput"}
    assert not [r for r in trainer.state.log_history if "goodput" in r or "time_wall" in r]
    assert f"goodput {100 * record['goodput']:.1f}%: productive" in capsys.readouterr().err


class Slow(TrainerCallback):
    """Sleeps a known time at the end of each step (step time), in each evaluation and in each save."""

    def __init__(self, seconds: float):
        self.seconds, self.slept = seconds, {"step": 0.0, "evaluation": 0.0, "checkpoint": 0.0}

    def _sleep(self, part: str) -> None:
        time.sleep(self.seconds)
        self.slept[part] += self.seconds

    def on_step_end(self, args, state, control, **kwargs):
        self._sleep("step")

    def on_evaluate(self, args, state, control, **kwargs):
        self._sleep("evaluation")

    def on_save(self, args, state, control, **kwargs):
        self._sleep("checkpoint")


def test_time_lands_in_the_part_it_was_spent_in(tiny_llama, clm_rows, make_args, tmp_path):
    """Known sleeps at the end of each step, in each evaluation and in each save: each part holds at least its own,
    and the productive time holds none of the evaluations' or saves' (whatever the machine's load)."""
    slow = Slow(0.1)
    trainer = Trainer(tiny_llama(), make_args(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                                              save_steps=2), train_dataset=clm_rows(32),
                      eval_dataset=clm_rows(8, seed=1), callbacks=[slow])
    trainer.train()
    record = final_record(tmp_path / "out")
    assert slow.slept == {"step": pytest.approx(0.4), "evaluation": pytest.approx(0.4),
                          "checkpoint": pytest.approx(0.2)}
    assert record["time_evaluation"] >= slow.slept["evaluation"]
    assert record["time_checkpoint"] >= slow.slept["checkpoint"]
    assert record["time_productive"] >= slow.slept["step"]
    assert record["time_productive"] <= record["time_wall"] - slow.slept["evaluation"] - slow.slept["checkpoint"]
    assert record["goodput"] < 1 - (slow.slept["evaluation"] + slow.slept["checkpoint"]) / record["time_wall"] + 1e-3


def test_async_save_a_crash_and_a_resume_count_resume_and_the_recomputed_steps(tiny_llama, clm_rows, make_args,
                                                                                tmp_path):
    def trainer(*callbacks):
        args = make_args(max_steps=12, save_strategy="steps", save_steps=4, async_save=True, eval_strategy="steps",
                         eval_steps=6)
        return Trainer(tiny_llama(), args, train_dataset=clm_rows(64), eval_dataset=clm_rows(8, seed=1),
                       callbacks=list(callbacks))

    with pytest.raises(RuntimeError, match="crash at step 10"):
        trainer(CrashAt(10)).train()  # checkpoints 4 and 8 written, step 9 logged
    out = tmp_path / "out"
    first_run = {json.loads(line)["run_id"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert len(first_run) == 1
    resumed = trainer()
    wall = timed_train(resumed, resume_from_checkpoint=str(out / "checkpoint-4"))
    record = final_record(out)
    parts = {p: record[f"time_{p}"] for p in PARTS}
    assert record["run_id"] in first_run  # the same run, gone on
    assert parts["resume"] > 0 and parts["checkpoint"] > 0
    assert parts["recomputed"] > 0  # steps 5 to 9, which the crashed run had reached
    assert parts["productive"] > 0  # steps 10 to 12, new work
    assert sum(parts.values()) == pytest.approx(wall, rel=0.02)
    assert 0 < record["goodput"] < 1


def test_a_resume_from_the_furthest_checkpoint_recomputes_nothing(tiny_llama, clm_rows, make_args, tmp_path):
    def trainer(max_steps):
        return Trainer(tiny_llama(), make_args(max_steps=max_steps, save_strategy="steps", save_steps=4),
                       train_dataset=clm_rows(64))

    trainer(4).train()
    resumed = trainer(8)
    resumed.train(resume_from_checkpoint=True)
    record = final_record(tmp_path / "out")
    assert record["time_resume"] > 0 and record["time_recomputed"] == 0 and record["time_productive"] > 0


def test_torch_compiles_time_is_carved_out_of_the_steps(tiny_llama, clm_rows, make_args, tmp_path):
    """torch._dynamo's own compile-time counters grow during the run's first steps: that time is compile, not
    productive (aot_eager compiles without a C++ compiler)."""
    trainer = Trainer(tiny_llama(), make_args(max_steps=3, torch_compile_backend="aot_eager"),
                      train_dataset=clm_rows(16))
    wall = timed_train(trainer)
    record = final_record(tmp_path / "out")
    assert record["time_compile"] > 0
    assert sum(record[f"time_{p}"] for p in PARTS) == pytest.approx(wall, rel=0.02)
