"""How `Trainer.compute_loss` turns a micro-batch into its share of the window loss, decided once per model.

The Trainer picks one `LossComputation` when it sets a model up (`loss_computation`), from the arguments and the
model, and compute_loss calls it; nothing is decided per call from flags. Each kind returns (loss, outputs), the
loss being the micro-batch's summed item losses divided by `num_items_in_batch` (the window's target items over
every process), so that B x A micro-batches give exactly the update of one batch of B*A rows:

    ModelLoss       the model's own loss: handed num_items_in_batch where its forward divides by it (as
                    LossConvention finds out), else its mean rescaled by local items / window items (target
                    tokens, or samples for a per-sample mean), or its sum as it is
    FunctionLoss    compute_loss_func(outputs, labels, num_items_in_batch)
    SmoothedLoss    label_smoothing_factor: transformers' label smoother, summed over the window's items
    ChunkedLoss     chunked_loss: a causal LM's loss from its hidden states, a chunk at a time (stoker.chunked_loss)

With shared_prefix, a training micro-batch's common leading tokens are run once first (stoker.prefix), whichever
kind computes the loss. A Mixture-of-Experts model's load-balancing loss is weighed over the scope that
moe_aux_loss_scope names (stoker.load_balancing) where the model's own loss carries it.
"""

from __future__ import annotations

from typing import Any

import torch

from .chunked_loss import chunked_causal_lm_loss, head_bypass
from .evaluation import logits_of
from .load_balancing import LoadBalancing
from .loss_normalization import LossConvention, loss_of, smoothed_label_loss
from .prefix import shared_prefix_length, with_shared_prefix


class ModelLoss:
    """The model's own loss, normalised over the window's items. The base of the other kinds, which fall back on it
    where they do not apply (a batch without labels; the logits wanted)."""

    def __init__(self, convention: LossConvention, forward_kwargs: dict, prefix_body=None,
                 balancing: LoadBalancing | None = None):
        self.convention, self.forward_kwargs = convention, forward_kwargs
        self.label_name = convention.label_name
        self.prefix_body = prefix_body  # (decoder, cache argument name) with shared_prefix
        self.balancing = balancing  # a MoE model's load-balancing loss, in training

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """(the micro-batch's share of the window loss, the model's outputs)."""
        inputs = {**inputs, **self.forward_kwargs}
        if self.prefix_body is not None and model.training and not return_outputs:
            length = shared_prefix_length(inputs, self.label_name)
            if length:
                decoder, cache_name = self.prefix_body
                with accelerator.autocast():  # the prepared model's autocast does not cover its body alone
                    inputs = with_shared_prefix(decoder, inputs, self.label_name, length, cache_name)
        return self.compute(model, inputs, accelerator, num_items_in_batch, return_outputs)

    def compute(self, model, inputs: dict, accelerator, num_items, return_outputs: bool) -> tuple[Any, Any]:
        divides = num_items is not None and self.convention.divides_by_num_items(model, inputs, accelerator)
        outputs = model(**inputs, num_items_in_batch=num_items) if divides else model(**inputs)
        loss = loss_of(outputs)
        # a MoE model's own aux term is per micro-batch, and is not divided by num_items_in_batch: in training it
        # is taken out, and the scope's share added back (evaluation reports the model's own loss)
        balancing = self.balancing if num_items is not None and model.training else None
        if balancing is not None:
            loss = balancing.task_loss(loss, outputs)
        if num_items is not None and not divides:
            loss = self.convention.share(loss, inputs, num_items)
        if balancing is not None:
            loss = loss + balancing.aux_share(outputs, inputs, self.convention, num_items, accelerator)
        return loss, outputs


class FunctionLoss(ModelLoss):
    """compute_loss_func(outputs, labels, num_items_in_batch=...): the model is called without its labels."""

    def __init__(self, function, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.function = function

    def compute(self, model, inputs: dict, accelerator, num_items, return_outputs: bool) -> tuple[Any, Any]:
        labels = inputs.pop(self.label_name, None)
        outputs = model(**inputs)
        return self.function(outputs, labels, num_items_in_batch=num_items), outputs


class SmoothedLoss(ModelLoss):
    """label_smoothing_factor over integer labels (stoker.loss_normalization.smoothed_label_loss); an encoder-decoder
    gets the decoder inputs its labels would have made, as transformers does."""

    def __init__(self, epsilon: float, base_model, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epsilon, self.base_model = epsilon, base_model

    def compute(self, model, inputs: dict, accelerator, num_items, return_outputs: bool) -> tuple[Any, Any]:
        labels = inputs.get(self.label_name)
        if labels is None or labels.is_floating_point():  # regression targets: nothing to smooth
            return super().compute(model, inputs, accelerator, num_items, return_outputs)
        items = num_items if num_items is not None else self.convention.targets(inputs)
        del inputs[self.label_name]
        if "decoder_input_ids" not in inputs and hasattr(self.base_model, "prepare_decoder_input_ids_from_labels"):
            inputs["decoder_input_ids"] = self.base_model.prepare_decoder_input_ids_from_labels(labels=labels)
        outputs = model(**inputs)
        return smoothed_label_loss(logits_of(outputs), labels, self.epsilon, self.convention.causal, items), outputs


class ChunkedLoss(ModelLoss):
    """chunked_loss: the loss from the final hidden states and `head`'s weight, never the full logits; the model's
    own loss when the caller asks for the outputs (an evaluation that keeps its predictions needs the logits).
    `fused`: Liger's kernel computes it on a GPU (use_liger_kernel=True; stoker.chunked_loss.fused_kernel)."""

    def __init__(self, head: torch.nn.Linear, *args, fused: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.head, self.fused = head, fused
        head_bypass(head)  # registered now, before the model is prepared (and maybe compiled)

    def compute(self, model, inputs: dict, accelerator, num_items, return_outputs: bool) -> tuple[Any, Any]:
        labels = inputs.get(self.label_name)
        if labels is None or return_outputs:
            return super().compute(model, inputs, accelerator, num_items, return_outputs)
        del inputs[self.label_name]
        return chunked_causal_lm_loss(model, self.head, inputs, labels, num_items, fused=self.fused)


def loss_computation(convention: LossConvention, forward_kwargs: dict, *, chunked_head=None, compute_loss_func=None,
                     label_smoothing: float = 0.0, base_model=None, prefix_body=None,
                     balancing: LoadBalancing | None = None, fused_loss: bool = False) -> ModelLoss:
    """The one way a model's loss is computed in this Trainer (chunked_loss with compute_loss_func, or with label
    smoothing, is refused before this by trainer_checks). `balancing` weighs a MoE model's load-balancing loss,
    which only the model's own loss carries (the other kinds leave it out, as transformers does). `fused_loss`: the
    chunked loss may take Liger's kernel on a GPU (use_liger_kernel=True)."""
    common = (convention, forward_kwargs, prefix_body)
    if chunked_head is not None:
        return ChunkedLoss(chunked_head, *common, fused=fused_loss)
    if compute_loss_func is not None:
        return FunctionLoss(compute_loss_func, *common)
    if label_smoothing:
        return SmoothedLoss(label_smoothing, base_model, *common)
    return ModelLoss(*common, balancing=balancing)
