"""How a model's loss is normalised, found out once per model, so that accumulation and data parallelism are exact
for any model: what the loss is over (`model_family`), whether the model shifts its labels inside (a causal LM: its
first label per row is no target), whether its forward divides its summed loss by a `num_items_in_batch` it is
given, and otherwise what its own loss is a mean over (TOKENS, SAMPLES, or SUM: none).

What transformers' model mappings tell is believed; what they do not is found by probing the first batch with
labels (`probed`, which `LossConvention.decide` in stoker.loss.computation calls), since many models accept
`num_items_in_batch` and ignore it (BERT's masked-LM and token-classification heads and T5 in transformers 5
return a mean anyway). Every probe runs on two rows of that batch and leaves no trace (`_probe_forwards`)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..compilation import uncompiled
from ..data import IGNORE_INDEX


def accepts_num_items(model) -> bool:
    """Whether forward can be given num_items_in_batch at all (by name or through **kwargs); a model that says
    it does not (transformers' accepts_loss_kwargs=False) is believed."""
    if getattr(model, "accepts_loss_kwargs", None) is False:
        return False
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind == p.VAR_KEYWORD for p in params)


def loss_or_none(outputs) -> torch.Tensor | None:
    """The loss of a model's outputs: a tensor, a dict / ModelOutput's 'loss', or a tuple's first entry when it is
    a scalar (the loss first, as transformers models return tuples); None if there is none."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):  # a ModelOutput is one
        return outputs.get("loss")
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor) and (
            outputs[0].dim() == 0):
        return outputs[0]
    return getattr(outputs, "loss", None)


TOKENS, SAMPLES, SUM = "tokens", "samples", "sum"  # what a model's own loss is a mean over (SUM: none)


def probed(model, batch: dict, accelerator, label_name: str, forward_kwargs: dict, own_loss: bool,
           known: tuple[bool | None, bool | None, str | None]) -> tuple[bool | None, bool | None, str | None]:
    """(causal, honours_num_items, reduction): `known`, with what is still unknown (None) settled from a batch with
    labels where it can tell. Called by every process at the same point (a window's start, an evaluation batch),
    since the probes' forwards may hold collectives (DDP's buffer broadcast, FSDP's gathers) and the verdicts are
    shared: a process whose batch cannot tell follows the others. `label_name`, `forward_kwargs` and `own_loss`
    as LossConvention's (stoker.loss.computation)."""
    causal, honours_num_items, reduction = known

    def shared(verdict: bool | None) -> bool | None:
        votes = torch.tensor([verdict is True, verdict is False], dtype=torch.float32, device=accelerator.device)
        if accelerator.num_processes > 1:
            votes = accelerator.reduce(votes, reduction="sum")
        return False if votes[1] > 0 else True if votes[0] > 0 else None

    device = accelerator.device
    # under sequence parallelism a forward is a collective over the group's slices of a fixed number of rows, so
    # every rank probes its whole batch
    whole = getattr(accelerator, "sequence_parallel_size", 1) > 1
    labels = batch.get(label_name)
    one_per_token = isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point()
    if causal is None:
        ids = batch.get("input_ids")
        if one_per_token and isinstance(ids, torch.Tensor) and labels.shape == ids.shape:
            probe = _probe_rows(batch, labels, first_is_target=True, whole=whole)
            causal = shared(_probe_shift(model, probe, label_name, forward_kwargs, device))
        else:
            causal = False  # not one integer label per input token: nothing to shift
    if honours_num_items is None and own_loss:
        probe = _probe_rows(batch, labels, first_is_target=False, whole=whole)
        honours_num_items = shared(_probe_num_items(model, {**probe, **forward_kwargs}, device))
    if reduction is None and honours_num_items is not None:
        if honours_num_items or not one_per_token:
            reduction = TOKENS  # divides by the count it is given, or one label (item) per row
        else:
            per_sample, sum_probe = _probe_reduction(model, batch, label_name, bool(causal), forward_kwargs, device)
            per_sample = shared(per_sample)  # every process votes, whatever its batch told
            # one more forward on every process, or on none: the vote is shared
            summed = shared(_probe_sum(model, sum_probe, device)) if per_sample else False
            reduction = SUM if per_sample and summed else SAMPLES if per_sample else TOKENS
    return causal, honours_num_items, reduction


def _probe_shift(model, batch: dict, label_name: str, forward_kwargs: dict, device) -> bool | None:
    """Whether the model shifts its labels inside (token t predicting label t+1, as a causal LM does): its
    loss does not change when the first label of every row is ignored. None when the batch cannot tell (no
    row's first label is a target, or no scalar loss)."""
    labels = batch[label_name]
    if not (labels[:, 0] != -100).any():
        return None
    cut = labels.clone()
    cut[:, 0] = -100
    inputs = {**batch, **forward_kwargs}
    with _probe_forwards(model, device) as forward:
        whole = loss_or_none(forward(**inputs))
        first_ignored = loss_or_none(forward(**{**inputs, label_name: cut}))
    if whole is None and first_ignored is None:  # no loss of its own (a compute_loss override makes it):
        return False  # nothing inside shifts, its labels count as they are
    if whole is None or first_ignored is None or whole.dim() != 0 or not torch.isfinite(whole):
        return None
    return bool(torch.isclose(whole.double(), first_ignored.double(), rtol=1e-6, atol=0))


def _probe_num_items(model, inputs: dict, device) -> bool | None:
    """Whether the model's loss is its summed item losses divided by num_items_in_batch: two forwards of one
    batch, with counts 1 and 2. A head that takes **kwargs but returns a mean anyway fails it, as does a
    model that raises on the argument, and one that returns no loss (an override of compute_loss computes it
    from the outputs). None when this batch cannot tell (no targets: both losses 0 or NaN)."""
    try:
        with _probe_forwards(model, device) as forward:
            one, two = (loss_or_none(forward(**inputs, num_items_in_batch=torch.tensor(n, device=device)))
                        for n in (1, 2))
    except TypeError:
        return False
    if one is None or two is None:
        return False
    if not torch.isfinite(one) or one == 0:
        return None
    return bool(torch.isclose(one.double(), 2 * two.double(), rtol=1e-4, atol=0))


def _probe_reduction(model, batch: dict, label_name: str, causal: bool, forward_kwargs: dict,
                     device) -> tuple[bool | None, Any]:
    """Whether the model's loss is normalised per sample rather than over the batch's target tokens, from two
    rows a and b with different target counts t_a != t_b, rearranged without changing the batch's shape (so
    dropout masks stay those of each position): f(a,b) + f(b,a) - f(a,a) - f(b,b) is 0 for a per-sample loss
    (a sum or mean of per-row terms, each row divided by anything of its own), and (t_a - t_b) (f(a,a) -
    f(b,b)) / (t_a + t_b) for a mean over the target tokens. None where the rows cannot tell (equal counts,
    equal losses, or neither identity: rows that see each other, as through batch norm): the window is then
    counted in tokens, as before. Every process runs the same forwards, whatever its rows. Also returns what
    `_probe_sum` needs."""
    labels = batch[label_name]
    rows = labels.shape[0]
    counts = ((labels[:, 1:] if causal else labels) != IGNORE_INDEX).sum(1).tolist()  # each row's targets
    pairs = [(i, j) for i in range(rows) for j in range(i + 1, rows) if counts[i] and counts[j]]
    a, b = max(pairs, key=lambda p: abs(counts[p[0]] - counts[p[1]]), default=(0, min(1, rows - 1)))

    def rearranged(order: list[int]) -> dict:
        index = torch.tensor(order)
        return {**{k: v.index_select(0, index.to(v.device)) if isinstance(v, torch.Tensor) and v.dim()
                   and v.shape[0] == rows else v for k, v in batch.items()}, **forward_kwargs}

    with _probe_forwards(model, device) as forward:
        losses = [loss_or_none(forward(**rearranged(order))) for order in ([a, b], [b, a], [a, a], [b, b])]
    if any(f is None or f.dim() != 0 or not torch.isfinite(f) for f in losses):
        return None, None
    f_ab, f_ba, f_aa, f_bb = (f.double() for f in losses)
    gap = f_ab + f_ba - f_aa - f_bb
    token_gap = (counts[a] - counts[b]) * (f_aa - f_bb) / max(counts[a] + counts[b], 1)
    sum_probe = (rearranged([a, a, a, a]), f_aa)
    if abs(token_gap) <= 1e-3 * (abs(f_aa) + abs(f_bb)):
        return None, sum_probe  # a mean over tokens would look per-sample here too
    if abs(gap) <= 0.05 * abs(token_gap):
        return True, sum_probe
    return (False if abs(gap - token_gap) <= 0.05 * abs(token_gap) else None), sum_probe


def _probe_sum(model, sum_probe, device) -> bool | None:
    """Whether a per-sample loss is a sum over the samples, not their mean: four copies of row a give twice
    the loss of two (a mean gives the same). Run by every process once they agree the loss is per-sample."""
    if sum_probe is None:
        return None
    four, f_aa = sum_probe
    with _probe_forwards(model, device) as forward:
        f_aaaa = loss_or_none(forward(**four))
    if f_aaaa is None or f_aaaa.dim() != 0 or not torch.isfinite(f_aaaa):
        return None
    return bool(abs(f_aaaa.double()) > 1.5 * abs(f_aa))


def _probe_rows(batch: dict, labels, first_is_target: bool, whole: bool = False) -> dict:
    """Two rows of the batch that can decide a probe, which then costs a fraction of one forward: from the first
    row with a target after the first position (which a causal LM never scores), and with `first_is_target` a
    target at the first position too. Two rows, since a model with batch norm cannot train on one; the whole
    batch when no row qualifies (it may still decide together), or with `whole`."""
    if whole:
        return batch
    rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    first = 0
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        flat = labels.reshape(labels.shape[0], -1)
        usable = (flat[:, 1:] != -100).any(dim=1)
        if first_is_target:
            usable &= flat[:, 0] != -100
        found = usable.nonzero()
        if not len(found):
            return batch
        first = int(found[0, 0])
    return {k: v[first:first + 2] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
            for k, v in batch.items()}


@contextlib.contextmanager
def _probe_forwards(model, device):
    """A forward function for probes that leaves no trace: no gradients, the same dropout masks in every call
    and the random state as it was, and the buffers (batch-norm statistics) put back, so the run stays
    reproducible and resumable. The model stays in training mode: an eval-mode forward repacks bitsandbytes'
    4-bit CPU weights for inference only."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    # uncompiled, whether the whole model or its blocks are compiled: the probes' two rows without gradients
    # would compile graphs that training never reuses
    def forward(**inputs):
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), uncompiled():
            return model(**inputs)

    try:
        yield forward
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _transformers_task_names(kind: str) -> set[str]:
    from transformers.models.auto import modeling_auto

    names = set()
    for value in getattr(modeling_auto, f"MODEL_FOR_{kind}_MAPPING_NAMES").values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def model_family(model: nn.Module) -> str:
    """What the model's loss is over, from what the model is rather than from `loss_type` (None for GPT-2 in
    transformers 5): "causal_lm" (labels shifted inside: token t predicts label t+1), "seq2seq" (decoder
    targets, unshifted), "token" (one label per input token, unshifted: masked LM, token classification) or
    "other" (one label per sample, or a plain module). A subclass of a transformers class keeps its family.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    classes = {c.__name__ for c in type(base).__mro__ if c.__module__.startswith("transformers.")}
    if not classes or not hasattr(base, "config"):
        return "other"
    if getattr(base.config, "is_encoder_decoder", False) or classes & _transformers_task_names("SEQ_TO_SEQ_CAUSAL_LM"):
        return "seq2seq"
    if classes & _transformers_task_names("CAUSAL_LM") or getattr(base, "loss_type", None) == "ForCausalLM":
        return "causal_lm"
    if classes & (_transformers_task_names("MASKED_LM") | _transformers_task_names("TOKEN_CLASSIFICATION")):
        return "token"
    return "other"
