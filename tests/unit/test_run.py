"""stoker.run: the run's one list of parts, read by the checkpoint, the spike rollback and a resume; and a checkpoint
written before the run owned its state still resumes exactly."""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
from safetensors.torch import load_file

from stoker import Trainer, TrainerCallback
from stoker import checkpoint_format as ckpt
from stoker.run import Run
from tests.helpers.tiny_jobs import args, llama, rows

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


class Counter:
    """A part of the test's own: a number that every step moves on."""

    def __init__(self):
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, saved: dict) -> None:
        self.value = saved["value"]


class Counting(TrainerCallback):
    def __init__(self, counter: Counter):
        self.counter, self.at_start = counter, None

    def on_train_begin(self, args, state, control, **kw):
        self.at_start = self.counter.value

    def on_step_end(self, args, state, control, **kw):
        self.counter.value += 1


def test_a_part_added_to_the_run_is_carried_by_the_checkpoint_the_resume_and_the_rollback(tmp_path, monkeypatch):
    """One list: a part added to Run.parts() is written into every process's checkpoint file, put back by a resume,
    and snapshotted and put back by the spike rollback, with no change anywhere else."""
    counter, runs = Counter(), []
    parts, start = Run.parts, Trainer._start_run
    monkeypatch.setattr(Run, "parts", lambda self: {**parts(self), "extra": counter})
    monkeypatch.setattr(Trainer, "_start_run", lambda self, *a: runs.append(start(self, *a)) or runs[-1])
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, spike_rollback=True, spike_window=100)
    Trainer(llama(), args(tmp_path, **kw), train_dataset=rows(32), callbacks=[Counting(counter)]).train()
    assert counter.value == 4
    assert ckpt.load_state(str(tmp_path / "out" / "checkpoint-2"), "process_0")["extra"] == {"value": 2}

    resumed = Counting(counter)  # a resume puts the part back as the checkpoint had it
    counter.value = 99
    Trainer(llama(), args(tmp_path, **kw), train_dataset=rows(32), callbacks=[resumed]).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert (resumed.at_start, counter.value) == (2, 4)

    run = runs[0]  # the rollback copies the same list to host memory and puts it back
    run.rollback.snapshot(run)
    counter.value = 7
    run.rollback.restore(run)
    assert counter.value == 4


def test_the_run_state_round_trips_through_a_rollback_snapshot_bit_for_bit(tmp_path):
    """Every part's state after a snapshot, changes (a step's update, a log sum, the random streams) and its
    restore equals the state when the snapshot was taken, but for the controls' flags, which it clears."""
    runs, start = [], Trainer._start_run
    trainer = Trainer(llama(), args(tmp_path, max_steps=3, spike_rollback=True, spike_window=100, optim="adamw_torch",
                                    logging_steps=2), train_dataset=rows(32))
    trainer._start_run = lambda *a: runs.append(start(trainer, *a)) or runs[-1]
    trainer.train()
    run = runs[0]
    run.rollback.snapshot(run)
    before = flat(copy.deepcopy(run.state_dict()))  # the live tensors and lists, copied
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    for state in run.optimizer.optimizer.state.values():
        state["exp_avg"].mul_(3.0)
    run.log.loss += 5.0
    run.state.global_step += 10
    run.state.log_history.append({"loss": 0.0})
    torch.rand(3)
    run.rollback.restore(run)
    after = flat(run.state_dict())
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key.startswith("/callbacks/TrainerControl/args/should_"):  # the flags of undone steps are cleared
            assert after[key] is False
        else:
            assert equal(value, after[key]), key


def test_a_checkpoint_written_before_the_run_owned_its_state_resumes_exactly(tmp_path):
    """tests/data/checkpoint_v1: checkpoint-3 of a 6-step run (AdamW, a linear schedule with warm-up, accumulation 2,
    clipping, a log half-way between two logs) written by the release before this layout of the run's state, with
    the parameters and logs the uninterrupted run ended with. Resumed now, the run ends bit-equal to it."""
    saved = os.path.join(DATA, "checkpoint_v1")
    expected = json.load(open(os.path.join(saved, "expected.json")))
    folder = tmp_path / "out" / "checkpoint-3"
    shutil.copytree(os.path.join(saved, "checkpoint-3"), folder)
    trainer = Trainer(llama(), args(tmp_path, **expected["kwargs"]), train_dataset=rows(32))
    trainer.train(resume_from_checkpoint=str(folder))
    final = load_file(os.path.join(saved, "expected.safetensors"))
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), final[name]), name
    assert trainer.state.log_history[:-1] == expected["log_history"][:-1]  # the last record times the run


def flat(state, prefix="") -> dict:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    return {prefix: state}


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape"):  # numpy's random state
        return (a == b).all()
    return a == b
