"""A micro-batch's share of the window loss, as `Trainer.compute_loss` returns it: what is known of the model's
loss (`LossConvention`, whose verdicts stoker.loss.normalization finds out), the window's target items, and the
one way the loss is computed, chosen when the Trainer sets a model up (`loss_computation`); nothing is decided per
call from flags. Each kind returns (loss, outputs), the loss being the micro-batch's summed item losses divided by
`num_items_in_batch` (the window's target items over every process), so that B x A micro-batches give exactly
the update of one batch of B*A rows:

    ModelLoss         the model's own loss: handed num_items_in_batch where its forward divides by it (as
                      LossConvention finds out), else its mean rescaled by local items / window items (target
                      tokens, or samples for a per-sample mean), or its sum as it is
    FunctionLoss      compute_loss_func(outputs, labels, num_items_in_batch)
    SmoothedLoss      label_smoothing_factor (stoker.loss.smoothing), summed over the window's items
    ChunkedLoss       chunked_loss: a causal LM's loss from its hidden states, a chunk at a time (stoker.loss.chunked)
    SharedPrefixLoss  shared_prefix: a training micro-batch's common leading tokens run once first
                      (stoker.loss.prefix), then whichever kind above computes the loss

A Mixture-of-Experts model's load-balancing loss is weighed over the scope that moe_aux_loss_scope names
(stoker.loss.load_balancing) where the model's own loss carries it.

A plain step enters three functions of the package, all here: `LossConvention.window_items` once a window,
`count_targets` for each of its micro-batches, `ModelLoss.__call__` once a micro-batch. What is known of the model
is read from plain attributes, and the model's own loss is computed inline rather than through helpers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..data import IGNORE_INDEX
from .chunked import chunked_causal_lm_loss, head_bypass
from .load_balancing import LoadBalancing
from .normalization import SAMPLES, SUM, TOKENS, accepts_num_items, loss_or_none, model_family, probed
from .prefix import shared_prefix_length, with_shared_prefix
from .smoothing import LabelSmoothing

NO_LOSS = ("the model returned no loss: return a loss tensor, a dict / ModelOutput with 'loss' or a tuple with the "
           "loss first, pass labels in the batch, or give Trainer(compute_loss_func=...)")


def count_targets(batch: Mapping, label_name: str | None, causal: bool) -> int | torch.Tensor:
    """Items the loss averages over: target tokens (labels != -100, shifted by one for causal LMs) when the
    batch has labels, else the number of samples."""
    labels = batch.get(label_name) if label_name else None
    if labels is None or not isinstance(labels, torch.Tensor):
        first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
        return first.shape[0]
    if isinstance(batch.get("shift_labels"), torch.Tensor):  # shifted by the collator (padding-free batches)
        labels = batch["shift_labels"]
    elif causal:
        labels = labels[..., 1:]
    if labels.is_floating_point():
        return labels.shape[0]  # regression targets: one item per sample
    return (labels != IGNORE_INDEX).sum()


class LossConvention:
    """The loss normalisation of one model (`causal`, `honours_num_items`: True, False, or None while unknown;
    `reduction`: what the model's own loss is a mean over when it does not divide by num_items_in_batch, TOKENS,
    SAMPLES or SUM, None while unknown; `settled`: none of the three is unknown).

    `label_name` is the first of the Trainer's label_names; `forward_kwargs` what every loss forward gets
    (use_cache). With a compute_loss_func (`loss_func`) or chunked_loss (`chunked`) computing the loss, the
    model's own division never matters.
    """

    def __init__(self, model, base, label_name: str, forward_kwargs: dict, loss_func: bool, chunked: bool):
        self.label_name, self.forward_kwargs = label_name, forward_kwargs
        self.family = model_family(model) if isinstance(model, torch.nn.Module) else "other"
        # a causal LM's loss skips each row's first label, which the item count must skip too. Known from
        # transformers' model mappings; for any other model with one label per token, None until a probe of the
        # first batch tells
        self.causal = True if self.family == "causal_lm" else None if self.family == "other" and not loss_func else (
            False)
        self.own_loss = not (loss_func or chunked)
        self.honours_num_items = None if isinstance(model, torch.nn.Module) and accepts_num_items(base) else False
        self.reduction = None if isinstance(model, torch.nn.Module) and self.own_loss else TOKENS
        self._read_verdicts()

    def _read_verdicts(self) -> None:
        """Plain attributes from the verdicts, read at every window's start: `settled`, and `counted_by`,
        count_targets' arguments (rows for a per-sample mean or a sum, else target tokens)."""
        self.settled = None not in (self.causal, self.honours_num_items, self.reduction)
        self.counted_by = (None, False) if self.reduction in (SAMPLES, SUM) else (self.label_name, self.causal)

    def decide(self, model, batch: dict, accelerator) -> None:
        """Settle what is still unknown from a batch with labels (stoker.loss.normalization.probed). Called by
        every process at the same point (a window's start, an evaluation batch): the probes' forwards may hold
        collectives, and the verdicts are shared."""
        self.causal, self.honours_num_items, self.reduction = probed(
            model, batch, accelerator, self.label_name, self.forward_kwargs, self.own_loss,
            known=(self.causal, self.honours_num_items, self.reduction))
        self._read_verdicts()

    def targets(self, batch: dict) -> int | torch.Tensor:
        """The batch's target items (tokens with a label; rows for a model with one label per row, or whose loss is
        a mean over samples or a sum)."""
        return count_targets(batch, *self.counted_by)

    def window_items(self, window: list[dict], accelerator, across_devices: bool) -> torch.Tensor:
        """Target items in a whole accumulation window, summed over every process (over this process only
        unless across_devices): what every micro-batch's loss is normalised by."""
        counts = [count_targets(b, *self.counted_by) for b in window]  # as `targets`, a call fewer per micro-batch
        # counts known on the host (rows) start the sum as a fill on the device: a tensor made from a Python int
        # would be a copy from the host that waits for the GPU
        total = torch.full((), sum(c for c in counts if not isinstance(c, torch.Tensor)), dtype=torch.long,
                           device=accelerator.device)
        for c in counts:
            if isinstance(c, torch.Tensor):
                total = total + c.to(accelerator.device)
        if accelerator.num_processes > 1 and across_devices:
            total = accelerator.reduce(total, reduction="sum") // accelerator.ranks_per_count  # a batch counted once
        return total.clamp_min(1)  # an all-padding window contributes zero loss, not NaN

    def mean_share(self, loss: torch.Tensor, batch: dict, num_items) -> torch.Tensor:
        """A mean over the micro-batch's own items (the model's, or what an override of compute_loss returned)
        weighed by this batch's items / the window's: its share of the window loss. Where every micro-batch
        holds as many items, this is transformers' division by the accumulation steps; where they do not, it is
        exact."""
        return loss * (self.targets(batch) / num_items)

    def share(self, loss: torch.Tensor, batch: dict, num_items) -> torch.Tensor:
        """A micro-batch's share of the window loss, from the model's own loss when it does not divide by
        num_items_in_batch: its mean weighed by `mean_share`, or its sum as it is."""
        return loss if self.reduction == SUM else self.mean_share(loss, batch, num_items)


