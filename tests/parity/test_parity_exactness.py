"""Exact accumulation for every model family: B x A micro-batches (the last window short) give the update of
one batch of B*A, whatever the model does with num_items_in_batch. The 2-process half of the matrix is
tests/test_distributed.py::test_two_processes_update_like_one_process_for_every_family (one torchrun launch).
"""

from __future__ import annotations

import pytest

from tests.parity.families import FAMILIES, params, train_family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_accumulation_updates_like_one_big_batch(tmp_path, family):
    # 20 rows: windows of 8, 8 and a short one of 4 (micro-batches 4+4, 4+4, 4)
    whole = train_family(family, str(tmp_path / "whole"), 20, per_device_train_batch_size=8)
    split = train_family(family, str(tmp_path / "split"), 20, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2)
    assert whole.state.global_step == split.state.global_step == 3
    a, b = params(whole), params(split)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    start = dict(FAMILIES[family](0).named_parameters())
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # the runs did move the weights
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (whole, split)]
    assert losses[0] == pytest.approx(losses[1], abs=2e-6)


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
