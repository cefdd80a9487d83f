"""Attention for packed and padding-free rows: every sequence attends only within itself, from boundaries the
collator computed on the host (`cu_seq_lens_q`, the cumulative sequence lengths over the micro-batch's rows laid
end to end), never from a [T, T] mask.

transformers' sdpa and eager attention keep packed sequences apart through a block-diagonal mask built from the
position_ids: every row's L^2 positions (T^2 for a padding-free micro-batch of T tokens, about 8x the attention
FLOPs of 8 rows of T/8), and the mask itself in memory. Here the model's attention is replaced, through
transformers' attention interface (`AttentionInterface.register`, selected by `attn_implementation`), by one
that computes each sequence alone, with the first kernel of these that runs:

    varlen        torch.nn.attention.varlen.varlen_attn (CUDA, bfloat16 / float16): torch's own flash kernel
    flash_attn    flash-attention 3 (flash_attn_interface) or 2 (flash_attn), when installed (CUDA)
    flex          torch's flex_attention over a block mask of the sequences, compiled (CUDA with triton)
    dense         sdpa with the block-diagonal mask made from the boundaries on the device: the last fallback,
                  said once, naming what to install
    per_sequence  sdpa over each sequence's slice, causal, no mask at all: the CPU path (flex's backward does not
                  run on a CPU, varlen_attn has no CPU kernel) and the reference the others are tested against

The choice is made once per device type and dtype (`kernel_for`) and logged once. varlen and flash_attn are the
flash kernel itself (variable length is what it does natively); flash_attn comes second only because it is a
separate CUDA build most users cannot install, while varlen ships with torch. Attention dropout (rare in causal
LMs: Llama's attention_dropout is 0) is supported by sdpa only, so a module that drops out while training takes
the dense path on a GPU.

Batches without boundaries (evaluation's padded rows, a call from a hand-written loop) are attended as sdpa would:
with their padding mask, or, for mask-free rows with restarting position_ids, with boundaries found on the device
(one read of the device per forward, which the collator's boundaries avoid).

Sequence boundaries include each row's trailing padding as one sequence of its own: transformers' dense mask makes
every pad token a one-token sequence instead. Padding carries no labels and nothing attends to it, so the loss and
every real token's output are the same either way.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn import functional as F

NAME = "stoker_varlen"  # the attn_implementation a model is switched to (stoker.packing.use_packed_attention)
KERNELS = ("varlen", "flash_attn", "flex", "dense", "per_sequence")

logger = logging.getLogger("stoker")


# --- the kernels: q [T, Hq, D], k and v [T, Hkv, D], cu [sequences + 1] int32 on q's device -> [T, Hq, D] ----------

def per_sequence(q, k, v, cu, max_len: int, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """sdpa over each sequence's slice. Reads the boundaries on the host: free on a CPU, a sync on a GPU (where
    this is only the tests' reference)."""
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           dropout_p=dropout, is_causal=causal, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
            for s, e in zip(bounds, bounds[1:], strict=False) if e > s]
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _sequence_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Which sequence each of the `total` tokens belongs to, on the device, without reading it."""
    return torch.searchsorted(cu[1:].contiguous(), torch.arange(total, device=cu.device, dtype=cu.dtype), right=True)


def dense(q, k, v, cu, max_len: int, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """sdpa with a [T, T] block-diagonal mask made on the device from the boundaries (no read)."""
    ids = _sequence_ids(cu, q.shape[0])
    mask = ids[:, None] == ids[None, :]
    if causal:
        mask = mask.tril()
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def varlen(q, k, v, cu, max_len: int, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn: flash attention over the concatenated sequences."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                       enable_gqa=q.shape[1] != k.shape[1])


def _flash_varlen_func():
    try:
        from flash_attn_interface import flash_attn_varlen_func  # flash-attention 3 (Hopper)
    except ImportError:
        from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def flash_attn(q, k, v, cu, max_len: int, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """The flash-attn package's variable-length kernel (3 where installed, else 2)."""
    out = _flash_varlen_func()(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out  # flash-attention 3 also returns the log-sum-exp


_block_masks: dict = {}


def _block_mask(cu: torch.Tensor, total: int, causal: bool):
    """flex's block mask of the sequences; made once per micro-batch (every layer gets the same `cu` tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (id(cu), total, causal)
    found = _block_masks.get(key)
    if found is not None and found[0] is cu:
        return found[1]
    ids = _sequence_ids(cu, total)

    def same_sequence(b, h, q_idx, kv_idx):
        same = ids[q_idx] == ids[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    mask = create_block_mask(same_sequence, None, None, total, total, device=cu.device)
    _block_masks.clear()  # the previous micro-batch's is done with
    _block_masks[key] = (cu, mask)
    return mask


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # uncompiled, flex attention materialises the scores it exists to avoid
    return torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention


def flex(q, k, v, cu, max_len: int, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """flex_attention with a block mask of the sequences: only blocks that hold one sequence's tokens are computed.
    Its forward runs on a CPU too (its backward does not, in torch 2.13)."""
    out = _compiled_flex()(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           block_mask=_block_mask(cu, q.shape[0], causal), scale=scale,
                           enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


_KERNEL_FUNCTIONS = {"varlen": varlen, "flash_attn": flash_attn, "flex": flex, "dense": dense,
                     "per_sequence": per_sequence}


# --- the dispatch --------------------------------------------------------------------------------------------------

def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _has_flash_attn() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("flash_attn_interface", "flash_attn"))


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


@functools.cache
def kernel_for(device_type: str, dtype: torch.dtype, dropout: bool = False) -> str:
    """The kernel packed rows attend with on this device type and dtype (one of KERNELS), logged once."""
    if device_type != "cuda":
        choice, why = "per_sequence", f"on {device_type}: sdpa over each sequence (no CUDA kernel to run here)"
    elif dropout:
        choice, why = "dense", "attention dropout is on, which only sdpa supports"
    elif dtype in (torch.float16, torch.bfloat16) and _has_varlen():
        choice, why = "varlen", "torch.nn.attention.varlen.varlen_attn"
    elif dtype in (torch.float16, torch.bfloat16) and _has_flash_attn():
        choice, why = "flash_attn", "the flash-attn package's flash_attn_varlen_func"
    elif _has_triton():
        choice, why = "flex", "flex_attention (compiled)"
    else:
        choice, why = "dense", "no variable-length kernel runs here"
    if choice == "dense":
        logger.warning("packed rows attend through a dense block-diagonal mask (%s, %s): T x T attention and mask "
                       "per micro-batch; train in bfloat16 with torch >= 2.10 (torch.nn.attention.varlen), or install "
                       "flash-attn or triton, for attention within each sequence only", why, dtype)
    else:
        logger.info("packed rows attend within each sequence through %s (%s)", choice, why)
    return choice


# --- what transformers calls -----------------------------------------------------------------------------------

def boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seq_lens and the longest sequence of mask-free rows whose position_ids restart at each sequence, found
    on the device: two reads of it (the collator's boundaries need none)."""
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts.view(position_ids.shape)[..., 0] = True  # every row starts a sequence
    cu = torch.cat([starts.nonzero().squeeze(1), flat.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """transformers' attention function (query [B, Hq, L, D], key and value [B, Hkv, L, D]) -> ([B, L, Hq, D], None):
    within each sequence of the collator's `cu_seq_lens_q`; as sdpa where the batch has none (padded rows)."""
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    position_ids = kwargs.get("position_ids")
    same_length = query.shape[2] == key.shape[2]  # no KV cache
    if cu is None and attention_mask is None and position_ids is not None and same_length:
        cu, max_len = boundaries_from_positions(position_ids.expand(query.shape[0], -1))
    if cu is None or not same_length:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, length = query.shape[0], query.shape[2]
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value))
    dropout = dropout if module.training else 0.0
    kernel = _KERNEL_FUNCTIONS[kernel_for(q.device.type, q.dtype, dropout > 0 and q.device.type == "cuda")]
    out = kernel(q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len),
                 getattr(module, "is_causal", True), scaling, dropout)
    return out.reshape(batch, length, *out.shape[1:]), None


def _packed_attention_mask(**kwargs):
    """The mask transformers builds for this attention: none for mask-free rows without a KV cache (the
    boundaries do its work), sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length") and not (
            isinstance(kwargs.get("q_offset"), int) and kwargs["q_offset"]):
        return None
    return sdpa_mask(**kwargs)


def register() -> str:
    """Registers the attention with transformers (idempotent); returns its attn_implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, _packed_attention_mask)
    return NAME
