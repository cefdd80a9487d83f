"""compute_loss overrides written as transformers' docs and examples write them, run through transformers.Trainer
and stoker.Trainer with accumulation: the labels popped and a weighted loss computed from the outputs, the loss
summed over num_items_in_batch, transformers' `loss_is_scaled_for_ga` switch, and a model that returns no loss
of its own (with and without **kwargs in its forward, which decides whether transformers divides the override's
loss by the accumulation steps)."""

from __future__ import annotations

import re

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



# --- eval rows that only an override can feed to the model ------------------------------------------------------


def feature_rows(n: int, seed: int) -> list[dict]:
    """Rows whose input column is `features`, which Logits.forward does not take (it needs `x`): only the
    subclass's compute_loss / prediction_step / get_eval_dataloader turns them into what the model takes."""
    return [{"features": r["x"], "labels": r["labels"]} for r in examples(n, seed)]


class LogitsWithLoss(Logits):
    def forward(self, x, labels=None):
        logits = self.lin(x)
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}


def renamed(rows: list[dict]) -> dict:
    return {"x": torch.stack([r["features"] for r in rows]), "labels": torch.tensor([r["labels"] for r in rows])}


def eval_subclass(base: type, hook: str) -> type:
    class Custom(base):
        if hook == "compute_loss":
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                outputs = model(x=inputs["features"])
                loss = F.cross_entropy(outputs["logits"], inputs["labels"])
                return (loss, outputs) if return_outputs else loss
        elif hook == "prediction_step":
            def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
                model.eval()
                with torch.no_grad():
                    logits = model(x=inputs["features"])["logits"]
                    loss = F.cross_entropy(logits, inputs["labels"])
                return loss, None if prediction_loss_only else logits, inputs["labels"]
        else:
            def get_eval_dataloader(self, eval_dataset=None):
                dataset = self.eval_dataset if eval_dataset is None else eval_dataset
                return torch.utils.data.DataLoader(dataset, batch_size=self.args.eval_batch_size, collate_fn=renamed)
    return Custom


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def evaluate_with(framework: str, out: str, hook: str) -> dict:
    if framework == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from stoker import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, optim="sgd", learning_rate=0.5,
                             seed=7, per_device_train_batch_size=4, per_device_eval_batch_size=3, num_train_epochs=1,
                             save_strategy="no", remove_unused_columns=False)
    trains = hook == "compute_loss"  # the other two make only the eval batches and losses
    model = LogitsWithLoss() if hook == "get_eval_dataloader" else Logits()
    trainer = eval_subclass(Trainer, hook)(model, args, train_dataset=feature_rows(8, 1) if trains else None,
                                           eval_dataset=feature_rows(6, 2), compute_metrics=accuracy)
    if trains:
        trainer.train()
    metrics = trainer.evaluate()
    return {"metrics": {k: v for k, v in metrics.items() if k in ("eval_loss", "eval_accuracy", "epoch")},
            "weight": model.lin.weight.detach().clone()}


@pytest.mark.parametrize("hook", ["compute_loss", "prediction_step", "get_eval_dataloader"])
def test_eval_rows_an_override_feeds_to_the_model_build_and_evaluate_as_with_transformers(tmp_path, hook):
    # the constructor's probe of the eval rows stands aside where a subclass makes the eval batches or the loss
    hf = evaluate_with("hf", str(tmp_path / "hf"), hook)
    ours = evaluate_with("stoker", str(tmp_path / "ours"), hook)
    assert set(ours["metrics"]) >= {"eval_loss", "eval_accuracy"}
    assert ours["metrics"] == pytest.approx(hf["metrics"], rel=1e-5)
    torch.testing.assert_close(ours["weight"], hf["weight"], rtol=1e-5, atol=1e-6)


def test_eval_rows_the_model_cannot_take_are_still_refused_without_an_override(tmp_path):
    from stoker import Trainer, TrainingArguments
    from stoker.errors import ConfigError

    # built as transformers builds it; refused when the evaluation starts, before the model sees the rows
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", remove_unused_columns=False)
    with pytest.raises(ConfigError, match=re.escape("eval_dataset: batches have columns ['features', 'labels']; "
                                                    "Logits.forward needs ['x']")):
        Trainer(Logits(), args, eval_dataset=feature_rows(6, 2)).evaluate()
    # a subclass overriding a hook that does not touch the eval rows (predict's loader) is refused alike
    class Unrelated(Trainer):
        def get_test_dataloader(self, test_dataset):
            return super().get_test_dataloader(test_dataset)

    with pytest.raises(ConfigError, match="Logits.forward needs"):
        Unrelated(Logits(), args, eval_dataset=feature_rows(6, 2)).evaluate()
    # stoker's own Seq2SeqTrainer overrides evaluate and prediction_step, and still checks
    from stoker import Seq2SeqTrainer, Seq2SeqTrainingArguments

    with pytest.raises(ConfigError, match="Logits.forward needs"):
        Seq2SeqTrainer(Logits(), Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                          remove_unused_columns=False),
                       eval_dataset=feature_rows(6, 2)).evaluate()
