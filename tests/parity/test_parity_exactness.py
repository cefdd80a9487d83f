"""Exact accumulation for every model family: B x A micro-batches (the last window short) give the update of
one batch of B*A, whatever the model does with num_items_in_batch. The 2-process half of the matrix is
tests/distributed/test_distributed.py::test_two_processes_update_like_one_process_for_every_family (one torchrun
launch).
"""

from __future__ import annotations

import pytest

from tests.parity.families import FAMILIES, HEADS, params, train_family


@pytest.mark.parametrize("family", list(FAMILIES) + list(HEADS))
def test_accumulation_updates_like_one_big_batch(tmp_path, family):
    # 20 rows: windows of 8, 8 and a short one of 4 (micro-batches 4+4, 4+4, 4)
    whole = train_family(family, str(tmp_path / "whole"), 20, per_device_train_batch_size=8)
    split = train_family(family, str(tmp_path / "split"), 20, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2)
    assert whole.state.global_step == split.state.global_step == 3
    a, b = params(whole), params(split)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    start = dict({**FAMILIES, **HEADS}[family](0).named_parameters())
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # the runs did move the weights
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (whole, split)]
    assert losses[0] == pytest.approx(losses[1], abs=2e-6, rel=1e-6)  # a summed CTC loss is ~100: a few float32 ulps


def one_step_update(framework: str, family: str, out: str, batch: int, accumulation: int) -> tuple[dict, object]:
    """The first update of `family` on 8 rows (SGD, lr 0.01, no clipping) by stoker.Trainer or transformers.Trainer
    (with stoker's padding collator, which pads input_values, attention_mask and labels)."""
    import transformers

    import stoker
    from stoker.data import PaddingCollator
    from tests.parity.families import rows

    module = stoker if framework == "stoker" else transformers
    model = HEADS[family](0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = module.TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, save_strategy="no",
                                    max_grad_norm=0.0, optim="sgd", learning_rate=0.01, lr_scheduler_type="constant",
                                    seed=7, max_steps=1, per_device_train_batch_size=batch, use_cpu=True,
                                    gradient_accumulation_steps=accumulation)
    trainer = module.Trainer(model, args, train_dataset=rows(family, 8, 1), data_collator=PaddingCollator())
    trainer.train()
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}, trainer


@pytest.mark.parametrize("family, reduction", [("wav2vec2_ctc_mean", "samples"), ("wav2vec2_ctc_sum", "sum")])
def test_a_per_sample_mean_or_a_sum_loss_is_exact_under_accumulation(tmp_path, family, reduction):
    """wav2vec2 CTC with ctc_loss_reduction="mean" divides each sample's loss by its own target length and averages
    over the samples: the window must be normalised by its samples, not its tokens (counting tokens, batch 4 x
    accumulation 2 moved the weights 0.97 times as far as batch 8); with "sum" the loss is not normalised at all
    (counted in tokens: 0.50 times). A probe of the first batch tells which, from what the loss does when rows are
    rearranged. transformers.Trainer's figures are in the message (2.0 for the mean: it sums the micro-batches'
    means)."""
    ratios, differences = {}, {}
    for framework in ("stoker", "transformers"):
        whole, _ = one_step_update(framework, family, str(tmp_path / f"{framework}8"), 8, 1)
        split, trainer = one_step_update(framework, family, str(tmp_path / f"{framework}4"), 4, 2)
        ratios[framework] = (sum((whole[k] * split[k]).sum() for k in whole)
                             / sum((whole[k] * whole[k]).sum() for k in whole)).item()
        differences[framework] = max((whole[k] - split[k]).abs().max().item() for k in whole)
        if framework == "stoker":
            assert trainer._convention.reduction == reduction
    message = f"4 x 2 against 8, update ratio and largest difference: {ratios}, {differences}"
    assert ratios["stoker"] == pytest.approx(1.0, abs=1e-5), message
    assert differences["stoker"] <= 1e-6, message


@pytest.mark.parametrize("family, shifts", [("shifting_module", True), ("tuple_module", False), ("gpt2", True),
                                            ("bert_mlm", False), ("t5", False)])
def test_a_model_that_shifts_its_labels_inside_is_counted_as_a_causal_lm(tmp_path, family, shifts):
    """Known families come from transformers' model mappings; a plain module's from a probe (its loss is
    unchanged when every row's first label is ignored), and its window is counted over the shifted labels."""
    trainer = train_family(family, str(tmp_path), 8, per_device_train_batch_size=8, max_steps=1)
    assert trainer._convention.causal is shifts


@pytest.mark.parametrize("family, divides", [("gpt2", True), ("llama", True), ("bert_mlm", False),
                                             ("bert_tokens", False), ("t5", False), ("tuple_module", False)])
def test_num_items_in_batch_is_passed_only_to_models_that_divide_by_it(tmp_path, family, divides):
    """The probe's verdict: transformers 5's causal-LM loss divides by num_items_in_batch; BERT's masked-LM and
    token-classification heads and T5 accept it (**kwargs) and return a mean anyway; a plain module cannot take
    it."""
    trainer = train_family(family, str(tmp_path), 8, per_device_train_batch_size=8, max_steps=1)
    assert trainer._convention.honours_num_items is divides


@pytest.mark.parametrize("family", ["shifting_module", "bert_mlm"])
def test_the_probes_run_on_two_rows_of_the_first_batch(tmp_path, family, monkeypatch):
    """A probe decides from two rows with targets (a fraction of one forward), not from the whole micro-batch;
    the verdicts are those of the whole-batch probe (the parametrized tests above)."""
    import torch

    from stoker.loss import normalization

    seen, real = [], normalization._probe_forwards

    def recording(model, device):
        context = real(model, device)
        forward = context.__enter__()

        def counted(**inputs):
            seen.append(next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[0])
            return forward(**inputs)

        class Recorded:
            def __enter__(self):
                return counted

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Recorded()

    monkeypatch.setattr(normalization, "_probe_forwards", recording)
    trainer = train_family(family, str(tmp_path), 8, per_device_train_batch_size=8, max_steps=1)
    assert trainer._convention.settled and seen and set(seen) == {2}


def test_a_probe_falls_back_to_the_whole_batch_when_no_row_decides_alone():
    """Rows whose only target is their first label cannot tell a causal shift from one row (the shifted loss
    has nothing left): the probe then gets the whole batch, as before."""
    import torch

    from stoker.loss.normalization import _probe_rows

    labels = torch.tensor([[5, -100, -100], [-100, 7, -100], [-100, -100, 9]])
    batch = {"input_ids": torch.ones(3, 3, dtype=torch.long), "labels": labels}
    assert _probe_rows(batch, labels, first_is_target=True) is batch
    two = _probe_rows(batch, labels, first_is_target=False)
    assert two["labels"].tolist() == [[-100, 7, -100], [-100, -100, 9]] and two["input_ids"].shape == (2, 3)
