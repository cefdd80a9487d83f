"""Run one small job through transformers.Trainer and through stoker.Trainer and collect what each produced.

Both get the same model (same seed), the same rows, the same collator (stoker's padding collator, since
transformers' default one cannot pad) and the same settings: SGD at a constant rate, one optimizer step per
epoch over a batch that holds every training row (so the sampler's order cannot matter), evaluation, logging
and a checkpoint every step.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from stoker.callbacks import EVENTS
from tests.parity.families import FAMILIES, rows

TRAIN_ROWS, EVAL_ROWS = 8, 6
# what each framework logs that the other should log identically
LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss", "epoch", "step")
STATE_FIELDS = ("global_step", "epoch", "max_steps", "num_train_epochs", "logging_steps", "eval_steps",
                "save_steps", "train_batch_size", "best_metric", "best_global_step")


def settings(out: str, **overrides) -> dict:
    values = dict(output_dir=out, report_to="none", disable_tqdm=True, optim="sgd", learning_rate=0.5,
                  lr_scheduler_type="constant", max_grad_norm=1.0, seed=7, per_device_train_batch_size=TRAIN_ROWS,
                  per_device_eval_batch_size=EVAL_ROWS, num_train_epochs=2, logging_steps=1, eval_strategy="steps",
                  eval_steps=1, save_strategy="steps", save_steps=1, metric_for_best_model="eval_loss")
    values.update(overrides)
    return values


def recorder(base: type) -> object:
    """A callback on `base` (either framework's TrainerCallback) that writes down every event it sees."""
    def hook(event):
        def method(self, args, state, control, **kwargs):
            self.events.append(event)
        return method

    cls = type("Recorder", (base,), {e: hook(e) for e in EVENTS})
    cb = cls()
    cb.events = []
    return cb


def run(framework: str, family: str, out: str, **overrides) -> dict:
    """Train, evaluate and predict with `framework` ("hf" or "stoker"); return what it produced."""
    from stoker.data import PaddingCollator

    if framework == "hf":
        from transformers import Trainer, TrainerCallback, TrainingArguments
    else:
        from stoker import Trainer, TrainerCallback, TrainingArguments
    model = FAMILIES[family](0)
    rec = recorder(TrainerCallback)
    trainer = Trainer(model, TrainingArguments(**settings(out, **overrides)), train_dataset=rows(family, TRAIN_ROWS, 1),
                      eval_dataset=rows(family, EVAL_ROWS, 2), data_collator=PaddingCollator(), callbacks=[rec])
    result = trainer.train()
    predicted = trainer.predict(rows(family, EVAL_ROWS, 2))
    folders = sorted((f for f in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", f)),
                     key=lambda f: int(f.split("-")[1]))
    with open(os.path.join(out, folders[-1], "trainer_state.json")) as f:
        saved_state = json.load(f)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "train_loss": result.training_loss,
        "logs": [{k: r[k] for k in LOGGED if k in r} for r in trainer.state.log_history],
        "log_keys": [sorted(r) for r in trainer.state.log_history],
        "events": rec.events,
        "folders": folders,
        "state": {k: saved_state[k] for k in STATE_FIELDS},
        "best_model_checkpoint": os.path.basename(saved_state["best_model_checkpoint"] or ""),
        "predictions": predicted.predictions,
        "label_ids": predicted.label_ids,
        "test_loss": predicted.metrics.get("test_loss"),
    }


def flatten(predictions) -> list[np.ndarray]:
    if isinstance(predictions, (tuple, list)):
        return [a for p in predictions for a in flatten(p)]
    return [np.asarray(predictions)]


def by_hand_sgd(family: str, steps: int, lr: float = 0.5, max_grad_norm: float = 1.0) -> tuple[dict, list[float]]:
    """The oracle where transformers is wrong: `steps` SGD steps on the mean loss over every target of the
    training rows (causal LMs: each token predicts the next one), computed from the logits here. Returns the
    parameters and the loss of each step."""
    from stoker.data import PaddingCollator

    model = FAMILIES[family](0)
    batch = PaddingCollator()(rows(family, TRAIN_ROWS, 1))
    labels = batch.pop("labels")
    losses = []
    for _ in range(steps):
        logits = model(**batch, **({"labels": labels} if family in ("t5", "bart") else {})).logits  # decoder inputs
        targets = labels[:, 1:] if family in ("gpt2", "llama", "qwen2", "opt", "gpt_neox") else labels
        logits = logits[:, :-1] if targets is not labels else logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                                 ignore_index=-100)
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def assert_logs_close(ours: list[dict], theirs: list[dict], rel: float = 1e-5) -> None:
    """The same log records, key by key, numbers within rel."""
    import pytest

    assert [sorted(r) for r in ours] == [sorted(r) for r in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(other, rel=rel, abs=1e-7)
