"""Invariant 2: a run resumed from any checkpoint ends bit for bit where the uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset as TorchDataset

from stoker import Trainer, TrainingArguments
from tests.helpers.tiny_jobs import llama, rows


class RowsDataset(TorchDataset):
    """A map-style torch Dataset (no datasets library) over the same rows."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def dataset(kind: str, data):
    if kind == "datasets":
        from datasets import Dataset

        return Dataset.from_list(data)
    return RowsDataset(data) if kind == "torch" else data


def make(out, data, dropout: float, logging_steps: int = 1, **kw):
    model = llama()
    model.config.attention_dropout = dropout
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout
    args = TrainingArguments(**{"output_dir": str(out), "report_to": "none", "disable_tqdm": True,
                                "logging_steps": logging_steps, "save_strategy": "steps", "save_steps": 1,
                                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 14,
                                "learning_rate": 1e-2, "seed": 3, "optim": "adamw_torch",
                                "lr_scheduler_type": "cosine", "warmup_steps": 2, **kw})
    return Trainer(model, args, train_dataset=data)


def losses_after(trainer, step):
    return [(r["step"], r["loss"]) for r in trainer.state.log_history if "loss" in r and r["step"] > step]


# 22 rows, batch 2, accumulation 2: 11 micro-batches = windows 2,2,2,2,2,1 -> 6 steps per epoch.
# Step 3 is mid-epoch, step 6 ends an epoch on a short window, step 8 is mid-way through the second epoch.
# With logging every 4 steps, a resume at step 3, 5 or 9 falls inside a logging window: the losses summed
# before the stop must come back with the checkpoint.
CASES = [
    ("list", 0.0, 0, 3, 1),
    ("list", 0.1, 0, 6, 4),
    ("torch", 0.1, 0, 8, 1),
    ("datasets", 0.1, 0, 5, 4),
    ("torch", 0.1, 2, 9, 4),
]


@pytest.mark.parametrize("kind, dropout, workers, stop, logging_steps", CASES)
def test_resume_is_exact(tmp_path, kind, dropout, workers, stop, logging_steps):
    data = dataset(kind, rows(22, seed=11))
    full = make(tmp_path / "full", data, dropout, logging_steps, dataloader_num_workers=workers)
    full.train()
    resumed = make(tmp_path / "resumed", data, dropout, logging_steps, dataloader_num_workers=workers)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{stop}"))
    assert resumed.state.global_step == 14
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert losses_after(resumed, stop) == losses_after(full, stop)
    for key, value in full.optimizer.state_dict()["state"].items():
        for name, t in value.items():
            assert torch.equal(t, resumed.optimizer.state_dict()["state"][key][name])


@pytest.mark.parametrize("stop", [3, 9])
def test_resume_is_exact_with_the_deferred_check(tmp_path, stop):
    """Fused AdamW (the default optimizer), whose update a non-finite step skips on the device: the steps between
    two saves or logs read their check one step late, every save settles it first, so a checkpoint holds what the
    synchronous check leaves and the resumed run ends bit for bit where the uninterrupted one ends (checkpoints every
    3 steps, logs every 4: step 3 and 9 fall inside a logging window)."""
    data = rows(22, seed=11)
    kw = {"optim": "adamw_torch_fused", "save_steps": 3}
    full = make(tmp_path / "full", data, 0.1, 4, **kw)
    full.train()
    resumed = make(tmp_path / "resumed", data, 0.1, 4, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{stop}"))
    assert resumed.state.global_step == 14
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert losses_after(resumed, stop) == losses_after(full, stop)
    assert [r["learning_rate"] for r in resumed.state.log_history if "loss" in r and r["step"] > stop] == [
        r["learning_rate"] for r in full.state.log_history if "loss" in r and r["step"] > stop]
