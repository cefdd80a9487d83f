"""Shared prompt prefixes (shared_prefix=True): the tokens that every row of a training micro-batch starts with
(a chat template's system prompt, a fixed instruction) are run through the model once, for one row, and their
keys and values are handed to the rest of each row as a KV cache.

A causal LM's token t attends only to tokens <= t, so the prefix's keys and values are the same in every row,
and computing them once changes nothing but the work: the loss and the gradients (which flow back through the
cache into the prefix's forward) are those of the unshared forward. Nothing of the prefix may be a target:
the prefix ends before the position whose hidden state predicts the first target token. Dropout, where a model
has it, draws one mask for the shared prefix instead of one per row.

No library does this for training (KV caches there serve generation, without gradients); transformers' own
cache classes carry the prefix, so every model that accepts a `past_key_values` cache can use it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..data import IGNORE_INDEX, RowCounts, forward_columns, host_counts, keep_host_counts
from .normalization import model_family

# a prefix that saves fewer tokens than this over the micro-batch is not worth a second forward call
MIN_SAVED_TOKENS = 32
# inputs that may come with input_ids and still allow a shared prefix (anything else, e.g. position_ids of
# packed rows or token_type_ids, is left alone)
SHAREABLE_INPUTS = {"input_ids", "attention_mask", "use_cache"}


def cache_argument(columns: set[str]) -> str | None:
    """The name under which a model's forward takes a KV cache (transformers 5 renames `past_key_values` to
    `cache`), or None if it takes none."""
    return next((name for name in ("cache", "past_key_values") if name in columns), None)


def shared_prefix_length(inputs: dict, label_name: str) -> int:
    """How many leading tokens every row of the micro-batch shares and may share (0: none worth sharing):
    equal input ids, all attended to, none of them (or the next token) a target, and at least one token left."""
    ids, mask, labels = inputs.get("input_ids"), inputs.get("attention_mask"), inputs.get(label_name)
    if (ids is None or labels is None or ids.dim() != 2 or ids.shape[0] < 2 or labels.shape != ids.shape
            or set(inputs) - SHAREABLE_INPUTS - {label_name}):
        return 0
    if (ids.shape[1] - 1) * (ids.shape[0] - 1) < MIN_SAVED_TOKENS:  # too short to be worth it: nothing to read
        return 0
    length = _counted_length(ids, mask, labels)
    if length is None:  # not counted on the host: read from the device
        same = (ids == ids[:1]).all(0)
        if mask is not None:
            same &= (mask != 0).all(0)
        # the hidden state at t predicts the label at t + 1: the prefix ends where the first target's predictor is;
        # the last token is never shared
        same = same[:-1] & ~(labels[:, 1:] != IGNORE_INDEX).any(0)
        # a host sync: the slices that follow need the length on the host (a shape)
        length = int(same.to(torch.int8).cumprod(0).sum())
    return length if length * (ids.shape[0] - 1) >= MIN_SAVED_TOKENS else 0


def _counted_length(ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor) -> int | None:
    """The shared length from the counts the host took of a training batch before its copy to the device
    (stoker.data.RowCounts), without reading the device; None where they are not all known. The same length as
    the device's: the ids every row shares are those every pair of neighbouring rows shares."""
    counted = [host_counts(ids), host_counts(labels)] + ([host_counts(mask)] if mask is not None else [])
    if any(c is None for c in counted):
        return None
    same = counted[0].same_as_next
    runs = [None if same is None else same[:-1], counted[1].untargeted, counted[2].attended if mask is not None else ()]
    if any(r is None for r in runs):
        return None
    return min(ids.shape[1] - 1, *(min(r) for r in runs if r))


def with_shared_prefix(decoder: nn.Module, inputs: dict, label_name: str, length: int, cache_name: str) -> dict:
    """Run the first `length` tokens of row 0 through `decoder` (the model's transformer body) and return the
    inputs (labels included) of the rest of every row, with the prefix's KV cache repeated for each row and the
    attention mask still covering the whole row."""
    ids = inputs["input_ids"]
    rows = ids.shape[0]
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    prefix = decoder(input_ids=ids[:1, :length], attention_mask=mask[:1, :length], use_cache=True)
    cache = prefix[cache_name]  # the output names it as the forward does
    cache.batch_repeat_interleave(rows)  # one copy per row; backward sums the rows' gradients into the prefix's
    labels = inputs[label_name][:, length:]
    counted = host_counts(inputs[label_name])
    if counted is not None and counted.untargeted and min(counted.untargeted) >= length:
        # no row's label 1..length is a target: the rest of each row holds all of its targets (the chunked loss's
        # count)
        keep_host_counts(labels, RowCounts(labels.shape[1], targets=counted.targets))
    return {**inputs, "input_ids": ids[:, length:], "attention_mask": mask, cache_name: cache, label_name: labels}


def shared_prefix_problems(model: nn.Module) -> list[str]:
    """Why shared_prefix=True cannot be used with this model (empty if it can)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if model_family(model) != "causal_lm":
        return [f"shared_prefix=True: {name} is not a transformers causal LM; only a causal LM's rows can share "
                "the keys and values of a prefix"]
    if cache_argument(forward_columns(base)) is None or not callable(getattr(base, "get_decoder", None)):
        return [f"shared_prefix=True: {name}'s forward takes no KV cache (past_key_values) to carry the prefix; "
                "turn shared_prefix off"]
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config.peft_type, "value", config.peft_type)
        return [f"shared_prefix=True: the {kind} adapter puts virtual tokens before every row, which "
                "a prefix run on its own would not see; turn shared_prefix off"]
    return []


def prefix_body(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(the transformer body that computes the prefix's cache, the forward argument that takes the cache), or
    None for a model that cannot share a prefix (the Trainer's input checks name why)."""
    if shared_prefix_problems(model):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), cache_argument(forward_columns(base))
