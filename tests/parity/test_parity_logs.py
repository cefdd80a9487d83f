"""log_history as transformers.Trainer writes it: the same keys in every record (stoker's wall-clock
diagnostics are in metrics.jsonl only), num_input_tokens_seen only when asked for, and a resumed run whose
training records equal the uninterrupted run's."""

from __future__ import annotations

import json

import pytest

from tests.parity.oracle import run

WALL_CLOCK = ("tokens_per_second", "samples_per_second", "data_wait_fraction")


@pytest.mark.parametrize("overrides", [
    dict(max_steps=3, eval_steps=2),
    dict(max_steps=3, eval_steps=2, include_num_input_tokens_seen="non_padding"),
    dict(max_steps=2, include_num_input_tokens_seen=True),
], ids=["default", "tokens_non_padding", "tokens_all"])
def test_log_history_has_the_keys_transformers_logs(tmp_path, overrides):
    hf = run("hf", "llama", str(tmp_path / "hf"), **overrides)
    ours = run("stoker", "llama", str(tmp_path / "ours"), **overrides)
    assert ours["log_keys"] == hf["log_keys"]
    train_records = [k for k in ours["log_keys"] if "loss" in k]
    assert train_records and all(not set(k) & set(WALL_CLOCK) for k in train_records)
    counting = "include_num_input_tokens_seen" in overrides
    assert all(("num_input_tokens_seen" in k) == counting for k in train_records)
    assert all(("train_tokens_per_second" in k) == counting for k in train_records)


def test_the_logged_losses_are_transformers_values_unrounded(tmp_path):
    """transformers 5 logs each window's mean loss as computed, not rounded: on a job both trainers compute alike
    the records are equal, so a script comparing log_history (or a threshold on it) sees the same numbers."""
    hf = run("hf", "llama", str(tmp_path / "hf"), max_steps=3)
    ours = run("stoker", "llama", str(tmp_path / "ours"), max_steps=3)
    theirs, mine = ([(r["step"], r["loss"], r["grad_norm"]) for r in x["logs"] if "loss" in r] for x in (hf, ours))
    assert len(theirs) == 3 and mine == theirs


def test_diagnostics_are_written_to_metrics_jsonl(tmp_path):
    ours = run("stoker", "llama", str(tmp_path / "ours"), max_steps=2)
    with open(tmp_path / "ours" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    training = [r for r in records if "loss" in r]
    assert len(training) == 2 and all(set(WALL_CLOCK) <= set(r) for r in training)
    assert "train_tokens_per_second" in records[-1] and "train_runtime" in records[-1]
    assert all("train_tokens_per_second" not in k for k in ours["log_keys"])


def test_a_resumed_runs_log_history_equals_the_uninterrupted_runs(tmp_path):
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    def train(resume=None):
        settings = dict(per_device_train_batch_size=2, num_train_epochs=2, logging_steps=2, save_strategy="steps",
                        save_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0)
        trainer = Trainer(llama(), args(tmp_path, **settings), train_dataset=rows(10, seed=3))
        trainer.train(resume_from_checkpoint=resume)
        return trainer.state.log_history

    whole = train()
    resumed = train(str(tmp_path / "out" / "checkpoint-3"))
    # every record but the last (train_runtime and its rates are wall-clock in transformers too)
    assert len(whole) == len(resumed) == 6
    assert resumed[:-1] == whole[:-1]
    assert sorted(resumed[-1]) == sorted(whole[-1])


class Captured:
    """The messages of transformers.Trainer's logger (where both trainers write the run's header)."""

    def __init__(self):
        import logging

        self.logger, self.lines = logging.getLogger("transformers.trainer"), []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


HEADER = ("***** Running", "  Num ", "  Number", "  Instantaneous", "  Total ", "  Gradient", "  Batch size")


@pytest.mark.parametrize("level", ["info", "warning"])
def test_run_evaluation_and_prediction_headers_are_transformers_lines(tmp_path, level, log_levels):
    settings = dict(max_steps=3, eval_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    log_level=level)
    seen = {}
    for framework in ("hf", "stoker"):
        with Captured() as captured:
            run(framework, "llama", str(tmp_path / framework), **settings)
        seen[framework] = [line for line in captured.lines if line.lstrip("\n").startswith(HEADER)]
    assert seen["stoker"] == seen["hf"]
    if level == "info":
        assert seen["stoker"][:9] == [
            "***** Running training *****", "  Num examples = 8", "  Num Epochs = 3",
            "  Num update steps per epoch = 1", "  Instantaneous batch size per device = 4",
            "  Total train batch size (w. parallel, distributed & accumulation) = 8",
            "  Gradient Accumulation steps = 2", "  Total optimization steps = 3",
            f"  Number of trainable parameters = {sum(p.numel() for p in FAMILY_MODEL().parameters()):,}"]
        assert "\n***** Running Evaluation *****" in seen["stoker"]
        assert seen["stoker"][-3:] == ["\n***** Running Prediction *****", "  Num examples = 6", "  Batch size = 6"]
    else:
        assert seen["stoker"] == []


def FAMILY_MODEL():
    from tests.parity.families import FAMILIES

    return FAMILIES["llama"](0)
