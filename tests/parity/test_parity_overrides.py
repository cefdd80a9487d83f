"""compute_loss overrides written as transformers' docs and examples write them, run through transformers.Trainer
and stoker.Trainer with accumulation: the labels popped and a weighted loss computed from the outputs, the loss
summed over num_items_in_batch, transformers' `loss_is_scaled_for_ga` switch, and a model that returns no loss
of its own (with and without **kwargs in its forward, which decides whether transformers divides the override's
loss by the accumulation steps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = (1.0, 2.0, 3.0)


class Logits(nn.Module):
    """A classifier that returns only logits: the loss is the Trainer subclass's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        return {"logits": self.lin(x)}


class LogitsWithKwargs(Logits):
    def forward(self, x, labels=None, **kwargs):
        return {"logits": self.lin(x)}


def examples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, generator=g), "labels": int(torch.randint(0, 3, (), generator=g))} for _ in range(n)]


def subclass(base: type, pattern: str, scaled: bool | None) -> type:
    class Custom(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            weight = torch.tensor(WEIGHTS, device=outputs["logits"].device)
            if pattern == "summed" and num_items_in_batch is not None:
                loss = F.cross_entropy(outputs["logits"], labels, weight=weight, reduction="sum") / num_items_in_batch
            else:
                loss = F.cross_entropy(outputs["logits"], labels, weight=weight)
            return (loss, outputs) if return_outputs else loss

    if scaled is not None:
        Custom.loss_is_scaled_for_ga = scaled
    return Custom


def train(framework: str, out: str, model_class: type, pattern: str, scaled: bool | None) -> dict:
    if framework == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from stoker import Trainer, TrainingArguments
    model = model_class()
    args = TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, optim="sgd", learning_rate=0.5,
                             lr_scheduler_type="constant", seed=7, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, num_train_epochs=2, logging_steps=1, save_strategy="no",
                             eval_strategy="epoch", per_device_eval_batch_size=3, remove_unused_columns=False)
    trainer = subclass(Trainer, pattern, scaled)(model, args, train_dataset=examples(8, 1),
                                                 eval_dataset=examples(6, 2))
    trainer.train()
    predicted = trainer.predict(examples(6, 2))
    return {"weight": model.lin.weight.detach().clone(), "predictions": predicted.predictions,
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
            "eval_losses": [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]}


@pytest.mark.parametrize("model_class,pattern,scaled", [
    (Logits, "mean", None),  # transformers divides the mean by the accumulation steps (no loss kwargs)
    (LogitsWithKwargs, "mean", None),  # ... and takes it as it is (loss kwargs: "already scaled")
    (LogitsWithKwargs, "mean", False),  # the subclass says its loss is a micro-batch mean
    (LogitsWithKwargs, "summed", None),  # summed over the window's num_items_in_batch
], ids=["mean", "mean_with_kwargs", "mean_said_unscaled", "summed_over_num_items"])
def test_a_compute_loss_override_trains_evaluates_and_predicts_as_with_transformers(tmp_path, model_class, pattern,
                                                                                   scaled):
    hf = train("hf", str(tmp_path / "hf"), model_class, pattern, scaled)
    ours = train("stoker", str(tmp_path / "ours"), model_class, pattern, scaled)
    assert ours["losses"] == pytest.approx(hf["losses"], rel=1e-5)
    assert ours["eval_losses"] == pytest.approx(hf["eval_losses"], rel=1e-5)
    torch.testing.assert_close(ours["weight"], hf["weight"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(ours["predictions"]), torch.as_tensor(hf["predictions"]))
    assert not torch.equal(ours["weight"], model_class().lin.weight)  # it trained

