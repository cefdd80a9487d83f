"""Rehearsal of the GPU's attention for packed rows, on a CPU: the first thing to run on a GPU too.

On a GPU stoker trains float32 weights under bf16 autocast by default. There transformers' rotary embeddings hand
the attention float32 q and k (cos and sin are made in the hidden states' dtype) and bfloat16 v, so a kernel
chosen from q's dtype would never be a flash kernel. These tests run that dtype flow here, float32 weights under
the CPU's bf16 autocast, with torch.cuda answering as an H100 would where the choice reads it (its compute
capability), and assert at each boundary: the dtypes transformers hands the attention, the kernel chosen for the
run and the dtype it is handed, for packed rows and padding-free rows, eagerly and in compiled decoder layers
(without a graph break). The CUDA kernels have no CPU build, so here the chosen kernel's call is recorded and run
by a CPU kernel that computes the same (`per_sequence`, or `dense` inside a compiled graph, which has no read of the
host).

On a CUDA machine the same file runs as it is, `python -m pytest -q tests/gpu_paths/test_rehearsal_attention.py`:
the model and the rows on the GPU, no mocks, the real kernel behind the recording.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from stoker import attention
from stoker.packing import PackingCollator, choose_packed_kernel, pack_rows, use_packed_attention
from tests.helpers.gpu_stand_ins import fake_gpu
from tests.helpers.tiny_jobs import llama, sft_rows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FLASH = ("varlen", "flash_attn")  # what a GPU of compute capability 8.0+ runs in bfloat16 (flash_attn if installed)


@pytest.fixture
def gpu(monkeypatch):
    """The GPU the choice sees: an H100 (compute capability 9.0) answering through torch.cuda where there is none;
    the real one on a CUDA machine. The choice is made afresh."""
    attention.kernel_for.cache_clear()
    if not ON_GPU:
        fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    yield
    attention.kernel_for.cache_clear()


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tally(calls: int, q: torch.dtype, k: torch.dtype, v: torch.dtype) -> torch.Tensor:
    """`calls` calls whose q, k and v had these dtypes, as Boundaries counts them: [q k v, DTYPES]."""
    counts = torch.zeros(3, len(DTYPES), dtype=torch.int64)
    for i, dtype in enumerate((q, k, v)):
        counts[i, DTYPES.index(dtype)] = calls
    return counts


class Boundaries:
    """Counts what transformers hands stoker's attention (`handed`: q, k and v's dtypes) and what each flash kernel is
    handed (`kernels[name]`), running the real kernel on a GPU and `stand_in` on a CPU. Counted in tensors, in place:
    a compiled graph counts them as ops, where appending to a Python list would make it guard on the list's length
    (a graph per length)."""

    def __init__(self, monkeypatch, stand_in):
        self.handed = torch.zeros(3, len(DTYPES), dtype=torch.int64)
        self.kernels = {name: torch.zeros(3, len(DTYPES), dtype=torch.int64) for name in FLASH}
        forward = attention.packed_attention_forward

        def count(counts, *tensors):
            for i, x in enumerate(tensors):
                counts[i, DTYPES.index(x.dtype)] += 1

        def handed(module, query, key, value, *a, **kw):
            count(self.handed, query, key, value)
            return forward(module, query, key, value, *a, **kw)

        monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, handed)
        for name in FLASH:
            real = attention._KERNEL_FUNCTIONS[name]

            def kernel(q, k, v, cu, max_len, causal, scale, dropout=0.0, name=name, real=real):
                count(self.kernels[name], q, k, v)
                return (real if ON_GPU else stand_in)(q, k, v, cu, max_len, causal, scale, dropout)

            monkeypatch.setitem(attention._KERNEL_FUNCTIONS, name, kernel)

    def assert_kernel(self, chosen: str, calls: int, dtype: torch.dtype) -> None:
        """`chosen` ran `calls` times, on q, k and v of `dtype`; no other flash kernel ran."""
        for name, counts in self.kernels.items():
            expected = tally(calls, dtype, dtype, dtype) if name == chosen else torch.zeros_like(counts)
            assert torch.equal(counts, expected), (name, counts)


def packed_model():
    model = llama()  # float32 weights, 4 query heads and 2 key/value heads
    model.config._attn_implementation = "sdpa"
    assert use_packed_attention(model) == attention.NAME
    return model.to(DEVICE)


def packed_batch(flatten: bool) -> dict:
    rows = pack_rows(sft_rows(12, seed=2), max_length=32)
    batch = PackingCollator(boundaries=True, flatten=flatten)(rows)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("flatten", [False, True], ids=["packing", "padding_free"])
def test_packed_rows_reach_the_flash_kernel_in_the_autocast_dtype(gpu, monkeypatch, flatten):
    """bf16 autocast over float32 weights: the run chooses a flash kernel for bfloat16 (the dtype attention runs in,
    not q's float32), transformers hands float32 q and k and bfloat16 v, the kernel gets all three in bfloat16, once
    per layer, forward and backward run, and the attention's output is what sdpa over each sequence gives."""
    model = packed_model()
    kernel = choose_packed_kernel(model, torch.device("cuda"), "bf16")
    assert kernel in FLASH and (ON_GPU or kernel == "varlen")
    seen = Boundaries(monkeypatch, attention.per_sequence)
    batch = packed_batch(flatten)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    # float32 q and k (the rotary promotion) and bfloat16 v from transformers, once per layer; all bfloat16 after
    assert torch.equal(seen.handed, tally(2, torch.float32, torch.float32, torch.bfloat16)), seen.handed
    seen.assert_kernel(kernel, 2, torch.bfloat16)
    assert torch.isfinite(loss) and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    # the kernel's output against the reference, at the boundary: the same q, k, v in bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(30, h, 8, device=DEVICE, dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 20, 30], dtype=torch.int32, device=DEVICE)
    got = attention._KERNEL_FUNCTIONS[kernel](q, k, v, cu, 13, True, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), attention.per_sequence(q, k, v, cu, 13, True, None).float(),
                               atol=2e-2, rtol=2e-2)


