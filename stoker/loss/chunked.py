"""Chunked cross-entropy for causal LMs: the loss from the final hidden states and the lm_head weight, a
chunk of tokens at a time, so the [batch, seq, vocab] logits never exist (in float32 or at all).

At vocab 32k and 4k tokens a micro-batch, transformers' loss holds the float32 logits, their log-softmax
and, in backward, their gradient: three tensors of 0.5 GiB each, usually the largest allocation of a small
model's step. Here each chunk's logits (a budget of memory, `chunk_tokens_for`) are computed, turned into the
chunk's loss and, when gradients are wanted, straight into the gradients of the hidden states and of the
weight (summed in float32 in place, `_add_weight_gradient`), and dropped: the same three matmuls as the
full loss, and none of its [tokens, vocab] tensors.
Only target tokens (labels != -100 after the causal shift) are computed at all, so prompt tokens and
padding cost nothing here. How many there are is a shape, so the host must know it: the Trainer's training batches
are counted on the host before they are copied to the device (stoker.data.RowCounts), so a training step reads
nothing back. Labels without such a count (a compute_loss override's own, evaluation's) are counted on the device
before the model's forward and read once that forward is queued (`TargetCount`), so that on a GPU the host waits
for a copy queued before the forward, never for the forward itself (the GPU's queue never drains, as with a plain
`.item()` or a boolean-mask selection: three such syncs per micro-batch). Computing every position instead
(masking the loss) would need no count, at the cost of the output layer's matmuls over prompt and padding
positions: for chat rows whose answer is a tenth of the tokens, ten times that work.

Written by hand because the fused linear-cross-entropy kernels that exist (Liger's, Apple's
cut-cross-entropy) are Triton, GPU-only; this is plain torch and runs wherever the model does. Liger's kernel
computes the same sum instead only where the run opts in (use_liger_kernel=True) and the model is on a GPU
(`fused_kernel`): it reads the device twice per micro-batch (its count of target tokens in the forward, a check of
the incoming gradient in the backward), each a wait for everything queued, and it has not been measured faster
than these chunks; asked to, it sums the weight's gradient in float32 as these chunks do.

The Trainer uses it with `chunked_loss=True`: `chunked_causal_lm_loss` runs the whole (possibly DDP-wrapped,
compiled, peft) model with its lm_head short-circuited, so every wrapper still sees its forward, then
applies the chunked loss to the hidden states the lm_head would have received.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

from ..data import IGNORE_INDEX, host_target_count
from .normalization import model_family

logger = logging.getLogger("stoker")

# A chunk is as many target tokens as their logits fit in a memory budget: each token's row of logits costs
# vocab x (4 + 2) bytes (the float32 logits, turned in place into the softmax's gradient, and its 16-bit copy for
# the matmuls; 8 bytes in a float32 run). On a GPU the budget is an eighth of the memory free at the first call
# (cached per device), so that the output layer's matmuls run over thousands of rows: 2,790 tokens at a 128k
# vocabulary with 2 GiB, against 65 with the fixed 2**23 logits this used to take. Every chunk reads the whole
# output layer's weight, so fewer chunks are less memory traffic: at a Llama-3-8B head (128k x 4096, 1 GiB in
# bfloat16) and 16k target tokens, 6 chunks instead of 250. Larger chunks would save little more traffic and
# take memory the activations need.
CPU_CHUNK_BYTES = 2**28        # 256 MiB on a CPU (256 tokens at 128k in float32, 4,096 at 8k in bfloat16)
GPU_CHUNK_BYTES = (2**28, 2**31)  # an eighth of the free memory, clamped to 256 MiB .. 2 GiB
MAX_CHUNK_TOKENS = 16384       # beyond this the matmuls are as efficient as they get, and the budget is wasted


@functools.cache
def _gpu_chunk_budget(index: int) -> int:
    free, _ = torch.cuda.mem_get_info(index)  # a driver query, no wait for the stream
    low, high = GPU_CHUNK_BYTES
    return int(min(max(free // 8, low), high))


def chunk_tokens_for(vocab: int, device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """Target tokens per chunk at this vocabulary: the chunk's logits within the device's budget."""
    budget = _gpu_chunk_budget(device.index or 0) if device.type == "cuda" else CPU_CHUNK_BYTES
    per_token = vocab * (4 + (dtype.itemsize if dtype.itemsize < 4 else 4))
    return max(1, min(MAX_CHUNK_TOKENS, budget // per_token))


_OUT_DTYPE_MATMUL = [True]  # torch.addmm(out_dtype=float32) on CUDA; set False (and said) if this torch refuses it


def _add_weight_gradient(grad_w: torch.Tensor, probs: torch.Tensor, low: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w += probs.T @ h, summed in grad_w's (float32) precision without a [vocab, hidden] temporary: a
    16-bit product cast and added would be one per chunk, the size of the output layer's weight."""
    if h.dtype == grad_w.dtype:
        grad_w.addmm_(probs.t(), h)
        return
    if h.is_cuda and _out_dtype_matmul(grad_w, low, h):
        return
    # a float32 matmul from the float32 softmax gradient: a [chunk, hidden] copy of h, no [vocab, hidden] one
    grad_w.addmm_(probs.t(), h.to(grad_w.dtype))


