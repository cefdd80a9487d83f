"""stoker.distributed.backends: the members the loop calls (on stand-in accelerators, no processes), which
checkpoints each kind of run resumes, and that the Trainer and the checkpointing leave every backend difference
to the backend objects. The backends' real runs are tested in tests/distributed/test_distributed.py and
test_deepspeed.py."""

from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.arguments import AcceleratorConfig
from stoker.distributed.backends import (
    DEEPSPEED_KIND,
    FSDP_KIND,
    PLAIN_KIND,
    Backend,
    DeepSpeedBackend,
    FSDP2Backend,
    backend_for,
    checkpoint_kind,
)
from stoker.errors import CheckpointError

# the arguments backends read
PLAIN, FP16 = (types.SimpleNamespace(fp16=fp16, accelerator_config=AcceleratorConfig()) for fp16 in (False, True))

ROOT = Path(__file__).resolve().parents[2]


class StandInAccelerator:
    """What the loop members read of an Accelerator: no_sync, sync_gradients, backward, the fp16 scaler."""

    def __init__(self, scaler=None, step_was_skipped=False):
        self.sync_gradients, self.scaler, self.optimizer_step_was_skipped = True, scaler, step_was_skipped
        self.unsynced, self.backward_kwargs = [], []

    @contextlib.contextmanager
    def no_sync(self, model):
        self.unsynced.append(model)
        yield

    def backward(self, loss, **kwargs):
        self.backward_kwargs.append(kwargs)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.linear(x).squeeze(-1) - y) ** 2).mean()


def test_a_single_process_run_gets_the_plain_backend(tmp_path):
    rows = [{"x": torch.randn(4), "y": torch.randn(())} for _ in range(4)]
    trainer = Trainer(Regression(), TrainingArguments(output_dir=str(tmp_path), report_to="none"),
                      train_dataset=rows)
    assert type(trainer._backend) is Backend and not trainer._backend.wraps_in_place
    assert type(backend_for(trainer.accelerator, trainer.args)) is Backend


@pytest.mark.parametrize("backend_class", [Backend, DeepSpeedBackend])
def test_gradients_are_synchronised_on_the_last_micro_batch_only(backend_class):
    acc, model = StandInAccelerator(), object()
    backend = backend_class(acc, PLAIN)
    seen = []
    for last in (False, False, True):
        with backend.micro_batch(model, last):
            seen.append(acc.sync_gradients)
        assert acc.sync_gradients  # Accelerate's optimizer steps only while it is True
    assert acc.unsynced == [model, model]
    # DeepSpeed steps inside backward: it must see which micro-batch ends the window
    assert seen == ([False, False, True] if backend_class is DeepSpeedBackend else [True, True, True])


def test_sync_each_batch_synchronises_every_micro_batch():
    """accelerator_config's gradient_accumulation_kwargs sync_each_batch=True: no micro-batch runs under no_sync."""
    acc, model = StandInAccelerator(), object()
    args = types.SimpleNamespace(fp16=False, accelerator_config=AcceleratorConfig(
        gradient_accumulation_kwargs={"sync_each_batch": True}))
    for last in (False, False, True):
        with Backend(acc, args).micro_batch(model, last):
            pass
    assert acc.unsynced == []


def test_deepspeed_restores_sync_gradients_when_a_micro_batch_fails():
    acc = StandInAccelerator()
    with pytest.raises(RuntimeError), DeepSpeedBackend(acc, PLAIN).micro_batch(object(), last=False):
        raise RuntimeError("out of memory")
    assert acc.sync_gradients


def test_backward_and_the_nonfinite_guard_members():
    acc = StandInAccelerator()
    Backend(acc, PLAIN).backward(torch.zeros(()))
    DeepSpeedBackend(acc, PLAIN).backward(torch.zeros(()))
    assert acc.backward_kwargs == [{}, {"scale_wrt_gas": False}]  # the loop normalises over the whole window
    assert not Backend(StandInAccelerator(), FP16).scaler_handles_inf()
    assert Backend(StandInAccelerator(scaler=object()), PLAIN).scaler_handles_inf()
    assert DeepSpeedBackend(StandInAccelerator(), FP16).scaler_handles_inf()
    assert not DeepSpeedBackend(StandInAccelerator(), PLAIN).scaler_handles_inf()
    assert not Backend(StandInAccelerator(), PLAIN).update_applied_despite_nonfinite()
    assert DeepSpeedBackend(StandInAccelerator(), PLAIN).update_applied_despite_nonfinite()
    assert not DeepSpeedBackend(StandInAccelerator(step_was_skipped=True), PLAIN).update_applied_despite_nonfinite()


def test_a_checkpoint_is_resumed_by_the_kinds_of_run_that_can_load_it(tmp_path):
    plain, fsdp, zero = (tmp_path / name for name in ("plain", "fsdp", "zero"))
    for folder in (plain, fsdp, zero):
        folder.mkdir()
    (fsdp / "model_shards").mkdir()
    (zero / "optimizer_0.json").write_text("{}")
    assert [checkpoint_kind(str(f)) for f in (plain, fsdp, zero)] == [PLAIN_KIND, FSDP_KIND, DEEPSPEED_KIND]
    Backend(StandInAccelerator(), PLAIN).check_checkpoint(str(plain))
    Backend(StandInAccelerator(), PLAIN).check_checkpoint(str(fsdp))  # shards load whole into a plain run
    with pytest.raises(CheckpointError, match="was written by a DeepSpeed run and this is a data-parallel"):
        Backend(StandInAccelerator(), PLAIN).check_checkpoint(str(zero))
    with pytest.raises(CheckpointError, match="was written by a data-parallel .* run and this is an FSDP run"):
        FSDP2Backend(StandInAccelerator(), PLAIN).check_checkpoint(str(plain))
    with pytest.raises(CheckpointError, match="was written by a data-parallel .* run and this is a DeepSpeed run"):
        DeepSpeedBackend(StandInAccelerator(), PLAIN).check_checkpoint(str(plain))


@pytest.mark.parametrize("module", ["trainer.py", "checkpointer.py"])
def test_the_trainer_and_the_checkpointing_do_not_branch_on_the_backend(module):
    source = (ROOT / "stoker" / module).read_text()
    assert not re.findall(r"\b(is_sharded|is_deepspeed|zero_stage|is_fsdp2)\b", source)
