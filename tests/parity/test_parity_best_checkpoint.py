"""transformers' own tests of the best checkpoint (tests/trainer of transformers 5: test_load_best_model_with_save,
test_best_model_checkpoint_behavior, test_save_best_checkpoint, test_load_best_model_at_end), run through
transformers.Trainer and stoker.Trainer: their assertions on which checkpoints exist at the end, how many,
best_metric / best_global_step / best_model_checkpoint and the weights loaded back, and the two trainers equal.
transformers patches its private `_evaluate` to script the metric; here a compute_metrics returns the script."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from stoker.data import PaddingCollator
from tests.parity.families import FAMILIES, rows


class Scripted:
    """compute_metrics that returns the next value of a script as eval_accuracy, one per evaluation, then its last
    value again (as transformers' evaluate_side_effect_factory)."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, prediction):
        return {"accuracy": self.values.pop(0) if len(self.values) > 1 else self.values[0]}


def train(framework: str, out: str, rows_per_epoch: int, accuracy=None, **settings) -> dict:
    if framework == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from stoker import Trainer, TrainingArguments
    values = dict(output_dir=out, report_to="none", disable_tqdm=True, optim="sgd", learning_rate=0.5,
                  lr_scheduler_type="constant", seed=7, per_device_train_batch_size=1, per_device_eval_batch_size=4,
                  num_train_epochs=1, logging_steps=1)
    model = FAMILIES["llama"](0)
    trainer = Trainer(model, TrainingArguments(**{**values, **settings}), data_collator=PaddingCollator(),
                      train_dataset=rows("llama", rows_per_epoch, 1), eval_dataset=rows("llama", 4, 2),
                      compute_metrics=Scripted(accuracy) if accuracy else None)
    trainer.train()
    s = trainer.state
    return {"checkpoints": sorted((f for f in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", f)),
                                  key=lambda f: int(f.split("-")[1])),
            "best_model_checkpoint": s.best_model_checkpoint and os.path.relpath(s.best_model_checkpoint, out),
            "best_metric": s.best_metric, "best_global_step": s.best_global_step, "global_step": s.global_step,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def both(tmp_path, *args, **settings) -> dict:
    """Run through both trainers; assert that they agree; return stoker's."""
    hf = train("hf", str(tmp_path / "hf"), *args, **settings)
    ours = train("stoker", str(tmp_path / "ours"), *args, **settings)
    for key in ("checkpoints", "best_model_checkpoint", "best_global_step", "global_step"):
        assert ours[key] == hf[key], key
    assert ours["best_metric"] == (None if hf["best_metric"] is None else pytest.approx(hf["best_metric"], rel=1e-5))
    for name, p in ours["params"].items():
        torch.testing.assert_close(p, hf["params"][name], rtol=1e-5, atol=1e-6)
    return ours


def same_weights(params: dict, folder: str) -> bool:
    saved = load_file(os.path.join(folder, "model.safetensors"))
    return all(torch.allclose(p, saved[n]) for n, p in params.items() if n in saved)


def test_load_best_model_with_save(tmp_path):
    # save and evaluate every 5 steps, 9 steps: the last step is saved too
    out = both(tmp_path / "a", 9, save_steps=5, eval_strategy="steps", eval_steps=5, max_steps=9)
    assert out["checkpoints"] == ["checkpoint-5", "checkpoint-9"]
    # with a limit of 2 and the best loaded at the end: 5 deleted, 10 (the last evaluated, loaded) and 11 kept
    out = both(tmp_path / "b", 11, save_steps=5, eval_strategy="steps", eval_steps=5, load_best_model_at_end=True,
               save_total_limit=2, max_steps=11)
    assert "checkpoint-11" in out["checkpoints"] and "checkpoint-10" in out["checkpoints"]
    assert "checkpoint-5" not in out["checkpoints"]
    assert out["best_model_checkpoint"] == "checkpoint-10"
    assert same_weights(out["params"], str(tmp_path / "b" / "ours" / out["best_model_checkpoint"]))


@pytest.mark.parametrize("case", [
    # 1. never evaluated, a checkpoint every step: no best, every checkpoint kept (transformers' test evaluates
    # every 500 steps of 24; both trainers evaluate at the last step, so here eval_strategy is "no")
    dict(settings=dict(eval_strategy="no", save_strategy="steps", save_steps=1,
                       metric_for_best_model="accuracy", greater_is_better=True), accuracy=None),
    # 2. ... with save_total_limit 1: only the last one
    dict(settings=dict(eval_strategy="no", save_strategy="steps", save_steps=1,
                       metric_for_best_model="accuracy", greater_is_better=True, save_total_limit=1), accuracy=None),
    # 3. eval and save every epoch: the best at epoch 1, every epoch's checkpoint kept
    dict(settings=dict(eval_strategy="epoch", save_strategy="epoch", metric_for_best_model="accuracy",
                       greater_is_better=True, num_train_epochs=3), accuracy=[0.59, 0.57, 0.55]),
    # 4. eval every epoch, save every step
    dict(settings=dict(eval_strategy="epoch", save_strategy="steps", save_steps=1, metric_for_best_model="accuracy",
                       greater_is_better=True, num_train_epochs=3), accuracy=[0.59, 0.57, 0.55]),
    # 5. eval and save every step, save_total_limit 1: the best (step 1) is the one left
    dict(settings=dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                       metric_for_best_model="accuracy", greater_is_better=True, save_total_limit=1,
                       num_train_epochs=3), accuracy=[0.90, 0.80, 0.70]),
    # 6. saved more often than evaluated, at other steps: a best step without a checkpoint
    dict(settings=dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2,
                       metric_for_best_model="accuracy", greater_is_better=True, num_train_epochs=3),
         accuracy=[0.90, 0.80, 0.70]),
], ids=[f"case{i}" for i in range(1, 7)])
def test_best_model_checkpoint_behavior(tmp_path, case):
    # 1 row per step; 2 steps an epoch (num_train_epochs=3 but in cases 1-2), 4 in case 6 (12 steps, a multiple of
    # the evaluation and save intervals, as transformers' 24)
    n = 4 if case["settings"].get("eval_steps") == 3 else 2
    out = both(tmp_path, n, accuracy=case["accuracy"], **case["settings"])
    steps, s = out["global_step"], case["settings"]
    if case["accuracy"] is None:
        assert out["best_metric"] is None and out["best_model_checkpoint"] is None
        assert len(out["checkpoints"]) == (1 if s.get("save_total_limit") == 1 else steps)
        assert out["checkpoints"][-1] == f"checkpoint-{steps}"
        return
    assert out["best_metric"] == pytest.approx(case["accuracy"][0])
    first_eval = {"epoch": n, "steps": s.get("eval_steps")}[s["eval_strategy"]]  # the best: the script falls
    assert out["best_global_step"] == first_eval
    if s.get("save_total_limit") == 1:
        assert out["checkpoints"] == [f"checkpoint-{first_eval}"] == [out["best_model_checkpoint"]]
    elif first_eval % s.get("save_steps", n):
        assert out["best_model_checkpoint"] is None and len(out["checkpoints"]) == steps // s["save_steps"]
    else:
        assert out["best_model_checkpoint"] == f"checkpoint-{first_eval}"
        assert len(out["checkpoints"]) == steps // s.get("save_steps", n)


@pytest.mark.parametrize("metric,accuracy", [("accuracy", [0.60, 0.65, 0.64]), ("loss", None)])
def test_save_best_checkpoint(tmp_path, metric, accuracy):
    # save_strategy "best": a checkpoint only when the metric improves; 2 at the end with the accuracy script
    # (epochs 1 and 2 improve), as in transformers' test
    out = both(tmp_path, 2, accuracy=accuracy, eval_strategy="epoch", save_strategy="best",
               metric_for_best_model=metric, num_train_epochs=3)
    if accuracy:
        assert out["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
        assert out["best_model_checkpoint"] == "checkpoint-4"
    else:  # the loss falls every epoch here: each epoch improves and saves
        assert out["best_model_checkpoint"] == out["checkpoints"][-1]


@pytest.mark.parametrize("settings", [
    dict(eval_steps=5, eval_strategy="steps", save_steps=5),
    dict(eval_steps=5, eval_strategy="steps", save_steps=5, metric_for_best_model="accuracy"),
    dict(eval_strategy="epoch", save_strategy="epoch", metric_for_best_model="accuracy"),
], ids=["eval_loss", "accuracy_steps", "accuracy_epochs"])
def test_load_best_model_at_end(tmp_path, settings):
    accuracy = [0.5, 0.7, 0.6, 0.4] if "metric_for_best_model" in settings else None
    out = both(tmp_path, 6, accuracy=accuracy, load_best_model_at_end=True, num_train_epochs=3, **settings)
    folder = str(tmp_path / "ours" / out["best_model_checkpoint"])
    assert same_weights(out["params"], folder)  # the best checkpoint's weights are the model's at the end
    if accuracy:
        assert out["best_metric"] == pytest.approx(0.7)