class ModelLoss:
    """The model's own loss, normalised over the window's items. The base of the other kinds, which fall back on it
    where they do not apply (a batch without labels; the logits wanted)."""

    def __init__(self, convention: LossConvention, forward_kwargs: dict, balancing: LoadBalancing | None = None):
        self.convention, self.forward_kwargs = convention, forward_kwargs
        self.label_name = convention.label_name
        self.balancing = balancing  # a MoE model's load-balancing loss, in training

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """(the micro-batch's share of the window loss, the model's outputs)."""
        inputs, num_items, convention = {**inputs, **self.forward_kwargs}, num_items_in_batch, self.convention
        if num_items is not None and convention.honours_num_items is None and accelerator.num_processes == 1:
            convention.decide(model, inputs, accelerator)  # compute_loss called on its own, outside the loop
        # still None: a batch without targets, whose loss only a model dividing by the count makes 0, not NaN
        divides = num_items is not None and convention.honours_num_items is not False
        outputs = model(**inputs, num_items_in_batch=num_items) if divides else model(**inputs)
        # a tensor or a transformers ModelOutput (a Mapping) read here, without a call: this runs every micro-batch
        loss = (outputs if isinstance(outputs, torch.Tensor) else outputs.get("loss") if isinstance(outputs, Mapping)
                else loss_or_none(outputs))
        if loss is None:
            raise ValueError(NO_LOSS)
        # a MoE model's own aux term is per micro-batch, and is not divided by num_items_in_batch: in training it
        # is taken out, and the scope's share added back (evaluation reports the model's own loss)
        balancing = self.balancing if num_items is not None and model.training else None
        if balancing is not None:
            loss = balancing.task_loss(loss, outputs)
        if num_items is not None and not divides:
            loss = convention.share(loss, inputs, num_items)
        if balancing is not None:
            loss = loss + balancing.aux_share(outputs, inputs, convention, num_items, accelerator)
        return loss, outputs


