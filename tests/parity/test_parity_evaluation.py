"""Evaluation and the best model as transformers.Trainer has them: batch_eval_metrics in predict(), label
smoothing refused for multi-label classification, model_init's model for a seed, and the best checkpoint,
best_metric and rotation over the grid of evaluation and save strategies."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import transformers

import stoker
from stoker.data import PaddingCollator
from stoker.goodput import PARTS
from tests.parity.families import FAMILIES, rows
from tests.parity.oracle import run

FRAMEWORKS = {"hf": transformers, "stoker": stoker}


def quiet_args(module, out, **kw):
    values = dict(output_dir=str(out), report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                  per_device_eval_batch_size=2, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant")
    values.update(kw)
    return module.TrainingArguments(**values)


class RunningAccuracy:
    """compute_metrics for batch_eval_metrics: counts per batch, the result at the last one."""

    def __init__(self):
        self.right = self.seen = 0

    def __call__(self, prediction, compute_result=False):
        chosen = np.asarray(prediction.predictions).argmax(-1)
        self.right += int((chosen == np.asarray(prediction.label_ids)).sum())
        self.seen += len(chosen)
        if not compute_result:
            return {}
        result, self.right, self.seen = {"accuracy": self.right / self.seen}, 0, 0
        return result


def test_batch_eval_metrics_in_predict_as_transformers(tmp_path):
    out = {}
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(FAMILIES["bert_sequence"](0), quiet_args(module, tmp_path / name,
                                 batch_eval_metrics=True), data_collator=PaddingCollator(),
                                 compute_metrics=RunningAccuracy())
        out[name] = trainer.predict(rows("bert_sequence", 7, 2))
    assert out["stoker"].predictions.shape == out["hf"].predictions.shape == (7, 3)
    np.testing.assert_allclose(out["stoker"].predictions, out["hf"].predictions, rtol=1e-5, atol=1e-6)
    assert out["stoker"].metrics["test_accuracy"] == out["hf"].metrics["test_accuracy"]
    np.testing.assert_array_equal(out["stoker"].label_ids, out["hf"].label_ids)


def multi_label_model():
    from transformers import BertForSequenceClassification

    from tests.parity.families import _bert_config

    torch.manual_seed(0)
    return BertForSequenceClassification(_bert_config(num_labels=3, problem_type="multi_label_classification"))


def test_label_smoothing_with_multi_label_classification_is_refused_as_transformers(tmp_path):
    data = [{"input_ids": r["input_ids"], "labels": [float(r["label"] == k) for k in range(3)]}
            for r in rows("bert_sequence", 8, 1)]
    losses = {}
    for name, module in FRAMEWORKS.items():
        for smoothing in (0.0, 0.2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer = module.Trainer(multi_label_model(), quiet_args(module, tmp_path / name, max_steps=2,
                                         logging_steps=1, per_device_train_batch_size=4,
                                         label_smoothing_factor=smoothing),
                                         train_dataset=data, data_collator=PaddingCollator())
            said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                    and "Label smoothing is not compatible with multi-label classification" in str(w.message)]
            assert len(said) == (1 if smoothing else 0), (name, smoothing)
            trainer.train()
            losses[name, smoothing] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses["stoker", 0.2] == losses["stoker", 0.0]  # the model's own loss: smoothing is off
    assert losses["stoker", 0.2] == pytest.approx(losses["hf", 0.2], rel=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("multi_label", [False, True], ids=["causal_lm", "multi_label"])
def test_label_smoother_is_transformers_attribute(tmp_path, smoothing, multi_label):
    """label_smoother is there when transformers' is, with its fields, and an override of compute_loss that calls
    it as transformers' gets transformers' loss (stoker's is its own smoother, the one its loss uses)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[0, :2] = -100
    seen = {}
    for name, module in FRAMEWORKS.items():
        model = multi_label_model() if multi_label else FAMILIES["llama"](0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = module.Trainer(model, quiet_args(module, tmp_path / name, label_smoothing_factor=smoothing))
        smoother = trainer.label_smoother
        seen[name] = None if smoother is None else (
            smoother.epsilon, smoother.ignore_index, smoother({"logits": logits}, labels, shift_labels=True).item(),
            smoother({"logits": logits}, labels, num_items_in_batch=torch.tensor(13)).item())
    if seen["hf"] is not None:
        assert seen["stoker"][:2] == seen["hf"][:2]
        assert seen["stoker"][2:] == pytest.approx(seen["hf"][2:], rel=1e-6)
    assert (seen["stoker"] is None) == (seen["hf"] is None)
    assert (seen["hf"] is None) == (multi_label or not smoothing)


def test_model_init_builds_transformers_model_for_the_seed(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    def model_init():  # random weights: only the seed decides them
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1))

    made = {}
    for name, module in FRAMEWORKS.items():
        torch.manual_seed(123)  # whatever the global RNG holds before, the Trainer's seed decides
        for seed in (5, 6):
            trainer = module.Trainer(model_init=model_init, args=quiet_args(module, tmp_path / name, seed=seed))
            made[name, seed] = [p.detach().clone() for p in trainer.model.parameters()]
    for seed in (5, 6):
        for mine, theirs in zip(made["stoker", seed], made["hf", seed], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert not torch.equal(made["stoker", 5][0], made["stoker", 6][0])


def test_model_init_with_dropout_trains_transformers_weights_for_the_seed(tmp_path):
    # dropout draws from the global RNG, which transformers' loader also draws from once per epoch: two epochs
    from transformers import LlamaConfig, LlamaForCausalLM

    def model_init():
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.3))

    made = {}
    for name, module in FRAMEWORKS.items():
        torch.manual_seed(123)
        args = quiet_args(module, tmp_path / name, seed=7, num_train_epochs=2, per_device_train_batch_size=4,
                          learning_rate=0.05)
        trainer = module.Trainer(model_init=model_init, args=args, train_dataset=rows("llama", 8, 1),
                                 data_collator=PaddingCollator())
        initial = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        made[name] = initial, [p.detach().clone() for p in trainer.model.parameters()]
    for ours, theirs in zip(made["stoker"], made["hf"], strict=True):
        for mine, their in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine, their, rtol=0, atol=0)


