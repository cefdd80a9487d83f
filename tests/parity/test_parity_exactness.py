"""Exact accumulation for every model family: B x A micro-batches (the last window short) give the update of
one batch of B*A, whatever the model does with num_items_in_batch. The 2-process half of the matrix is
tests/distributed/test_distributed.py::test_two_processes_update_like_one_process_for_every_family (one torchrun
launch).
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


@pytest.mark.parametrize("family", ["shifting_module", "bert_mlm"])
def test_the_probes_run_on_two_rows_of_the_first_batch(tmp_path, family, monkeypatch):
    """A probe decides from two rows with targets (a fraction of one forward), not from the whole micro-batch;
    the verdicts are those of the whole-batch probe (the parametrized tests above)."""
    import torch

    from stoker import loss_normalization

    seen, real = [], loss_normalization._probe_forwards

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

    monkeypatch.setattr(loss_normalization, "_probe_forwards", recording)
    trainer = train_family(family, str(tmp_path), 8, per_device_train_batch_size=8, max_steps=1)
    assert trainer._convention.settled and seen and set(seen) == {2}


def test_a_probe_falls_back_to_the_whole_batch_when_no_row_decides_alone():
    """Rows whose only target is their first label cannot tell a causal shift from one row (the shifted loss
    has nothing left): the probe then gets the whole batch, as before."""
    import torch

    from stoker.loss_normalization import _probe_rows

    labels = torch.tensor([[5, -100, -100], [-100, 7, -100], [-100, -100, 9]])
    batch = {"input_ids": torch.ones(3, 3, dtype=torch.long), "labels": labels}
    assert _probe_rows(batch, labels, first_is_target=True) is batch
    two = _probe_rows(batch, labels, first_is_target=False)
    assert two["labels"].tolist() == [[-100, 7, -100], [-100, -100, 9]] and two["input_ids"].shape == (2, 3)
