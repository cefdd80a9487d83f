"""Where the time goes: data waiting, model FLOPs utilisation (MFU) and peak memory, for the training logs.

Every logging window reports `data_wait_fraction`, the share of its step time spent waiting for the next
batch (the dataloader's `next()`: loading, collating, worker start-up, the host-to-device copy): on the CPU the
host's time inside next(), on a GPU the device's idle gap across each fetch, measured with CUDA events (the host
runs ahead of the device, so its own wait is no loss of the device's; it is logged beside it as
`host_data_wait_fraction`). Above DATA_WAIT_WARNING it warns once with advice. On a GPU the window also reports
`mfu` (model FLOPs per second over the device's peak; needs the peak, from PEAK_TFLOPS or `peak_tflops`) and
`peak_memory_allocated_gb` (torch's peak of allocated memory so far in the run).

MFU counts model FLOPs only, as PaLM (Chowdhery et al. 2022, appendix B) defines it: recomputation by
gradient checkpointing and padding tokens are not useful work, so they lower MFU rather than raise it.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

DATA_WAIT_WARNING = 0.10  # fraction of a window's step time

# Dense (no sparsity) peak TFLOPS per device by matmul precision, from the vendors' data sheets. Matched in
# order against torch.cuda.get_device_name(); the first pattern that matches wins (so "H100 PCIe" before
# "H100"). A device not listed gets no MFU unless TrainingArguments.peak_tflops is set.
# Names as CUDA reports them: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA H200 NVL", "NVIDIA GH200 480GB" (Grace Hopper: an H100 SXM-class GPU, whose name "GH200" no \bH200\b
# or \bH100\b matches), "NVIDIA H800" (H100 SXM's compute), "NVIDIA A100-SXM4-80GB".
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (r"\bGH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH200\b.*\bNVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH800\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"\bMI300X\b", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOPS of `device_name` at `precision` ('bf16', 'fp16', 'tf32', 'fp32'), or None if unknown."""
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return table.get(precision)
    return None


