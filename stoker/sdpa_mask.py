"""What the host knows of a training micro-batch's padding, told to transformers' sdpa mask so that it need not
read the mask from the device.

For rows without padding, transformers hands sdpa no mask and `is_causal=True` (its causal shortcut, which
selects the flash kernel and skips the masked triangle), but it finds out by reading the mask on every forward
(`masking_utils._ignore_causal_mask_sdpa`: `padding_mask.sum() == numel` in a Python `if`), a host sync that on a
GPU waits for the queue to drain. Handing it no mask at all is no cheaper: it then reads the position ids on the
host to look for packed rows (`find_packed_sequence_indices`). The collator's counts (`stoker.data.RowCounts`,
taken on the host before the copy to the device) already say whether every row is attended to its end, so for
such a micro-batch the mask function that transformers looks up for sdpa returns the causal shortcut's answer
(no mask) without reading anything. Under a whole-model compile, where transformers cannot take its shortcut
while tracing, the traced graph then gets `is_causal=True` too.

The wrapper is registered once, under transformers' own name "sdpa" (`AttentionMaskInterface.register`, its
extension point), and answers only inside `unpadded_attention` for a plain causal mask (no sliding window, no
offset from a cache, no packed rows, no overlay); everywhere else, and for every other mask, it is transformers'
own function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from .data import host_counts

# whether the forward running now is over rows the host counted as unpadded: a module attribute, so that a
# whole-model graph traced through the wrapper guards on it (a graph for each answer) instead of baking one in
_state = {"unpadded": False, "installed": False}


def answers_mask(model, args, device) -> bool:
    """Whether a run's training forwards answer transformers' sdpa mask from the host's counts: a transformers model
    with sdpa attention on a CUDA device (where transformers' read of the mask waits for the GPU's queue to drain)
    or compiled (where the traced graph then keeps sdpa's causal path). Uncompiled on a CPU the read waits for
    nothing, and the step does without the counting."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return attention == "sdpa" and (device.type == "cuda" or bool(args.torch_compile))


@contextlib.contextmanager
def unpadded_attention(batch: Mapping):
    """Around a micro-batch's forward: where the host counted its rows as unpadded (its attention mask all ones,
    every row attended to its last position), transformers' sdpa mask is the causal shortcut's (none) without a
    read of the mask on the device. A mask the host did not count (none, one a compute_loss override made, a batch
    rebuilt on the way) is transformers' business as usual."""
    counts = host_counts(batch.get("attention_mask"))
    if counts is None or counts.attended is None or any(a != counts.width for a in counts.attended):
        yield
        return
    if not _state["installed"]:
        _install()
    _state["unpadded"] = True
    try:
        yield
    finally:
        _state["unpadded"] = False


def _install() -> None:
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

    original = AttentionMaskInterface._global_mapping["sdpa"]
    _state["installed"] = True
    if getattr(original, "_stoker_unpadded", False):
        return

    def sdpa_mask(*args, **kwargs):
        """transformers' sdpa mask, but none for a plain causal mask of rows counted unpadded: the skip allowed, the
        causal pattern alone (no overlay, sliding window or packed rows, each of which changes the mask function or
        turns the skip off), as many queries as keys and no offset (no KV cache)."""
        if _state["unpadded"] and not args:
            mask, q_offset = kwargs.get("attention_mask"), kwargs.get("q_offset", 0)
            q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")  # SymInts in a dynamic trace
            if (kwargs.get("allow_is_causal_skip", True) and kwargs.get("mask_function") is causal_mask_function
                    and kwargs.get("local_size") is None and q_length is not None and q_length == kv_length
                    and not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kwargs.get("kv_offset", 0) == 0
                    and (mask is None or mask.shape[-1] == kv_length)):
                return None
        return original(*args, **kwargs)

    sdpa_mask._stoker_unpadded = True
    sdpa_mask.__wrapped__ = original
    AttentionMaskInterface.register("sdpa", sdpa_mask)
