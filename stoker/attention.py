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
    per_sequence  sdpa over each sequence's slice, causal, no mask at all: the CPU's way for long rows of few
                  sequences, and the reference the others are tested against
    rows          sdpa once over the micro-batch's rows, each with its own sequences' block mask: the CPU's way for
                  short rows or rows of many sequences (`cpu_kernel`'s rule, from where one beats the other), and
                  the CPU's way under torch.compile (per_sequence reads the boundaries on the host)

The kernel is chosen once per run, where the run sets its attention up (`choose_kernel`: from the device and the
dtype attention runs in, the autocast dtype of a mixed-precision run), logged once, and kept on the model's
attention modules, so that a compiled decoder layer reads a constant rather than tracing the choice (whose cache
and log line would break its graph). The forward casts q, k and v to that dtype, as transformers' flash path
does: under autocast over float32 weights the rotary embeddings hand float32 q and k, which would otherwise never
reach a flash kernel. varlen and flash_attn are the
flash kernel itself (variable length is what it does natively), on GPUs of compute capability 8.0 or more;
flash_attn comes second only because it is a separate CUDA build most users cannot install, while varlen ships
with torch. Attention dropout (rare in causal LMs: Llama's attention_dropout is 0) is supported by sdpa only, so a
module that drops out while training takes the dense path on a GPU.

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
KERNELS = ("varlen", "flash_attn", "flex", "dense", "per_sequence", "rows")

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
    """sdpa with a [T, T] block-diagonal mask made on the device from the boundaries (no read). Grouped-query k and
    v are expanded to the query heads first: sdpa's enable_gqa with a mask rules out both fused kernels (flash takes
    no mask, memory-efficient has no GQA), and its math kernel would hold [heads, T, T] scores (out of memory near
    16k tokens); the expanded copy costs T x Hq x D per tensor instead."""
    ids = _sequence_ids(cu, q.shape[0])
    mask = ids[:, None] == ids[None, :]
    if causal:
        mask = mask.tril()
    k, v = (_expanded(x, q.shape[1]) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[0].transpose(0, 1)


def _expanded(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads (dimension 1: [T, Hkv, D] or [B, Hkv, L, D]) repeated to `heads` query heads, each query
    head's group next to it (as sdpa's enable_gqa pairs them)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


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


def rows(query, key, value, cu, causal: bool, scale, dropout: float = 0.0) -> torch.Tensor:
    """sdpa once over the micro-batch's rows as the model laid them out (query [B, Hq, L, D], key and value
    [B, Hkv, L, D] -> [B, L, Hq, D]), each row with the block mask of its own sequences made on the device from the
    boundaries (no read): each row's L^2 scores, the work transformers' sdpa does for packed rows, in one call. A
    CPU's way for rows that are short or hold many sequences (`cpu_kernel`); boundaries never cross a row (every
    row starts a sequence)."""
    batch, length = query.shape[0], query.shape[2]
    ids = _sequence_ids(cu, batch * length).view(batch, length)
    mask = ids[:, :, None] == ids[:, None, :]
    if causal:
        mask = mask.tril()
    key, value = (_expanded(x, query.shape[1]) for x in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], dropout_p=dropout, scale=scale)
    return out.transpose(1, 2)


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


def _runs_flash() -> bool:
    """Whether this CUDA device runs the flash kernels (compute capability 8.0 or more: Ampere and later)."""
    return torch.cuda.get_device_capability()[0] >= 8


HALF = (torch.float16, torch.bfloat16)  # the dtypes the flash kernels (varlen, flash_attn) take
DROPS_OUT = ("dense", "per_sequence", "rows")  # the kernels that drop out (sdpa's): others give way to dense


@functools.cache
def kernel_for(device_type: str, dtype: torch.dtype, dropout: bool = False) -> str:
    """The kernel packed rows attend with on this device type, in this dtype (the one attention runs in: the
    autocast dtype where autocast is on, `compute_dtype`), one of KERNELS, logged once. Called where a run sets its
    attention up (`choose_kernel`), never from a compiled forward: Dynamo would trace its cache and break the graph
    at its log line."""
    if device_type != "cuda":
        choice, why = "per_sequence", f"on {device_type}: sdpa over each sequence or over each row's block mask"
    elif dropout:
        choice, why = "dense", "attention dropout is on, which only sdpa supports"
    elif dtype in HALF and _has_varlen() and _runs_flash():
        choice, why = "varlen", "torch.nn.attention.varlen.varlen_attn"
    elif dtype in HALF and _has_flash_attn() and _runs_flash():
        choice, why = "flash_attn", "the flash-attn package's flash_attn_varlen_func"
    elif _has_triton():
        choice, why = "flex", "flex_attention (compiled)"
    else:
        choice, why = "dense", "no variable-length kernel runs here"
    if choice == "dense":
        logger.warning("packed rows attend through a dense block-diagonal mask (%s, %s): T x T attention and mask "
                       "per micro-batch; train in bfloat16 with torch >= 2.10 (torch.nn.attention.varlen) on a GPU "
                       "of compute capability 8.0 or more, or install flash-attn or triton, for attention within "
                       "each sequence only", why, dtype)
    else:
        logger.info("packed rows attend within each sequence through %s (%s, %s)", choice, why, dtype)
    return choice


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype where autocast is on for the device type, else x's own.
    Under autocast over float32 weights transformers' rotary embeddings hand float32 q and k (cos and sin are made
    in the hidden states' dtype), which would otherwise pick a float32 kernel (never varlen or flash)."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


# the attribute of a model's attention modules holding the kernels chosen for its run, {dtype: kernel}: a plain
# attribute, which a compiled layer reads as a constant (guarded) where a call to kernel_for would break its graph
CHOSEN = "_stoker_packed_kernels"


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers hands to the attention function: those with `is_causal` (every attention of
    transformers' attention interface has it, for sdpa's sake)."""
    return [m for m in model.modules() if hasattr(m, "is_causal")]


def choose_kernel(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> str:
    """Chooses the kernel of a run on `device` whose attention runs in `dtype` (the autocast dtype of a mixed
    precision run, else the weights'), once, before any forward and outside compiled code, and records it on the
    model's attention modules; returns it. A forward in another dtype (an evaluation without autocast) chooses
    its own at its first call."""
    modules = attention_modules(model)
    dropout = any(float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0 for m in modules)
    kind = torch.device(device).type
    kernel = kernel_for(kind, dtype, dropout and kind == "cuda")
    # one dict for every layer: a compiled layer's graph guards on it, and the layers share one graph
    chosen = {**(getattr(modules[0], CHOSEN, {}) if modules else {}), dtype: kernel}
    for m in modules:
        setattr(m, CHOSEN, chosen)
    return kernel


# On a CPU there is no variable-length kernel; sdpa runs either once over the micro-batch's rows with a block mask
# of their sequences ("rows": each row's L^2 scores, in one call batched over rows and heads) or once per sequence
# ("per_sequence": each sequence's own scores only, but a call each, per layer, forward and backward, after a read
# of the boundaries and with a copy to join the outputs). The mask's extra scores grow with the square of the row's
# length, the per-sequence calls' overhead with the number of sequences and layers: in short rows of a few
# sequences (benchmarks/packing.py --job smollm2_lora: the main job's LoRA on SmolLM2-135M, 30 layers, its rows
# packed ~2 sequences to a row) the one call trains faster end to end, and the per-sequence calls win only in rows
# long enough for the extra scores to outweigh their overhead (that benchmark runs each way forced and this rule)
ROWS_MAX_LENGTH = 512  # tokens a row: micro-batches of rows this short attend in one call


def cpu_kernel(rows: int, length: int, sequences: int, compiled: bool = False) -> str:
    """The CPU's way for a micro-batch of `rows` rows of `length` tokens holding `sequences` sequences (a row's
    trailing padding counts as one): "rows" where the rows are at most ROWS_MAX_LENGTH tokens or each is one
    sequence (its mask is then the causal one), else "per_sequence". Compiled, always "rows": per_sequence reads the
    boundaries on the host, which breaks the graph."""
    if compiled or sequences <= rows or length <= ROWS_MAX_LENGTH:
        return "rows"
    return "per_sequence"


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
    within each sequence of the collator's `cu_seq_lens_q`; as sdpa where the batch has none (padded rows). q, k
    and v are cast to the dtype attention runs in (the autocast dtype under autocast), as transformers' flash
    path does, and the kernel is the one chosen for that dtype when the run was set up (`choose_kernel`)."""
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    position_ids = kwargs.get("position_ids")
    same_length = query.shape[2] == key.shape[2]  # no KV cache
    if cu is None and attention_mask is None and position_ids is not None and same_length:
        cu, max_len = boundaries_from_positions(position_ids.expand(query.shape[0], -1))
    if cu is None or not same_length:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    dtype = compute_dtype(query)
    query, key, value = (x.to(dtype) for x in (query, key, value))
    device_type, causal = query.device.type, getattr(module, "is_causal", True)
    dropout = dropout if module.training else 0.0
    kernel = getattr(module, CHOSEN, {}).get(dtype) or kernel_for(device_type, dtype, dropout > 0 and
                                                                  device_type == "cuda")
    if dropout > 0 and kernel not in DROPS_OUT:
        kernel = "dense"
    cu = cu.to(device=query.device, dtype=torch.int32)
    batch, length = query.shape[0], query.shape[2]
    if kernel == "per_sequence":  # a CPU: one of its two ways, by the micro-batch's shape
        kernel = cpu_kernel(batch, length, cu.shape[0] - 1, torch.compiler.is_compiling())
    if kernel == "rows":
        return rows(query, key, value, cu, causal, scaling, dropout), None
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value))
    out = _KERNEL_FUNCTIONS[kernel](q, k, v, cu, int(max_len), causal, scaling, dropout)
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