def test_without_autocast_float32_rows_take_flex_or_the_dense_fallback(gpu, monkeypatch):
    """The same GPU training in float32 (bf16=False): no flash kernel takes float32, so the choice is flex where
    triton runs, else the dense block mask, whose grouped-query k and v reach sdpa expanded (no enable_gqa with a
    mask, which would leave only sdpa's math kernel)."""
    model = packed_model()
    monkeypatch.setattr(attention, "_has_triton", lambda: False)
    assert choose_packed_kernel(model, torch.device("cuda"), "no") == "dense"
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, **kw):
        calls.append((query.dtype, query.shape[1], key.shape[1], kw.get("attn_mask") is not None,
                      kw.get("enable_gqa", False)))
        return sdpa(query, key, value, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    model(**packed_batch(False), use_cache=False).loss.backward()
    assert calls == [(torch.float32, 4, 4, True, False)] * 2


def test_compiled_layers_run_the_chosen_kernel_without_a_graph_break(gpu, monkeypatch, compiled_graphs):
    """The decoder layers compiled in place (as torch_compile compiles them), bf16 autocast over float32 weights:
    the kernel chosen when the run was set up is read as a constant of the layer's graph (no kernel_for traced, no
    log line), the kernel gets bfloat16, and each layer is one graph (both layers share it) with no break."""
    from torch._dynamo.utils import counters

    model = packed_model()
    kernel = choose_packed_kernel(model, torch.device("cuda"), "bf16")
    seen = Boundaries(monkeypatch, attention.dense)  # the CPU's stand-in reads nothing on the host
    # chosen: the rest runs on this machine's device (Dynamo saves CUDA's random state where CUDA says it is there)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: ON_GPU)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    counters.clear()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = model(**packed_batch(False), use_cache=False).loss
    loss.backward()
    assert dict(counters["graph_break"]) == {}
    assert len(compiled_graphs) == 1
    assert torch.equal(seen.handed, tally(2, torch.float32, torch.float32, torch.bfloat16)), seen.handed
    seen.assert_kernel(kernel, 2, torch.bfloat16)
