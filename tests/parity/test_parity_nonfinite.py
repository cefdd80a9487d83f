"""Non-finite losses against transformers.Trainer. transformers' logging_nan_inf_filter (on by default) only
changes the logged loss: the update is applied. stoker skips a non-finite step (nonfinite_policy) whatever the
filter says, and stops after max_nonfinite_steps in a row (README's differences table, compatibility.md)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.integration.test_trainer_api import Scalar  # (w * x)^2, NaN where x is 999 (gradient 0)

import stoker
from stoker.errors import NonFiniteError


def framework(name: str):
    import transformers

    return transformers if name == "hf" else stoker


@pytest.mark.parametrize("order", [[999.0, 1.0], [1.0, 999.0]], ids=["nan_first", "nan_last"])
def test_a_non_finite_step_is_left_out_of_the_logged_loss_where_transformers_makes_one_up(tmp_path, order):
    """One NaN step in a logging window of two: stoker logs the mean of the finite step (its loss computed here
    by hand), transformers adds "the average of the previous losses", tr_loss / (1 + steps since the log), which
    is 0 before any finite step and half the finite one after it. The weights agree: transformers applies the
    NaN step's zero gradient, stoker skips it."""
    results = {}
    for name in ("hf", "stoker"):
        module = framework(name)
        model = Scalar()
        args = module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none", disable_tqdm=True,
                                        max_steps=2, logging_steps=2, per_device_train_batch_size=1, optim="sgd",
                                        learning_rate=0.1, lr_scheduler_type="constant", save_strategy="no",
                                        train_sampling_strategy="sequential", use_cpu=True, max_grad_norm=0.0)
        trainer = module.Trainer(model, args, train_dataset=[{"x": v} for v in order])
        trainer.train()
        results[name] = trainer.state.log_history[0]["loss"], model.w.item()
    finite_loss = (1.0 * 1.0) ** 2  # w = 1 at either step: the NaN step changes nothing
    # transformers' sum over the window: the finite loss, plus its replacement for the NaN step
    hf_sum = finite_loss + (finite_loss / 2 if order[0] == 1.0 else 0.0)
    assert results["hf"][0] == pytest.approx(hf_sum / 2)
    assert results["stoker"][0] == pytest.approx(finite_loss)
    assert results["stoker"][1] == results["hf"][1]


def test_transformers_filter_test_job_stops_in_stoker_before_the_weights_are_lost(tmp_path):
    """transformers' test_logging_inf_nan_filter: tiny GPT-2, learning rate 1e9, every step non-finite after the
    first few. transformers finishes with the filter's finite-looking log and NaN weights; stoker stops with
    NonFiniteError after max_nonfinite_steps non-finite steps in a row, its weights finite (those of the last
    finite step)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def job(module, out):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=128, n_embd=32, n_layer=3, n_head=4))
        x = torch.randint(0, 100, (128,))
        rows = [{"input_ids": x, "labels": x}] * 24  # transformers' RepeatDataset (64 rows there): 9 steps
        args = module.TrainingArguments(str(out), learning_rate=1e9, logging_steps=5, logging_nan_inf_filter=True,
                                        report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no")
        return model, module.Trainer(model, args, train_dataset=rows)

    import transformers

    model, trainer = job(transformers, tmp_path / "hf")
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history[:-1]]
    assert losses and all(math.isfinite(v) for v in losses)  # transformers' assertion
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # what the filter hides

    model, trainer = job(stoker, tmp_path / "ours")
    limit = trainer.args.max_nonfinite_steps
    with pytest.raises(NonFiniteError, match=f"{limit} non-finite steps in a row"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.state.global_step < trainer.state.max_steps


@pytest.mark.parametrize("nan_inf_filter", [True, False], ids=["filter_on", "filter_off"])
def test_a_window_of_only_non_finite_steps_logs_a_nan_loss_and_the_next_window_a_finite_one(tmp_path,
                                                                                          nan_inf_filter):
    """Both steps of the first logging window are NaN: stoker logs loss NaN (those steps had no finite loss),
    with the filter on or off; transformers makes up 0.0 with the filter on and logs NaN with it off. Either way
    a script reading log_history[-1]["loss"] finds the key. The second window's steps are finite: with the filter
    on both log the same loss (the NaN steps' gradients are zero, so transformers' applied update changes
    nothing); with it off transformers' running sum stays NaN (it resets it by subtracting it from itself), and
    every later window logs NaN, where stoker logs the window's finite loss."""
    logged = {}
    for name in ("hf", "stoker"):
        module = framework(name)
        args = module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none", disable_tqdm=True,
                                        max_steps=4, logging_steps=2, per_device_train_batch_size=1, optim="sgd",
                                        learning_rate=0.1, lr_scheduler_type="constant", save_strategy="no",
                                        train_sampling_strategy="sequential", use_cpu=True, max_grad_norm=0.0,
                                        logging_nan_inf_filter=nan_inf_filter)
        trainer = module.Trainer(Scalar(), args, train_dataset=[{"x": v} for v in (999.0, 999.0, 1.0, 1.0)])
        trainer.train()
        logged[name] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(logged["stoker"]) == 2 and math.isnan(logged["stoker"][0])
    assert logged["hf"][0] == 0.0 if nan_inf_filter else math.isnan(logged["hf"][0])
    # w = 1 at step 3, then 1 - 0.1 * 2 = 0.8 at step 4: ((1)^2 + (0.8)^2) / 2
    assert logged["stoker"][1] == pytest.approx((1.0 + 0.8 ** 2) / 2)
    if nan_inf_filter:
        assert logged["stoker"][1] == pytest.approx(logged["hf"][1])
    else:
        assert math.isnan(logged["hf"][1])