def test_a_seed_set_after_construction_gives_transformers_model_and_shuffle_for_it(tmp_path):
    """transformers' own test_model_init: `trainer.args.seed = 314` between two train() calls; the next call's
    model_init weights and the shuffle of the train rows follow the new seed (data_seed was not given)."""
    def model_init():
        return _tiny_llama()

    made = {}
    for name, module in FRAMEWORKS.items():
        args = quiet_args(module, tmp_path / name, seed=7, per_device_train_batch_size=2, max_steps=2,
                          learning_rate=0.05)
        trainer = module.Trainer(model_init=model_init, args=args, train_dataset=rows("llama", 8, 1),
                                 data_collator=PaddingCollator())
        trainer.train()
        trainer.args.seed = 314
        trainer.train()
        made[name] = [p.detach().clone() for p in trainer.model.parameters()]
    for mine, their in zip(made["stoker"], made["hf"], strict=True):
        torch.testing.assert_close(mine, their, rtol=1e-6, atol=1e-7)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_model_and_model_init_together_are_refused_as_transformers(tmp_path):
    for module in FRAMEWORKS.values():
        with pytest.raises(ValueError, match="requires either a `model` or `model_init` argument, but not both"):
            module.Trainer(FAMILIES["llama"](0), quiet_args(module, tmp_path), model_init=lambda: None)


GRID = [dict(eval_strategy=e, save_strategy=s, save_total_limit=limit, load_best_model_at_end=best,
             greater_is_better=greater)
        for e, s, limit, best, greater in itertools.product(("steps", "epoch"), ("steps", "epoch", "best"),
                                                            (None, 1, 2), (False, True), (False, True))
        if not (best and s not in (e, "best"))]  # refused by both: load_best_model_at_end needs matching strategies


@pytest.mark.parametrize("grid", GRID, ids=lambda g: "-".join(f"{v}" for v in g.values()))
def test_best_checkpoint_best_metric_and_rotation_equal_transformers(tmp_path, grid):
    # 3 epochs of one step; an evaluation, a save and a log every step or epoch: the same points both ways.
    # greater_is_better=True on eval_loss makes an early checkpoint the best, which rotation must keep
    settings = dict(num_train_epochs=3, **grid)
    hf = run("hf", "llama", str(tmp_path / "hf"), **settings)
    ours = run("stoker", "llama", str(tmp_path / "ours"), **settings)
    assert ours["folders"] == hf["folders"]
    assert ours["best_model_checkpoint"] == hf["best_model_checkpoint"]
    best = hf["state"]["best_metric"]
    assert ours["state"]["best_metric"] == (None if best is None else pytest.approx(best, rel=1e-5))
    assert ours["state"]["best_global_step"] == hf["state"]["best_global_step"]
    for mine, theirs in zip(ours["params"].values(), hf["params"].values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)  # the best model loaded back, or the last


