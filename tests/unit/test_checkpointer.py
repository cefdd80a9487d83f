"""The resume arithmetic of stoker.checkpointer and stoker.step's Layout, without a run: which layouts keep a
global batch, where a resumed epoch goes on, and how the logs in progress of N processes continue on M."""

from __future__ import annotations

import pytest
import torch

from stoker.checkpointer import batches_to_skip, keep_global_batch, saved_layout
from stoker.step import Layout, LogSums


def test_two_layouts_of_one_global_batch_are_the_same_batch():
    assert Layout(2, 2, 2).global_batch == Layout(1, 4, 2).global_batch == Layout(4, 1, 2).global_batch == 8
    assert Layout(2, 8, 1, split_batches=True).global_batch == 8  # the loader's batch, split over the processes
    assert str(Layout(2, 2, 2)) == "8 = 2 x 2 x 2"


def test_the_layouts_that_keep_a_global_batch_put_the_fitting_micro_batch_first():
    # micro-batch 2 is known to fit memory: on 1 process, accumulate 4 of them before anything larger
    assert [(x.micro_batch, x.accumulation) for x in Layout(2, 2, 2).keeping_global_batch(1)] == [
        (2, 4), (1, 8), (4, 2), (8, 1)]
    assert Layout(2, 2, 2).keeping_global_batch(3) == []
    assert [(x.micro_batch, x.accumulation) for x in Layout(2, 8, 1, True).keeping_global_batch(4)] == [
        (8, 1), (4, 2)]  # split: the micro-batch must divide over the 4 processes


def test_an_unkeepable_global_batch_names_the_nearest_process_counts_that_keep_it():
    assert keep_global_batch(Layout(2, 2, 2), 3) == (
        "no layout of 3 processes makes its global batch of 8: resume on 2 processes with "
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 2, on 4 processes with "
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 1, on 1 process with "
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 4")


def test_a_resumed_epoch_goes_on_at_the_checkpoints_sample_in_any_layout():
    loop = {"world_size": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "batches_in_epoch": 6, "samples_in_epoch": 24}
    assert batches_to_skip(loop, Layout(1, 4, 2), False) == 6  # 3 steps of 8 samples, whatever the split
    assert batches_to_skip(loop, Layout(3, 2, 2), False) == 4
    # another global batch (resume_mismatch='warn'): from the first micro-batch at or after sample 24
    assert batches_to_skip(loop, Layout(1, 5, 1), False) == 5
    assert batches_to_skip(loop, Layout(1, 4, 2), True) == 0  # ignore_data_skip
    # a checkpoint written before the loop state had the sample position and split_batches
    old = {k: v for k, v in loop.items() if k != "samples_in_epoch"}
    assert saved_layout(old) == Layout(2, 2, 2) and batches_to_skip(old, Layout(2, 2, 2), False) == 6


@pytest.mark.parametrize("averaged", [True, False])
def test_the_logs_in_progress_of_two_processes_continue_on_one_or_three(averaged):
    """What the next log reports (the sum over processes, divided by their number when each process's loss is a
    mean of its own) is what the checkpoint's two processes would have reported."""
    def pending(loss, tokens):
        return {"loss": torch.tensor(loss), "steps": 2, "tokens": torch.tensor(tokens), "total_loss": 1.5,
                "samples": 16, "nonfinite_total": 1, "nonfinite_run": 0}

    pendings = [pending(3.0, [10, 12]), pending(5.0, [7, 9])]
    logged = 8.0 if averaged else 4.0
    for world in (1, 3):
        shares = [LogSums.regrouped(pendings, 1, world, 1, rank, averaged) for rank in range(world)]
        total = sum(s["loss"] for s in shares)
        assert float(total if averaged else total / world) == logged
        assert sum(s["tokens"] for s in shares).tolist() == [17, 21]
        assert all((s["steps"], s["samples"], s["total_loss"], s["nonfinite_total"]) == (2, 16, 1.5, 1)
                   for s in shares)
