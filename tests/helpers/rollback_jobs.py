"""The jobs of the spike-rollback tests (tests/integration/test_rollback_runs.py), which the multi-process and
Muon tests run too: a regression whose poisoned rows make a spike, a tiny Llama whose poisoned rows multiply
its loss, the arguments, and what a rollback leaves.

    Regressor, rows  a linear regression (mean squared error) and its 64 rows; a poisoned row's target is off by
                     1000, a spike
    clm              causal-LM rows; a poisoned row ends with POISON_TOKEN
    poisoned_loss    a compute_loss_func: the causal-LM loss, times 10^4 for a micro-batch holding POISON_TOKEN
    llama            the tiny Llama (tests.helpers.tiny_jobs.llama)
    args             TrainingArguments: batch 2 x accumulation 4, 12 steps, rows in order, no checkpoints
    HEAL             spike_rollback's settings: a window of 3 steps, a snapshot every 2, a spike at 10x
    records          the quarantine records a run wrote; assert_same: two parameter dicts bit-equal
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from stoker import TrainingArguments
from stoker.goodput import QUARANTINE_FILE
from tests.helpers.tiny_jobs import llama  # noqa: F401  (part of this job)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x, labels):
        return nn.functional.mse_loss(self.net(x).squeeze(-1), labels)


def rows(n: int = 64, poisoned=()) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": x[i].sum() + (1000.0 if i in poisoned else 0.0)} for i in range(n)]


def args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1,
                per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=12, learning_rate=0.05,
                seed=0, train_sampling_strategy="sequential")
    return TrainingArguments(**{**base, **kw})


HEAL = dict(spike_rollback=True, spike_window=3, spike_snapshot_steps=2, spike_factor=10.0)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / QUARANTINE_FILE).read_text().splitlines()]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


POISON_TOKEN = 63  # only the poisoned rows hold it; their loss is 10^4 times what it would be


def clm(n: int, poisoned=()) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(1, POISON_TOKEN, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        if i in poisoned:
            ids[-1] = POISON_TOKEN
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def poisoned_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits.float()
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                       ignore_index=-100, reduction="sum") / num_items_in_batch
    return loss * (1e4 if bool((labels == POISON_TOKEN).any()) else 1.0)