def test_use_liger_kernel_evaluates_loss_only_without_the_package_as_transformers(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("liger_kernel") is None  # the case transformers 5.24 runs without it
    losses = {}
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(FAMILIES["llama"](0), quiet_args(module, tmp_path / name, use_liger_kernel=True,
                                                                  per_device_eval_batch_size=6),
                                 eval_dataset=rows("llama", 6, 2), data_collator=PaddingCollator())
        losses[name] = trainer.evaluate()["eval_loss"]
    assert losses["stoker"] == pytest.approx(losses["hf"], rel=1e-6)
    trainer = stoker.Trainer(FAMILIES["llama"](0), quiet_args(stoker, tmp_path / "train", use_liger_kernel=True),
                             train_dataset=rows("llama", 6, 1), data_collator=PaddingCollator())
    with pytest.raises(stoker.ConfigError, match="use_liger_kernel=True: training needs the liger-kernel package"):
        trainer.train()  # transformers raises ImportError there too


# ---------------------------------------------------------------------------------------------------
# evaluation in eval mode, and the model's mode afterwards, with a model that has dropout


def dropout_model():
    """bert_sequence with dropout 0.3 everywhere: an evaluation in training mode would differ from call to call."""
    from transformers import BertForSequenceClassification

    from tests.parity.families import _bert_config

    torch.manual_seed(0)
    config = _bert_config(num_labels=3)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = config.classifier_dropout = 0.3
    return BertForSequenceClassification(config)


def eval_loss_by_hand(model, data) -> float:
    """The mean cross-entropy over the rows, in eval mode, from the logits (batches of 2 rows, as quiet_args)."""
    collate = PaddingCollator()
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(data), 2):
            batch = collate(data[i:i + 2])
            labels = batch.pop("labels")
            total += torch.nn.functional.cross_entropy(model(**batch).logits, labels, reduction="sum").item()
    model.train(was_training)
    return total / len(data)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_evaluation_loop_called_directly_runs_in_eval_mode(tmp_path, name):
    """A subclass calling evaluation_loop itself (transformers' question-answering example does) gets the eval-mode
    loss, the same at every call, although the model is in training mode when it calls; the model is left in eval
    mode as transformers leaves it."""
    module = FRAMEWORKS[name]
    data = rows("bert_sequence", 6, 2)
    trainer = module.Trainer(dropout_model(), quiet_args(module, tmp_path), eval_dataset=data,
                             data_collator=PaddingCollator())
    expected = eval_loss_by_hand(trainer.model, data)
    losses = []
    for _ in range(2):
        trainer.model.train()
        output = trainer.evaluation_loop(trainer.get_eval_dataloader(), "Evaluation", prediction_loss_only=True)
        losses.append(output.metrics["eval_loss"])
    assert losses == [pytest.approx(expected, rel=1e-5)] * 2
    assert trainer.model.training is False


def test_evaluate_is_deterministic_and_leaves_the_mode_as_transformers(tmp_path):
    """evaluate() twice gives the same loss (the eval-mode one, as transformers), and the model is in the mode
    transformers leaves it in: eval after evaluate() (and after a train() that ends with an evaluation), training
    after a train() without one."""
    data = rows("bert_sequence", 6, 2)
    seen = {}
    for name, module in FRAMEWORKS.items():
        for eval_strategy in ("no", "steps"):
            trainer = module.Trainer(dropout_model(), quiet_args(module, tmp_path / name, max_steps=2,
                                     per_device_train_batch_size=4, eval_strategy=eval_strategy, eval_steps=2),
                                     train_dataset=rows("bert_sequence", 8, 1), eval_dataset=data,
                                     data_collator=PaddingCollator())
            trainer.model.train()
            first, second = trainer.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]
            after_evaluate = trainer.model.training
            trainer.train()
            seen[name, eval_strategy] = (first, second, after_evaluate, trainer.model.training)
        expected = eval_loss_by_hand(dropout_model(), data)
        assert seen[name, "no"][:2] == (pytest.approx(expected, rel=1e-5),) * 2, name
    assert [v[2:] for v in seen.values()] == [(False, True), (False, False)] * 2
    assert seen["stoker", "no"][0] == pytest.approx(seen["hf", "no"][0], rel=1e-6)


