"""Label smoothing (label_smoothing_factor, stoker.loss.smoothing) has one implementation: transformers'
LabelSmoother's numbers on the same logits, and the Trainer's own loss and its label_smoother are one object."""

from __future__ import annotations

import pytest
import torch
from transformers.trainer_pt_utils import LabelSmoother

from stoker import Trainer
from stoker.loss import LabelSmoothing
from tests.helpers.tiny_jobs import args, llama, rows


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("num_items", [None, 7, torch.tensor(23)], ids=["own count", "int", "tensor"])
def test_label_smoothing_is_transformers_label_smoother(shift, num_items):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 13, generator=generator)
    labels = torch.randint(0, 13, (3, 6), generator=generator)
    labels[0, :3] = labels[2, 4:] = -100
    for outputs in ({"logits": logits}, (logits,)):
        ours = LabelSmoothing(0.2)(outputs, labels, shift_labels=shift, num_items_in_batch=num_items)
        theirs = LabelSmoother(0.2)(outputs, labels, shift_labels=shift, num_items_in_batch=num_items)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_the_trainers_smoothed_loss_is_its_label_smoother(tmp_path, monkeypatch):
    """The Trainer holds no transformers LabelSmoother; its compute_loss goes through its label_smoother, whose
    number on the model's logits is transformers' LabelSmoother's over the batch's targets."""
    trainer = Trainer(llama(), args(tmp_path, label_smoothing_factor=0.2))
    assert isinstance(trainer.label_smoother, LabelSmoothing) and trainer.label_smoother.epsilon == 0.2
    assert not any(isinstance(v, LabelSmoother) for v in vars(trainer).values())
    calls = []
    real = LabelSmoothing.__call__
    monkeypatch.setattr(LabelSmoothing, "__call__", lambda self, *a, **kw: calls.append(self) or real(self, *a, **kw))
    batch = trainer.data_collator(rows(4, seed=1))
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        expected = LabelSmoother(0.2)(trainer.model(input_ids=batch["input_ids"],
                                                    attention_mask=batch["attention_mask"]),
                                      batch["labels"], shift_labels=True)
    assert calls == [trainer.label_smoother]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
