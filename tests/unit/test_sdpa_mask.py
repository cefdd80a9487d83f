"""stoker.sdpa_mask: inside unpadded_attention, transformers' sdpa mask for a micro-batch the host counted as unpadded
is the causal shortcut's (none); every other mask (padding, a KV cache's offset, a sliding window, packed rows) and
every mask outside it is transformers' own."""

from __future__ import annotations

import torch

from stoker import sdpa_mask
from stoker.data import CountedBatch
from stoker.sdpa_mask import unpadded_attention


def _counted(mask: torch.Tensor) -> dict:
    batch = CountedBatch({"input_ids": torch.ones_like(mask), "attention_mask": mask})
    return dict(batch.to("cpu"))


def _mask(mask, **kw):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

    q, kv = mask.shape[1] - kw.pop("past", 0), mask.shape[1]
    args = dict(batch_size=mask.shape[0], q_length=q, kv_length=kv, q_offset=kv - q, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=mask.bool(), allow_is_causal_skip=True)
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**{**args, **kw})


def _told(batch) -> bool:
    """Whether unpadded_attention takes `batch`'s rows as unpadded."""
    with unpadded_attention(batch):
        return sdpa_mask._state["unpadded"]


def test_the_host_counts_decide_and_only_inside_the_context():
    ones, padded = _counted(torch.ones(2, 6, dtype=torch.long)), _counted(torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))
    assert _told(ones) and not _told(padded) and not sdpa_mask._state["unpadded"]
    assert not _told({"attention_mask": torch.ones(2, 6)})  # not counted on the host: read as before
    with unpadded_attention(ones):
        assert _mask(ones["attention_mask"]) is None
        # what changes the mask is left to transformers: a KV cache's offset, a sliding window, another pattern
        assert _mask(ones["attention_mask"], past=2) is not None
        assert _mask(ones["attention_mask"], local_size=4) is not None
        assert _mask(ones["attention_mask"], allow_is_causal_skip=False) is not None
    with unpadded_attention(padded):
        assert _mask(padded["attention_mask"]).shape == (2, 1, 6, 6)
    # outside: transformers' own function, which reads the mask (and skips it for ones, as before)
    assert _mask(ones["attention_mask"]) is None and _mask(padded["attention_mask"]) is not None


def test_a_sliding_window_model_keeps_its_window():
    """Mistral-style sliding attention on unpadded rows longer than the window: the logits are those of the run
    without the shortcut."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                             attn_implementation="sdpa")).eval()
    batch = _counted(torch.ones(2, 10, dtype=torch.long))
    batch["input_ids"] = torch.randint(1, 64, (2, 10))
    plain = model(**batch).logits
    with unpadded_attention(batch):
        told = model(**batch).logits
    torch.testing.assert_close(told, plain)