def _out_dtype_matmul(grad_w: torch.Tensor, low: torch.Tensor, h: torch.Tensor) -> bool:
    """grad_w += low.T @ h by cuBLAS: 16-bit inputs, the float32 accumulator read and written in place (beta = 1).
    False where this torch build refuses out_dtype: said once, and not tried again in this process."""
    if not _OUT_DTYPE_MATMUL[0]:
        return False
    try:
        torch.addmm(grad_w, low.t(), h, out_dtype=grad_w.dtype, out=grad_w)
        return True
    except (RuntimeError, TypeError) as e:
        _OUT_DTYPE_MATMUL[0] = False
        logger.warning("chunked_loss: this torch build refuses torch.addmm(out_dtype=%s) (%s); the output layer's "
                       "weight gradient is summed by a float32 matmul instead, at float32 matmul speed and with a "
                       "float32 copy of each chunk's hidden states", grad_w.dtype, e)
        return False


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # float32, or float64 for float64 inputs


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of cross_entropy(hidden @ weight.T + bias, targets); every target is valid.

    The gradients are computed in the forward pass, from the same chunk of logits as the loss, and kept
    (their sizes are those of hidden, weight and bias); backward only scales them by the incoming gradient.
    Recomputing each chunk's logits in backward instead would cost a fourth matmul of the output layer
    (about a quarter more work there) for no memory saved: the weight's gradient has to exist at the start
    of backward either way, while every activation is still alive.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, want_grads):
        n, acc = hidden.shape[0], _accumulation_dtype(hidden)
        need_h, need_w = want_grads and ctx.needs_input_grad[0], want_grads and ctx.needs_input_grad[1]
        need_b = want_grads and bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # summed over chunks in (at least) float32: a bfloat16 running sum would lose what one matmul keeps
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, n, chunk):
            h, t = hidden[s:s + chunk], targets[s:s + chunk]
            logits = nn.functional.linear(h, weight, bias).to(acc)
            # one [chunk, vocab] buffer throughout: log-sum-exp, softmax and its gradient are made in place
            picked = logits.gather(1, t[:, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()
            norm = probs.sum(dim=-1, keepdim=True)
            total += (top + norm.log()).sum() - picked.sum()
            if not (need_h or need_w or need_b):
                continue
            # d(lse - logit[target]) / d logits = softmax - one_hot(target)
            probs.div_(norm)
            probs[torch.arange(h.shape[0], device=h.device), t] -= 1
            if need_b:
                grad_b += probs.sum(0)
            low = probs.to(hidden.dtype)
            if need_h:
                grad_h[s:s + chunk] = low @ weight
            if need_w:
                _add_weight_gradient(grad_w, probs, low, h)
            del low
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if need_w else None,
                              grad_b.to(bias.dtype) if need_b else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # scaled in place: a scaled copy would hold a second weight-sized gradient for a moment
        if getattr(ctx, "done", False):
            raise RuntimeError("chunked cross-entropy: backward ran twice through the same loss (retain_graph=True "
                               "is not supported); compute the loss again")
        ctx.done = True
        scaled = [g.mul_(grad_total.to(g.dtype)) if g is not None else None for g in ctx.saved_tensors]
        return (*scaled, None, None, None)


def _shifted(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """The labels the positions are scored against, flattened (token t + 1's label at t when `shift`)."""
    if shift:
        labels = nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return labels.reshape(-1)


class TargetCount:
    """How many target tokens `labels` holds, started before the model's forward and read after it is queued.

    On a GPU the count is copied into pinned host memory without waiting, behind an event: `wait()` then waits
    for that copy only, which the stream reaches before the forward queued after it, so the GPU keeps working
    while the host reads. Elsewhere it is read as it is (on the CPU a read costs nothing)."""

    def __init__(self, labels: torch.Tensor, shift: bool = True):
        count = (_shifted(labels, shift) != IGNORE_INDEX).sum()
        self._ready = None
        if count.device.type == "cuda":
            self._count = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._count.copy_(count, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._count = count

    def wait(self) -> int:
        if self._ready is not None:
            self._ready.synchronize()
        return int(self._count)  # a host tensor on a GPU run


@functools.cache
def _liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None

    def loss_sum(hidden, weight, targets, bias):
        # accum_dtype: the weight's gradient summed over chunks in float32; left None, Liger sums it in the
        # weight's dtype (bfloat16 loses what each chunk's matmul kept)
        out = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=IGNORE_INDEX,
                                               reduction="sum", accum_dtype=torch.float32)
        return (out[0] if isinstance(out, tuple) else out).float()  # (loss, z_loss) in some versions

    return loss_sum


def fused_kernel(device_type: str, opted_in: bool = False):
    """Liger's fused linear cross-entropy (Triton) where the run opts in (use_liger_kernel=True), it is installed
    and the tensors are on a GPU: the same sum of token losses over the same target rows, with its chunks and its
    gradients made in its kernels, at two host reads a micro-batch. None otherwise (then stoker's own chunks)."""
    return _liger() if opted_in and device_type == "cuda" else None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          num_items_in_batch=None, bias: torch.Tensor | None = None, shift: bool = True,
                          chunk_tokens: int | None = None, compute_dtype: torch.dtype | None = None,
                          num_targets: int | None = None, fused: bool = False) -> torch.Tensor:
    """Causal-LM cross-entropy of `hidden @ weight.T + bias` against labels, without materialising logits.

    hidden [..., T, H], labels [..., T] with -100 for ignored positions; shift=True predicts token t+1 from
    position t (as transformers' ForCausalLMLoss). Returns sum of token losses / num_items_in_batch, or the
    mean over target tokens when num_items_in_batch is None, like transformers. compute_dtype is the
    precision of the lm_head matmul (an autocast dtype); the reduction is always float32. `num_targets`, the
    labels' target count (TargetCount), saves reading it here: on a GPU a read that waits for everything queued.
    fused=True lets Liger's kernel compute the sum on a GPU (`fused_kernel`).
    """
    labels = _shifted(labels, shift).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    keep = labels != IGNORE_INDEX
    if num_targets is None:
        num_targets = int(keep.sum())
    # only target tokens are worth a row of logits; with their number known, selecting them has a shape known
    # on the host (a boolean-mask selection would read it from the device, and its backward again)
    rows = torch.nonzero_static(keep, size=num_targets).squeeze(1)
    hidden, targets = hidden.index_select(0, rows), labels.index_select(0, rows)
    if compute_dtype is not None:
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    kernel = fused_kernel(hidden.device.type, fused) if chunk_tokens is None else None
    if kernel is not None:
        total = kernel(hidden, weight, targets, bias)
    else:
        chunk = chunk_tokens or chunk_tokens_for(weight.shape[0], hidden.device, hidden.dtype)
        total = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, torch.is_grad_enabled())
    if num_items_in_batch is None:
        return total / targets.numel()  # NaN for no targets, as torch's mean
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class _Captured:
    hidden: torch.Tensor | None = None
    dtype: torch.dtype | None = None


class _HeadBypass:
    """lm_head's forward pre-hook, registered once (`head_bypass`) and kept: while `active`, it records its input
    and hands lm_head an empty slice of it; otherwise it does nothing.

    Kept rather than registered for each call because torch.compile does not guard on a module's hooks
    (torch._dynamo.config.skip_nnmodule_hook_guards): a graph compiled while no hook was registered (predict(),
    which needs the logits) would be run again with one registered, which then never runs. A hook that is
    always there is traced into every graph and its `active` flag is guarded, so each state gets its own graph.
    """

    def __init__(self):
        self.active, self.hidden, self.dtype = False, None, None

    def __call__(self, module, args):
        if not self.active:
            return None
        hidden = args[0]
        self.hidden = hidden
        device = hidden.device.type
        self.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return (hidden.narrow(-2, 0, 0), *args[1:])


def head_bypass(lm_head: nn.Module) -> _HeadBypass:
    """lm_head's bypass hook, registered on the first call (before the model is compiled: the Trainer does
    this when it sets the model up)."""
    found = next((h for h in lm_head._forward_pre_hooks.values() if isinstance(h, _HeadBypass)), None)
    if found is None:
        found = _HeadBypass()
        lm_head.register_forward_pre_hook(found)
    return found


@contextlib.contextmanager
def lm_head_bypassed(lm_head: nn.Module):
    """While active, lm_head records its input (the final hidden states, still in the autograd graph) and
    the autocast dtype it runs under, and is handed an empty slice of it, so the model's logits come out as
    [batch, 0, vocab]: no logits are computed, and every wrapper around the model still runs its forward.
    What it recorded is in the yielded object once the block is left."""
    bypass, captured = head_bypass(lm_head), _Captured()
    bypass.active, bypass.hidden, bypass.dtype = True, None, None
    try:
        yield captured
    finally:
        # handed on and dropped here: the hook must not keep the hidden states (and their graph) alive
        captured.hidden, captured.dtype = bypass.hidden, bypass.dtype
        bypass.active, bypass.hidden, bypass.dtype = False, None, None


def output_head(model: nn.Module) -> nn.Module | None:
    """The lm_head of a transformers causal LM (through a peft wrapper), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(base, "get_output_embeddings", None)
    return get() if callable(get) else None


# config attributes of models that transform the logits after lm_head (the chunked loss would skip it)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunked_loss_problems(model: nn.Module) -> list[str]:
    """Why chunked_loss=True cannot be used with this model (empty if it can)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if model_family(model) != "causal_lm":
        return [f"chunked_loss=True: {type(base).__name__} is not a transformers causal LM; the chunked loss "
                "replaces that loss only"]
    head = output_head(model)
    if not isinstance(head, nn.Linear) or not head.weight.is_floating_point():
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return [f"chunked_loss=True: the output layer of {type(base).__name__} is {kind}, not a "
                "plain floating-point nn.Linear (a LoRA or quantized lm_head); turn chunked_loss off"]
    config = base.config
    transforms = [f"{k}={getattr(config, k)!r}" for k in _LOGIT_TRANSFORMS
                  if getattr(config, k, None) not in (None, 1, 1.0, 0, 0.0)]
    if transforms:
        return [f"chunked_loss=True: {type(base).__name__} transforms its logits after lm_head "
                f"({', '.join(transforms)}), which the chunked loss does not reproduce; turn chunked_loss off"]
    return []


def chunked_causal_lm_loss(model: nn.Module, lm_head: nn.Linear, inputs: dict, labels: torch.Tensor,
                           num_items_in_batch=None, fused: bool = False):
    """Run `model(**inputs)` (labels removed) with lm_head bypassed, then the chunked loss on its input (Liger's
    kernel on a GPU with `fused`). Returns (loss, the model's outputs, whose logits are empty)."""
    known = host_target_count(labels)  # a training batch's, counted before its copy to the device
    count = TargetCount(labels) if known is None else None  # else before the forward, read after it is queued
    with lm_head_bypassed(lm_head) as captured:
        outputs = model(**inputs)
    if captured.hidden is None:
        raise RuntimeError(f"chunked_loss: {type(lm_head).__name__} was never called during the forward pass")
    loss = chunked_cross_entropy(captured.hidden, lm_head.weight, labels, num_items_in_batch, bias=lm_head.bias,
                                 compute_dtype=captured.dtype, num_targets=known if count is None else count.wait(),
                                 fused=fused)
    return loss, outputs
