"""The pieces of one step (stoker.loop): what every process agrees on, the non-finite policy, out-of-memory
halving, and a Run that lives only as long as its train() call."""

from __future__ import annotations

import inspect
import math
import signal
from types import SimpleNamespace

import pytest
import torch

from stoker.errors import NonFiniteError
from stoker.loop import LoopPosition, MicroBatchHalver, NonFinitePolicy, Run, RunningLog, StepVerdict, agree_on_step

ONE_PROCESS = SimpleNamespace(num_processes=1)
OOM = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_one_process_agrees_on_its_own_numbers_and_signal():
    finite = torch.tensor(1.5)
    assert agree_on_step(ONE_PROCESS, finite, torch.tensor(0.3), True, None) == StepVerdict(True, True, None)
    assert agree_on_step(ONE_PROCESS, finite, torch.tensor(math.inf), True, signal.SIGUSR1) == (
        StepVerdict(False, False, signal.SIGUSR1))
    # with fp16 loss scaling the gradient norm is the scaler's business: only the loss is checked
    assert agree_on_step(ONE_PROCESS, finite, torch.tensor(math.inf), False, None).finite
    assert not agree_on_step(ONE_PROCESS, torch.tensor(math.nan), torch.tensor(0.3), False, None).finite


def policy(nonfinite_policy="skip", max_nonfinite_steps=3, applied=False) -> NonFinitePolicy:
    backend = SimpleNamespace(update_applied_despite_nonfinite=lambda: applied)
    args = SimpleNamespace(nonfinite_policy=nonfinite_policy, max_nonfinite_steps=max_nonfinite_steps)
    return NonFinitePolicy(args, backend)


def test_the_policy_skips_counts_and_stops_after_too_many_in_a_row():
    log, bad, good = RunningLog(torch.device("cpu")), StepVerdict(False, False, None), StepVerdict(True, True, None)
    skip = policy(max_nonfinite_steps=2)
    nan = torch.tensor(math.nan)
    assert not skip.allows(bad, log, nan, 1.0, 1, 0)
    assert skip.allows(good, log, torch.tensor(1.0), 1.0, 2, 0)  # a finite step ends the run of bad ones
    assert (log.nonfinite_run, log.nonfinite_total) == (0, 1)
    assert not skip.allows(bad, log, nan, 1.0, 3, 0)
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row"):
        skip.allows(bad, log, nan, 1.0, 4, 0)
    with pytest.raises(NonFiniteError, match="on another process .*nonfinite_policy='stop'"):
        policy("stop").allows(StepVerdict(False, True, None), RunningLog(torch.device("cpu")), torch.tensor(1.0),
                              1.0, 1, 0)
    with pytest.raises(NonFiniteError, match="DeepSpeed has applied the update"):
        policy(applied=True).allows(bad, RunningLog(torch.device("cpu")), nan, 1.0, 1, 0)


def test_the_halver_reruns_a_window_at_half_the_micro_batch_after_out_of_memory():
    pos = LoopPosition(epoch=0, batches=4, micro_batch=4, accumulation=2)
    state = SimpleNamespace(train_batch_size=4, global_step=3)
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None)
    window = [{"input_ids": torch.arange(8).view(4, 2)}, {"input_ids": torch.arange(8, 16).view(4, 2)}]
    shapes = []

    def run_window(w):
        shapes.append([b["input_ids"].shape[0] for b in w])
        if w[0]["input_ids"].shape[0] > 2:
            raise OOM
        return torch.tensor(7.0)

    ran, result = MicroBatchHalver(True, pos, state).accumulate(window, run_window, optimizer)
    assert shapes == [[4, 4], [2, 2, 2, 2]] and result == 7.0
    assert torch.equal(torch.cat([b["input_ids"] for b in ran]), torch.arange(16).view(8, 2))  # the same rows
    assert (pos.micro_batch, pos.accumulation, pos.batches, state.train_batch_size) == (2, 4, 8, 2)
    with MicroBatchHalver(True, pos, state).after_update():  # out of memory in a callback: the next windows
        raise OOM
    assert (pos.micro_batch, pos.accumulation) == (1, 8)


def test_the_halver_raises_every_other_error_and_an_odd_micro_batch():
    state = SimpleNamespace(train_batch_size=3, global_step=0)
    with pytest.raises(ValueError, match="not memory"):
        with MicroBatchHalver(True, LoopPosition(0, 0, 4, 1), state).after_update():
            raise ValueError("not memory")
    with pytest.raises(RuntimeError, match="out of memory"):  # without auto_find_batch_size
        with MicroBatchHalver(False, LoopPosition(0, 0, 4, 1), state).after_update():
            raise OOM
    with pytest.raises(RuntimeError, match="can only halve an even micro-batch"):
        with MicroBatchHalver(True, LoopPosition(0, 0, 3, 1), state).after_update():
            raise OOM


def test_a_train_call_leaves_nothing_of_its_run_on_the_trainer(tiny_llama, clm_rows, make_args):
    from stoker import Trainer
    from stoker.checkpointer import Checkpointer

    trainer = Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=1),
                      train_dataset=clm_rows(16))
    before = set(vars(trainer))
    trainer.train()
    per_run = (Run, Checkpointer, RunningLog, LoopPosition, MicroBatchHalver, NonFinitePolicy)
    assert set(vars(trainer)) == before  # train() adds no attribute
    assert not [name for name, value in vars(trainer).items() if isinstance(value, per_run)]


def test_the_step_reads_in_one_screen():
    from stoker.trainer import Trainer

    assert len(inspect.getsource(Trainer._optimizer_step).splitlines()) <= 40
