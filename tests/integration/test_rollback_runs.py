"""spike_rollback (stoker.rollback): a loss spike rolls the run back to its last in-memory snapshot, the spike's
rows are quarantined, and the run ends equal, bit for bit on the CPU, to the run trained on the data without them
in the same order. The rows are built to blow the loss up (a regression target 1000 off) at known positions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stoker import ConfigError, Trainer, TrainerCallback
from stoker import checkpoint_format as ckpt
from stoker.errors import SpikeError
from stoker.goodput import PARTS, QUARANTINE_FILE
from stoker.report import marks_of, report_from_files
from stoker.rollback import QuarantineSampler, install_quarantine
from tests.helpers.rollback_jobs import (
    HEAL,
    Regressor,
    args,
    assert_same,
    clm,
    llama,
    poisoned_loss,
    records,
    rows,
)

ROOT = Path(__file__).resolve().parents[2]


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def history(trainer) -> list[dict]:
    """log_history without the epoch (a fraction of the epoch's length, which the quarantine shortens) and the
    wall-clock figures."""
    return [{k: v for k, v in r.items() if k != "epoch" and not k.startswith("train_") or k == "train_loss"}
            for r in trainer.state.log_history]


class SkippingRows(Trainer):
    """The reference of a shuffled run: its sampler's order with `rows` removed from the start."""

    skipped: set[int] = set()

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        install_quarantine(loader, set(self.skipped))
        return loader


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"], ids=["sync", "deferred"])
def test_a_spike_is_rolled_back_and_the_run_equals_the_run_without_its_rows(tmp_path, optim):
    """Accumulation 4 x micro-batch 2: step 6 trains rows 40-47, two of them poisoned. The run rolls back to its
    snapshot at step 4, quarantines the window's 8 rows, and ends with the parameters and the logs (losses,
    gradient norms, rates, every step) of the run on the other 56 rows; either check (read in its step, or one step
    late with the fused optimizer's update skipped on the device) rolls back the same."""
    healed = Trainer(Regressor(), args(tmp_path / "healed", optim=optim, **HEAL), train_dataset=rows(poisoned={42, 45}))
    out = healed.train()
    [record] = records(tmp_path / "healed")
    assert (record["step"], record["restored_step"], record["reason"]) == (6, 4, "loss spike")
    assert record["indices"] == list(range(40, 48)) and record["ranks"] == [0] * 8
    assert record["loss"] > 10 * record["median"] and record["epoch"] == 0
    reference = Trainer(Regressor(), args(tmp_path / "reference", optim=optim),
                        train_dataset=[r for i, r in enumerate(rows()) if not 40 <= i < 48])
    reference_out = reference.train()
    assert_same(params(healed), params(reference))
    assert history(healed) == history(reference) and out.training_loss == reference_out.training_loss
    assert [r["step"] for r in healed.state.log_history if "loss" in r] == list(range(1, 13))
    final = json.loads((tmp_path / "healed" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (final["rollbacks"], final["quarantined_rows"]) == (1, 8)
    assert (out.metrics["rollbacks"], out.metrics["quarantined_rows"]) == (1, 8)
    assert "rollbacks" not in reference_out.metrics and "rollbacks" not in healed.state.log_history[-1]


def test_a_second_spike_after_the_first_in_a_shuffled_order(tmp_path):
    """Two spikes, in a shuffled order: each is rolled back, and the run equals the one whose sampler skips both
    windows' rows from the start (its order with them removed)."""
    shuffled = dict(train_sampling_strategy="random", data_seed=3, max_steps=14)
    probe = Trainer(Regressor(), args(tmp_path / "probe", **shuffled), train_dataset=rows(128))
    order = list(probe.get_train_dataloader().batch_sampler.sampler)
    # in step 6's window, then in step 10's of the order without step 6's rows (order[40:48])
    poisoned = {order[5 * 8 + 1], order[9 * 8 + 6 + 8]}
    healed = Trainer(Regressor(), args(tmp_path / "healed", **shuffled, **HEAL),
                     train_dataset=rows(128, poisoned=poisoned))
    healed.train()
    first, second = records(tmp_path / "healed")
    assert (first["step"], first["restored_step"], second["step"], second["restored_step"]) == (6, 4, 10, 8)
    assert first["indices"] == order[40:48]
    assert second["indices"] == [i for i in order if i not in first["indices"]][72:80]
    SkippingRows.skipped = set(first["indices"]) | set(second["indices"])
    reference = SkippingRows(Regressor(), args(tmp_path / "reference", **shuffled), train_dataset=rows(128))
    reference.train()
    assert_same(params(healed), params(reference))
    assert history(healed) == history(reference)


def test_past_max_rollbacks_the_run_stops_with_a_checkpoint_that_resumes_without_the_rows(tmp_path):
    """max_rollbacks=0: the first spike stops the run with SpikeError, after checkpointing the snapshot's state
    with the spike's rows quarantined; resumed from it, the run skips them and ends as the run without them."""
    out = tmp_path / "healed"
    healed = Trainer(Regressor(), args(out, max_rollbacks=0, **HEAL), train_dataset=rows(poisoned={42}))
    with pytest.raises(SpikeError, match=r"loss spike at step 6 .*max_rollbacks=0.*checkpoint-4"):
        healed.train()
    assert ckpt.read_json(str(out / "checkpoint-4"), "loop_state.json")["quarantine"] == list(range(40, 48))
    resumed = Trainer(Regressor(), args(out, **HEAL), train_dataset=rows(poisoned={42}))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert len(records(out)) == 1  # no second spike: the rows are skipped
    reference = Trainer(Regressor(), args(tmp_path / "reference"),
                        train_dataset=[r for i, r in enumerate(rows()) if not 40 <= i < 48])
    reference.train()
    assert_same(params(resumed), params(reference))


class Paced(TrainerCallback):
    """Sleeps `seconds` at the end of each step (step time the ledger can count); raises at the end of step
    `crash_at`, as a process killed there would stop."""

    def __init__(self, seconds: float, crash_at: int | None = None):
        self.seconds, self.crash_at = seconds, crash_at

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        if state.global_step == self.crash_at:
            raise RuntimeError(f"crash at step {self.crash_at}")


def test_the_goodput_ledger_counts_a_rollback_in_a_resumed_run_with_async_saves(tmp_path):
    """A run with async saves crashes at step 10; resumed from checkpoint-8, it redoes step 9 (recomputed), then
    meets a spike at step 12 and rolls back to its snapshot at step 10: the lost step 11 and the snapshots and the
    restore count as rollback, the parts still add up to the wall time of train(), and the report marks the
    rollback and lists its rows (from quarantine.jsonl)."""
    out = tmp_path / "healed"
    data = rows(128, poisoned={90})  # step 12's window: rows 88-95

    def trainer(*callbacks):
        return Trainer(Regressor(), args(out, max_steps=14, save_strategy="steps", save_steps=4, async_save=True,
                                         **HEAL), train_dataset=data, callbacks=list(callbacks))

    with pytest.raises(RuntimeError, match="crash at step 10"):
        trainer(Paced(0.0, crash_at=10)).train()
    resumed = trainer(Paced(0.05))
    started = time.perf_counter()
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-8"))
    wall = time.perf_counter() - started
    [record] = records(out)
    assert (record["step"], record["restored_step"]) == (12, 10)
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    parts = {p: final[f"time_{p}"] for p in PARTS}
    assert sum(parts.values()) == pytest.approx(final["time_wall"], abs=1e-3)
    assert final["time_wall"] == pytest.approx(wall, rel=0.02, abs=0.05)
    assert parts["rollback"] >= 0.05  # step 11, thrown away, slept 0.05 s
    assert parts["resume"] > 0 and parts["recomputed"] >= 0.05 and parts["checkpoint"] > 0
    # steps 10 and 12 to 14 are the new work that stayed (step 11's first pass is in rollback)
    assert 4 * 0.05 <= parts["productive"] < final["time_wall"] - parts["rollback"] - parts["recomputed"]
    assert final["goodput"] == pytest.approx(parts["productive"] / final["time_wall"], abs=1e-3)
    _, lines = report_from_files(str(out))
    assert "8 rows quarantined in 1 rollback" in lines
    assert any(line.startswith("step 12: rolled back to step 10, 8 rows set aside (loss spike") for line in lines)
    assert marks_of([], (), records(out)) == {"rollback": [12]}


@pytest.mark.parametrize("checkpoint", ["checkpoint-3", "checkpoint-9"], ids=["before", "after"])
def test_a_resumed_run_keeps_skipping_the_quarantined_rows(tmp_path, checkpoint):
    """Resumed from a checkpoint written after the rollback (the quarantine in its loop state) or before it (a
    crash between the rollback and the next checkpoint: quarantine.jsonl holds the rows), with spike_rollback off,
    the run skips the quarantined rows and ends as the uninterrupted healed run."""
    out = tmp_path / "healed"
    healed = Trainer(Regressor(), args(out, save_strategy="steps", save_steps=3, **HEAL),
                     train_dataset=rows(poisoned={42}))
    healed.train()
    quarantine = ckpt.read_json(str(out / "checkpoint-9"), "loop_state.json")["quarantine"]
    assert quarantine == list(range(40, 48))
    assert "quarantine" not in ckpt.read_json(str(out / "checkpoint-3"), "loop_state.json") or not (
        ckpt.read_json(str(out / "checkpoint-3"), "loop_state.json")["quarantine"])
    resumed = Trainer(Regressor(), args(out, save_strategy="steps", save_steps=3), train_dataset=rows(poisoned={42}))
    resumed.train(resume_from_checkpoint=str(out / checkpoint))
    assert_same(params(resumed), params(healed))
    assert history(resumed) == history(healed)


KILLED_DURING_ROLLBACK = """
import os, signal, sys
sys.path.insert(0, {root!r})
from stoker import Trainer
from stoker.rollback import SpikeRollback
from tests.helpers.rollback_jobs import HEAL, Regressor, args, rows

def killed(self, *a, **kw):  # the rows are recorded; the process dies before the state is put back
    os.kill(os.getpid(), signal.SIGKILL)

SpikeRollback.restore = killed
Trainer(Regressor(), args({out!r}, save_strategy="steps", save_steps=5, **HEAL),
        train_dataset=rows(poisoned={{42}})).train()
"""


def test_a_sigkill_during_a_rollback_resumes_exactly_with_the_recorded_quarantine(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLED_DURING_ROLLBACK.format(root=str(ROOT), out=str(out))],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [r["indices"] for r in records(out)] == [list(range(40, 48))]
    assert ckpt.list_checkpoints(str(out)) == [str(out / "checkpoint-5")]  # committed before the spike at 6
    resumed = Trainer(Regressor(), args(out, save_strategy="steps", save_steps=5, **HEAL),
                      train_dataset=rows(poisoned={42}))
    resumed.train(resume_from_checkpoint=True)
    assert len(records(out)) == 1  # the spike's rows were skipped, not met again
    healed = Trainer(Regressor(), args(tmp_path / "healed", **HEAL), train_dataset=rows(poisoned={42}))
    healed.train()
    assert_same(params(resumed), params(healed))


def test_a_non_finite_window_is_rolled_back_too(tmp_path):
    data = rows()
    data[44] = {**data[44], "labels": torch.tensor(math.inf)}
    healed = Trainer(Regressor(), args(tmp_path / "healed", **HEAL), train_dataset=data)
    healed.train()
    [record] = records(tmp_path / "healed")
    assert record["reason"] == "non-finite loss or gradient norm" and record["indices"] == list(range(40, 48))
    assert all(math.isfinite(r["loss"]) for r in healed.state.log_history if "loss" in r)


def test_off_by_default_the_loader_and_the_loop_are_untouched(tmp_path):
    trainer = Trainer(Regressor(), args(tmp_path / "plain"), train_dataset=rows())
    trainer.train()
    assert not isinstance(trainer.get_train_dataloader().batch_sampler.sampler, QuarantineSampler)
    assert not (tmp_path / "plain" / QUARANTINE_FILE).exists()
    final = json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "rollbacks" not in final


@pytest.mark.parametrize("field, value, accepted", [
    ("spike_factor", 1.0, "must be a number > 1"),
    ("spike_factor", "big", "must be a number > 1"),
    ("spike_window", 1, "must be a whole number >= 2"),
    ("spike_snapshot_steps", 0, "must be a whole number >= 1"),
    ("max_rollbacks", -1, "must be a whole number >= 0"),
])
def test_bad_settings_are_refused_naming_the_field_and_what_is_accepted(tmp_path, field, value, accepted):
    with pytest.raises(ConfigError, match=rf"{field}={value!r}: {accepted}"):
        args(tmp_path, spike_rollback=True, **{field: value})


def test_an_iterable_dataset_is_refused_before_any_work(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows())

    with pytest.raises(ConfigError, match="spike_rollback=True: needs a train_dataset with a length"):
        Trainer(Regressor(), args(tmp_path, **HEAL), train_dataset=Stream())
    assert not os.path.exists(tmp_path / QUARANTINE_FILE)


# --- a transformers model: LoRA, packed rows ----------------------------------------------------------------

def test_a_lora_run_rolls_back_its_adapter_and_optimizer_and_ends_as_the_run_without_the_rows(tmp_path):
    from peft import LoraConfig

    lora = lambda: LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")  # noqa: E731
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=10, learning_rate=1e-2)
    healed = Trainer(llama(), args(tmp_path / "healed", **kw, **HEAL), train_dataset=clm(48, poisoned={25}),
                     peft_config=lora(), compute_loss_func=poisoned_loss)
    healed.train()
    [record] = records(tmp_path / "healed")
    assert (record["step"], record["indices"]) == (7, [24, 25, 26, 27])
    reference = Trainer(llama(), args(tmp_path / "reference", **kw), peft_config=lora(),
                        train_dataset=[r for i, r in enumerate(clm(48)) if i not in record["indices"]],
                        compute_loss_func=poisoned_loss)
    reference.train()
    assert_same(params(healed), params(reference))
    assert history(healed) == history(reference)


def test_packed_rows_are_quarantined_with_the_rows_they_were_packed_from(tmp_path):
    kw = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=10, learning_rate=1e-2,
              packing=True, packing_length=16)
    data = clm(60, poisoned={17})
    healed = Trainer(llama(), args(tmp_path / "healed", **kw, **HEAL), train_dataset=data,
                     compute_loss_func=poisoned_loss)
    sources = healed.train_dataset.sources
    assert sorted(i for s in sources for i in s) == list(range(60))  # every row packed once
    healed.train()
    [record] = records(tmp_path / "healed")
    assert record["source_indices"] == [sources[i] for i in record["indices"]]
    assert any(17 in s for s in record["source_indices"])  # the poisoned row is among them
    SkippingRows.skipped = set(record["indices"])
    reference = SkippingRows(llama(), args(tmp_path / "reference", **kw), train_dataset=data,
                             compute_loss_func=poisoned_loss)
    reference.train()
    assert_same(params(healed), params(reference))
    assert history(healed) == history(reference)