def matmul_precision(mixed_precision: str) -> str:
    """The precision the model's matmuls run in: the autocast dtype, else TF32 if torch allows it, else fp32."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def flops_per_token(params: int, trainable: int, layers: int = 0, attention_width: int = 0,
                    seq_len: float = 0) -> float:
    """Training FLOPs per token (forward and backward) of a transformer.

    Each parameter that a token goes through costs 2 FLOPs in the forward pass (a multiply and an add) and
    2 in the backward pass for the gradient of the activations; a trainable one costs 2 more for its own
    gradient: 6 per parameter when all train (PaLM's 6N), 4 for frozen ones (LoRA). Attention adds
    QK^T and attention x V, 2 * 2 * seq_len * width FLOPs per layer forward and twice that backward:
    12 * layers * width * seq_len. `params` excludes the input embedding, a lookup rather than a matmul
    (unless it is tied to the output layer, which is a matmul). With sequences of several lengths (padding,
    packed rows), `seq_len` is the mean over tokens of their own sequence's length: attention_pairs / tokens.
    """
    return 4 * params + 2 * trainable + 12 * layers * attention_width * seq_len


def parameter_count(p: torch.Tensor) -> int:
    """The number of values a parameter stands for, where its tensor holds fewer: a DeepSpeed ZeRO-3 parameter
    is an empty placeholder outside its gathering (ds_numel is the full count), and a bitsandbytes 4-bit weight
    (Params4bit) packs two values a byte (quant_state.shape is the weight's shape)."""
    if hasattr(p, "ds_numel"):
        return int(p.ds_numel)
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    if shape is not None:
        n = 1
        for d in shape:
            n *= int(d)
        return n
    return p.numel()


def model_flops_shape(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(matmul parameters, trainable ones, layers, attention width) of a model, for flops_per_token.
    Parameters count by parameter_count (ZeRO-3 partitions and packed 4-bit weights at their full size).
    A model without a transformers config gets no attention term."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = sum(parameter_count(p) for p in model.parameters())
    trainable = sum(parameter_count(p) for p in model.parameters() if p.requires_grad)
    get_in, get_out = getattr(base, "get_input_embeddings", None), getattr(base, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embedding is not None and getattr(embedding, "weight", None) is not None:
        tied = head is not None and getattr(head, "weight", None) is embedding.weight
        if not tied:
            params -= parameter_count(embedding.weight)
            trainable -= parameter_count(embedding.weight) if embedding.weight.requires_grad else 0
    config = getattr(base, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    return params, trainable, layers, heads * head_dim


def attention_pairs(batch) -> torch.Tensor | int:
    """Sum over the batch's sequences of length^2: the (query, key) pairs attention computes, whose count
    times 12 * layers * width is the attention term of a micro-batch's training FLOPs. A sequence is a
    segment of `cu_seq_lens_q` (flash-attention's flattened rows), else a run of `position_ids` that counts
    up by one (packed rows: each restart is a new sequence, as transformers' packed masks read them), else a
    row's attention_mask sum (padding is no sequence), else a whole row. It is computed on the device
    without a host sync: sum(n^2) is the sum over tokens of 2k + 1, k the token's place in its sequence."""
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seq_lens_k"))
    if isinstance(cu, torch.Tensor) and cu.numel() > 1:
        lengths = (cu[1:] - cu[:-1]).long()
        return (lengths * lengths).sum()
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() >= 1 and positions.numel():
        positions = positions.reshape(-1, positions.shape[-1]).long()
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        index = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
        start_of_own = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
        odd = 2 * (index - start_of_own) + 1
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == positions.shape:
            odd = odd * (mask != 0)
        return odd.sum()
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        lengths = (mask != 0).sum(-1)
        return (lengths * lengths).sum()
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids.shape[0] * ids.shape[1] ** 2
    return 0


def mfu(tokens_per_second: float, flops_per_token_: float, peak_tflops_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOPs per second over the peak of all devices together."""
    return tokens_per_second * flops_per_token_ / (peak_tflops_per_device * 1e12 * devices)


class Waited(NamedTuple):
    """A logging window's wait for batches, in seconds: the device's idle gap for data where it is measured (a GPU),
    else None, and the host's time inside next()."""

    device: float | None
    host: float


class Stopwatch:
    """The loop's wait for batches: Trainer._windows takes its batches through `timed(loader)`, which times each
    next() on the loader. `take()` returns a logging window's wait, `total` the run's (the goodput ledger's data_wait).

    On the host that is the seconds inside next(). On a GPU it is not the device's loss: the host runs a step
    ahead (the deferred check keeps the next step's work queued), so a fetch that overlaps queued work costs the
    device nothing, and a copy from memory that is not pinned (dataloader_pin_memory=False) waits inside next() for
    the queue to drain, a whole step the host's clock would book as waiting for data. So on a GPU (`events`: a
    factory of CUDA events that time) each fetch is bracketed by two events, recorded without waiting for anything:
    the device's time from the first to the second is its idle gap for data, from the end of the work queued before
    the fetch to the first work queued after it (the copy included), zero where the fetch overlapped queued work.
    They are read without waiting (`query`), at log time, after the log's own sync has completed them; a pair not
    yet complete is read at the next log. The cost: two event records per micro-batch, one query a pair."""

    def __init__(self, device: torch.device | None = None, events=None, clock=time.perf_counter):
        if events is None and device is not None and device.type == "cuda":
            events = functools.partial(torch.cuda.Event, enable_timing=True)
        self.events, self.clock = events, clock
        self.seconds = 0.0  # the host's seconds inside next() since the last take()
        self.taken = 0.0  # the seconds of the windows already taken (the device's, where it has events)
        self._device = 0.0  # the device's idle seconds read since the last take()
        self._pairs = []  # (event before, event after) of the fetches not yet read

    def timed(self, loader) -> Iterator:
        """The loader's batches, each fetch timed: the host's clock around next(), and on a GPU an event before it
        (after the work queued so far) and one after it (before the work to come). One function a step crosses,
        inlined for that."""
        batches = None
        while True:
            started = self.clock()
            opened = self.events() if self.events is not None else None
            if opened is not None:
                opened.record()
            try:
                if batches is None:  # a loader may start its workers here
                    batches = iter(loader)
                batch = next(batches)
            except StopIteration:
                return
            finally:  # the last fetch, which finds the loader done, waited too
                self.seconds += self.clock() - started
                if opened is not None:
                    closed = self.events()
                    closed.record()
                    self._pairs.append((opened, closed))
            yield batch

    def _read_device(self) -> None:
        """The idle gaps of the fetches whose events the device has passed, in order, never waiting for one."""
        done = 0
        for opened, closed in self._pairs:
            if not closed.query():
                break
            self._device += opened.elapsed_time(closed) / 1000  # milliseconds
            done += 1
        del self._pairs[:done]

    def take(self) -> Waited:
        """The wait since the last take(), and start again from zero."""
        host, self.seconds = self.seconds, 0.0
        device = None
        if self.events is not None:
            self._read_device()
            device, self._device = self._device, 0.0
        self.taken += host if device is None else device
        return Waited(device, host)

    @property
    def total(self) -> float:
        """Every second waited since the stopwatch was made: the device's idle gaps read so far where it has events,
        else the host's."""
        if self.events is None:
            return self.taken + self.seconds
        self._read_device()
        return self.taken + self._device


def data_wait_metrics(waited: Waited, elapsed: float, args, on_gpu: bool) -> tuple[dict[str, float], str | None]:
    """A logging window's data-wait figures for the log and the advice to warn with, if it is due.
    `data_wait_fraction` is the share of the window's time the device waited for data: on a GPU its idle gap
    (Stopwatch's events), with the host's own share beside it as `host_data_wait_fraction`; on the CPU the two are
    one. The advice judges the device's share only, so that a host waiting inside next() while the GPU works (a
    deferred step, a copy from memory that is not pinned draining the queue) does not call for data work."""
    share = min((waited.host if waited.device is None else waited.device) / elapsed, 1.0)
    out = {"data_wait_fraction": round(share, 4)}
    if waited.device is not None:
        out["host_data_wait_fraction"] = round(min(waited.host / elapsed, 1.0), 4)
    return out, data_wait_advice(share, args, on_gpu) if share > DATA_WAIT_WARNING else None


def data_wait_advice(fraction: float, args, on_gpu: bool) -> str:
    """The warning for a window that spent `fraction` of its step time waiting for data."""
    tips = []
    workers = args.dataloader_num_workers
    if workers == 0:
        tips.append(f"dataloader_num_workers={min(4, os.cpu_count() or 1)} to load batches in parallel "
                    "worker processes (now 0: the loop loads them itself)")
    else:
        tips.append(f"more dataloader_num_workers (now {workers}) or a larger dataloader_prefetch_factor")
    if on_gpu and not args.dataloader_pin_memory:
        tips.append("dataloader_pin_memory=True for faster, asynchronous copies to the GPU")
    tips.append("tokenise once before training (datasets' map) rather than in __getitem__ or the collator")
    tips.append("pack short rows (stoker.packing.pack_rows) so each step fetches fewer, fuller rows")
    return (f"{100 * fraction:.1f}% of the step time in the last logging window was spent waiting for data "
            f"(over {100 * DATA_WAIT_WARNING:.0f}%); try: " + "; ".join(tips))


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """The run's peak memory for train()'s metrics: torch's peak of allocated memory on a GPU, the process's
    peak resident memory (ru_maxrss, KiB on Linux) on the CPU, its equivalent there."""
    if device.type == "cuda" and torch.cuda.is_available():
        return {"peak_memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
    import resource

    return {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