class FunctionLoss(ModelLoss):
    """compute_loss_func(outputs, labels, num_items_in_batch=...): the model is called without its labels."""

    def __init__(self, function, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.function = function

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """(compute_loss_func's loss, the model's outputs)."""
        inputs = {**inputs, **self.forward_kwargs}
        labels = inputs.pop(self.label_name, None)
        outputs = model(**inputs)
        return self.function(outputs, labels, num_items_in_batch=num_items_in_batch), outputs


class SmoothedLoss(ModelLoss):
    """label_smoothing_factor over integer labels (`smoother`, the Trainer's label_smoother); an encoder-decoder
    gets the decoder inputs its labels would have made, as transformers does."""

    def __init__(self, smoother: LabelSmoothing, base_model, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.smoother, self.base_model = smoother, base_model

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """(the smoothed loss over the window's items, the model's outputs); the model's own loss for regression
        targets or none."""
        labels = inputs.get(self.label_name)
        if labels is None or labels.is_floating_point():  # regression targets: nothing to smooth
            return super().__call__(model, inputs, accelerator, num_items_in_batch, return_outputs)
        inputs = {**inputs, **self.forward_kwargs}
        items = num_items_in_batch if num_items_in_batch is not None else self.convention.targets(inputs)
        del inputs[self.label_name]
        if "decoder_input_ids" not in inputs and hasattr(self.base_model, "prepare_decoder_input_ids_from_labels"):
            inputs["decoder_input_ids"] = self.base_model.prepare_decoder_input_ids_from_labels(labels=labels)
        outputs = model(**inputs)
        return self.smoother(outputs, labels, shift_labels=bool(self.convention.causal),
                             num_items_in_batch=items), outputs


class ChunkedLoss(ModelLoss):
    """chunked_loss: the loss from the final hidden states and `head`'s weight, never the full logits; the model's
    own loss when the caller asks for the outputs (an evaluation that keeps its predictions needs the logits).
    `fused`: Liger's kernel computes it on a GPU (use_liger_kernel=True; stoker.loss.chunked.fused_kernel)."""

    def __init__(self, head: torch.nn.Linear, *args, fused: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.head, self.fused = head, fused
        head_bypass(head)  # registered now, before the model is prepared (and maybe compiled)

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """(the chunked loss, the model's outputs with empty logits); the model's own loss and outputs when the
        caller wants the outputs or the batch has no labels."""
        labels = inputs.get(self.label_name)
        if labels is None or return_outputs:
            return super().__call__(model, inputs, accelerator, num_items_in_batch, return_outputs)
        inputs = {k: v for k, v in {**inputs, **self.forward_kwargs}.items() if k != self.label_name}
        return chunked_causal_lm_loss(model, self.head, inputs, labels, num_items_in_batch, fused=self.fused)


class SharedPrefixLoss:
    """shared_prefix: a training micro-batch's common leading tokens run once through `body` (the decoder, and the
    forward argument that takes its cache; stoker.loss.prefix), then `inner` computes the loss of the rest."""

    def __init__(self, inner: ModelLoss, body: tuple[torch.nn.Module, str]):
        self.inner, self.body = inner, body

    def __call__(self, model, inputs: dict, accelerator, num_items_in_batch=None,
                 return_outputs: bool = False) -> tuple[Any, Any]:
        """What `inner` returns, from the rows after their shared prefix where a training batch has one."""
        if model.training and not return_outputs:
            inputs = {**inputs, **self.inner.forward_kwargs}
            length = shared_prefix_length(inputs, self.inner.label_name)
            if length:
                decoder, cache_name = self.body
                with accelerator.autocast():  # the prepared model's autocast does not cover its body alone
                    inputs = with_shared_prefix(decoder, inputs, self.inner.label_name, length, cache_name)
        return self.inner(model, inputs, accelerator, num_items_in_batch, return_outputs)


def loss_computation(convention: LossConvention, forward_kwargs: dict, *, chunked_head=None, compute_loss_func=None,
                     smoother: LabelSmoothing | None = None, base_model=None, prefix_body=None,
                     balancing: LoadBalancing | None = None,
                     fused_loss: bool = False) -> ModelLoss | SharedPrefixLoss:
    """The one way a model's loss is computed in this Trainer (chunked_loss with compute_loss_func, or with label
    smoothing, is refused before this by trainer_checks). `smoother` is the Trainer's label_smoother (None: no
    label smoothing). `balancing` weighs a MoE model's load-balancing loss, which only the model's own loss carries
    (the other kinds leave it out, as transformers does). `fused_loss`: the chunked loss may take Liger's kernel on
    a GPU (use_liger_kernel=True). `prefix_body` (shared_prefix) runs a batch's shared prefix first."""
    common = (convention, forward_kwargs)
    if chunked_head is not None:
        computation = ChunkedLoss(chunked_head, *common, fused=fused_loss)
    elif compute_loss_func is not None:
        computation = FunctionLoss(compute_loss_func, *common)
    elif smoother is not None:
        computation = SmoothedLoss(smoother, base_model, *common)
    else:
        computation = ModelLoss(*common, balancing=balancing)
    return computation if prefix_body is None else SharedPrefixLoss(computation, prefix_body)