def test_prediction_step_called_directly_runs_in_eval_mode(tmp_path):
    """stoker's documented difference: prediction_step called with a model in training mode computes in eval mode
    (transformers' keeps dropout on) and puts the model back in training mode (as transformers leaves it)."""
    data = rows("bert_sequence", 2, 2)
    trainer = stoker.Trainer(dropout_model(), quiet_args(stoker, tmp_path), data_collator=PaddingCollator())
    expected = eval_loss_by_hand(trainer.model, data)
    trainer.model.train()
    batch = PaddingCollator()(data)
    losses = [trainer.prediction_step(trainer.model, batch, prediction_loss_only=True)[0].item() for _ in range(2)]
    assert losses == [pytest.approx(expected, rel=1e-5)] * 2
    assert trainer.model.training is True
    loss, logits, _ = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert not loss.requires_grad and not logits.requires_grad


# ---------------------------------------------------------------------------------------------------
# metrics carry `epoch` where transformers' log() adds it


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress"])
def test_returned_metrics_carry_epoch_as_transformers(tmp_path, disable_tqdm):
    """transformers' log() adds `epoch` to the dict it is given, so train()'s metrics and evaluate()'s carry it
    (all_results.json and eval_results.json have it) and predict()'s, never logged, do not; PrinterCallback's
    removal of total_flos from the logs it is handed shows in train()'s metrics too."""
    keys, epochs = {}, {}
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(FAMILIES["bert_sequence"](0), quiet_args(module, tmp_path / name, max_steps=3,
                                 per_device_train_batch_size=4, disable_tqdm=disable_tqdm),
                                 train_dataset=rows("bert_sequence", 8, 1), eval_dataset=rows("bert_sequence", 4, 2),
                                 data_collator=PaddingCollator())
        before = trainer.evaluate()
        trained = trainer.train().metrics
        after = trainer.evaluate()
        predicted = trainer.predict(rows("bert_sequence", 4, 2)).metrics
        keys[name] = [sorted(k for k in m if not k.endswith("_model_preparation_time"))
                      for m in (before, trained, after, predicted)]
        epochs[name] = [m.get("epoch") for m in (before, trained, after, predicted)]
    # train()'s metrics add stoker's goodput ledger (docs/goodput.md) to transformers' keys, and nothing else
    ledger = [k for k in keys["stoker"][1] if k == "goodput" or k.startswith("time_")]
    assert sorted(ledger) == sorted(["goodput", *(f"time_{part}" for part in PARTS), "time_wall"])
    keys["stoker"][1] = [k for k in keys["stoker"][1] if k not in ledger]
    assert keys["stoker"] == keys["hf"]
    assert epochs["stoker"] == epochs["hf"] == [0, 1.5, 1.5, None]  # 3 steps of 4 rows over 8 rows
    assert ("total_flos" in keys["stoker"][1]) is (not disable_tqdm)


@pytest.mark.parametrize("loss_only", [True, False], ids=["loss_only", "with_predictions"])
def test_liger_loss_only_evaluation_asks_every_forward_to_skip_logits_as_transformers(tmp_path, loss_only):
    seen = {}
    for name, module in FRAMEWORKS.items():
        model, flags = FAMILIES["llama"](0), []

        def record(_, positional, kwargs, flags=flags):  # the flag, taken out: the plain model has no such argument
            flags.append(kwargs.pop("skip_logits", None))
            return positional, kwargs

        model.register_forward_pre_hook(record, with_kwargs=True)
        trainer = module.Trainer(model, quiet_args(module, tmp_path / name, use_liger_kernel=True),
                                 eval_dataset=rows("llama", 4, 2), data_collator=PaddingCollator(),
                                 compute_metrics=None if loss_only else (lambda p: {}))
        trainer.evaluate()
        seen[name] = set(flags)
    assert seen["hf"] == ({True} if loss_only else {None})
    assert seen["stoker"] == seen["hf"]
