"""Label smoothing (label_smoothing_factor), computed here and nowhere else: the Trainer's own loss
(stoker.loss.computation's SmoothedLoss) and `Trainer.label_smoother`, which an override of compute_loss calls as it
would call transformers', are one `LabelSmoothing` object."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import IGNORE_INDEX
from ..evaluation import logits_of


@dataclass
class LabelSmoothing:
    """transformers' LabelSmoother, called the same way: per target token (1 - epsilon) x cross-entropy + epsilon x
    the mean negative log-likelihood over the classes, summed and divided by `num_items_in_batch` (the window's
    target count, so that accumulation stays exact), or by the batch's own target count without one.

    The log-softmax is taken in float32 whatever the logits' dtype (transformers' in theirs): bfloat16 logits
    lose the small probabilities that the smoothing term sums."""

    epsilon: float = 0.1
    ignore_index: int = IGNORE_INDEX

    def __call__(self, model_output, labels: torch.Tensor, shift_labels: bool = False,
                 num_items_in_batch=None) -> torch.Tensor:
        """The smoothed loss of `model_output`'s logits (a dict / ModelOutput's 'logits', a tuple's first entry, or
        the logits themselves) against `labels`; `shift_labels` for a causal LM, whose logits at t predict the label
        at t + 1."""
        logits = logits_of(model_output)
        if shift_labels:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        neg_log_probs = -torch.log_softmax(logits.float(), dim=-1)
        target = labels != self.ignore_index
        nll = neg_log_probs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        per_item = (1 - self.epsilon) * nll + self.epsilon * neg_log_probs.mean(-1)
        if num_items_in_batch is None:
            num_items_in_batch = target.sum()
        elif isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(per_item.device)
        return (per_item * target).sum() / num_items_in_batch
