"""Attention within each sequence for packed rows (stoker.attention): the collator's boundaries, every kernel against
the per-sequence reference, the dispatch, and the Trainer training packed rows through it at micro-batches of several
rows exactly as on the same rows padded."""

from __future__ import annotations

import logging

import pytest
import torch

from stoker import Trainer, attention
from stoker.data import IGNORE_INDEX, PaddingCollator
from stoker.packing import PackingCollator, pack_rows, separation_problems, sequence_starts, use_packed_attention
from tests.helpers.tiny_jobs import GradRecorder, args, llama, sft_rows


def sdpa_llama(seed: int = 0):
    model = llama(seed)
    model.config._attn_implementation = "sdpa"
    return model


def boundaries(batch) -> list[int]:
    return batch["cu_seq_lens_q"].tolist()


# --- the collator's boundaries --------------------------------------------------------------------------------

def test_the_collator_computes_each_sequences_boundaries_on_the_host():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}, {"input_ids": [3, 4, 5]}]
    batch = PackingCollator(boundaries=True)(rows)
    # row 0: sequences of 3 and 2; row 1 (from position 5): one of 3, then its 2 pad tokens as one sequence
    assert boundaries(batch) == [0, 3, 5, 8, 10] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert batch["max_length_q"] == batch["max_length_k"] == 3 and isinstance(batch["max_length_q"], int)
    flat = PackingCollator(boundaries=True, flatten=True)(rows)  # padding_free: one row, no padding
    assert boundaries(flat) == [0, 3, 5, 8] and flat["input_ids"].shape == (1, 8)
    # every boundary is a sequence start of the flattened position_ids (padding aside)
    packed = PackingCollator(boundaries=True)(pack_rows(sft_rows(20, seed=1), max_length=32))
    starts = sequence_starts(packed["position_ids"]).reshape(-1).nonzero().squeeze(1).tolist()
    real = (packed["input_ids"] != 0).reshape(-1)
    assert [s for s in starts if real[s]] == [b for b in boundaries(packed)[:-1] if real[b]]
    assert "cu_seq_lens_q" not in PackingCollator()(rows)  # only when asked: a forward must take them


# --- the kernels against the per-sequence reference -------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["dense", "flex"])
def test_each_kernel_computes_what_sdpa_over_each_sequence_does(kernel, causal):
    """flex runs its forward on a CPU (its backward does not, in torch 2.13); dense is the GPU's last fallback.
    Grouped-query heads (4 query heads, 2 key/value heads) and a one-token sequence included."""
    torch.manual_seed(0)
    q, k, v = torch.randn(41, 4, 8), torch.randn(41, 2, 8), torch.randn(41, 2, 8)
    cu = torch.tensor([0, 5, 17, 18, 30, 41], dtype=torch.int32)
    reference = attention.per_sequence(q, k, v, cu, 12, causal, None)
    got = getattr(attention, kernel)(q, k, v, cu, 12, causal, None)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    # the reference itself: each sequence alone, as if it were the only one
    alone = torch.nn.functional.scaled_dot_product_attention(q[5:17].transpose(0, 1), k[5:17].transpose(0, 1),
                                                            v[5:17].transpose(0, 1), is_causal=causal,
                                                            enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(reference[5:17], alone, atol=0, rtol=0)


def test_the_per_sequence_path_has_gradients_equal_to_the_dense_masks():
    torch.manual_seed(1)
    q, k, v = (torch.randn(30, h, 8, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 20, 30], dtype=torch.int32)
    grads = []
    for kernel in (attention.per_sequence, attention.dense):
        out = kernel(q, k, v, cu, 13, True, None)
        grads.append(torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_dense_kernel_expands_grouped_heads_before_sdpa(monkeypatch):
    """Grouped-query heads with a mask: sdpa's enable_gqa would rule out both fused kernels (flash takes no mask,
    memory-efficient has no GQA) and leave the math kernel's [heads, T, T] scores. The dense kernel hands sdpa
    k and v expanded to the query heads, without enable_gqa, and computes what sdpa with enable_gqa does."""
    torch.manual_seed(2)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, **kw):
        calls.append((query.shape[1], key.shape[1], value.shape[1], kw.get("attn_mask") is not None,
                      kw.get("enable_gqa", False)))
        return sdpa(query, key, value, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    got = attention.dense(q, k, v, cu, 11, True, None)
    assert calls == [(4, 4, 4, True, False)]
    ids = torch.tensor([0] * 9 + [1] * 11)
    mask = (ids[:, None] == ids[None, :]).tril()
    expected = sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                    enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_the_rows_kernel_computes_what_sdpa_over_each_sequence_does(causal):
    """The CPU's one call over the rows as the model lays them out ([rows, heads, length, D]), each row with the block
    mask of its own sequences: the per-sequence reference's outputs and gradients, grouped-query heads included."""
    torch.manual_seed(3)
    query, key, value = (torch.randn(3, h, 10, 8, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 10, 13, 14, 20, 30], dtype=torch.int32)  # row 2 is one sequence; row 1 has a one-token one
    got = attention.rows(query, key, value, cu, causal, None)
    flat = [x.transpose(1, 2).reshape(30, x.shape[1], 8) for x in (query, key, value)]
    reference = attention.per_sequence(*flat, cu, 10, causal, None).reshape(3, 10, 4, 8)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    weights = torch.arange(got.numel()).view_as(got).sin()
    grads = [torch.autograd.grad((out * weights).sum(), (query, key, value)) for out in (got, reference)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("rows", "length", "sequences", "compiled", "expected"), [
    (8, 211, 18, False, "rows"),  # the main job's packed rows: one call beats 18 (and their reads and copies)
    (8, 512, 64, False, "rows"),  # the rule's edge
    (4, 2048, 4, False, "rows"),  # a sequence a row: the mask is the causal one, and one call batches the rows
    (4, 1024, 24, False, "per_sequence"),  # long rows of several sequences: the mask's extra scores dominate
    (4, 1024, 24, True, "rows"),  # compiled: per_sequence's read of the boundaries would break the graph
])
def test_the_cpu_chooses_one_call_or_one_per_sequence_by_the_shape(rows, length, sequences, compiled, expected):
    assert attention.cpu_kernel(rows, length, sequences, compiled) == expected


@pytest.mark.parametrize("shape", [(2, 48, 4), (2, 520, 4)], ids=["rows", "per_sequence"])
def test_the_model_attends_on_a_cpu_with_the_rules_choice(monkeypatch, shape):
    """The forward applies the rule to the micro-batch's shape (rows, row length, sequences), and both ways give
    the same logits."""
    rows_, length, per_row = shape
    features = [{"input_ids": [1 + (i % 60) for i in range(length)],
                 "position_ids": [i % (length // per_row) for i in range(length)]} for _ in range(rows_)]
    batch = PackingCollator(boundaries=True)(features)
    model = sdpa_llama()  # rotary positions past 64 are computed, not looked up
    use_packed_attention(model)
    used, functions = [], dict(attention._KERNEL_FUNCTIONS)
    rows_kernel = attention.rows
    monkeypatch.setattr(attention, "rows", lambda *a, **k: used.append("rows") or rows_kernel(*a, **k))
    monkeypatch.setitem(attention._KERNEL_FUNCTIONS, "per_sequence",
                        lambda *a, **k: used.append("per_sequence") or functions["per_sequence"](*a, **k))
    expected = attention.cpu_kernel(rows_, length, rows_ * per_row)
    with torch.no_grad():
        got = model(**batch, use_cache=False).logits
        monkeypatch.setattr(attention, "cpu_kernel", lambda *a: "rows" if used[0] == "per_sequence" else "per_sequence")
        other = model(**batch, use_cache=False).logits
    assert used[:2] == [expected] * 2 and len(set(used[2:])) == 1 and used[2] != expected
    torch.testing.assert_close(got, other, atol=1e-5, rtol=1e-5)


# --- the dispatch -------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dispatch():
    choose = attention.kernel_for  # the cached function, whatever a test patches in its place
    choose.cache_clear()
    yield
    choose.cache_clear()


@pytest.mark.parametrize(("varlen", "flash", "triton", "dtype", "capability", "expected"), [
    (True, True, True, torch.bfloat16, (9, 0), "varlen"),
    (False, True, True, torch.bfloat16, (8, 0), "flash_attn"),
    (False, False, True, torch.bfloat16, (9, 0), "flex"),
    (True, True, True, torch.float32, (9, 0), "flex"),  # the flash kernels take half precision only
    (True, True, True, torch.float16, (7, 5), "flex"),  # and run from compute capability 8.0 (a T4 has 7.5)
    (False, False, False, torch.bfloat16, (9, 0), "dense"),
])
def test_the_kernel_is_the_first_that_runs_on_the_device(monkeypatch, fresh_dispatch, caplog, varlen, flash, triton,
                                                         dtype, capability, expected):
    monkeypatch.setattr(attention, "_has_varlen", lambda: varlen)
    monkeypatch.setattr(attention, "_has_flash_attn", lambda: flash)
    monkeypatch.setattr(attention, "_has_triton", lambda: triton)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with caplog.at_level(logging.INFO, logger="stoker"):
        assert attention.kernel_for("cuda", dtype) == expected
        assert attention.kernel_for("cuda", dtype) == expected
    said = [r for r in caplog.records if "packed rows attend" in r.getMessage()]
    assert len(said) == 1  # once, where the run is set up
    if expected == "dense":
        assert said[0].levelno == logging.WARNING
        for install in ("torch.nn.attention.varlen", "flash-attn", "triton"):
            assert install in said[0].getMessage()
    assert attention.kernel_for("cpu", torch.bfloat16) == "per_sequence"
    assert attention.kernel_for("cuda", torch.bfloat16, dropout=True) == "dense"  # sdpa alone drops out


def test_the_run_chooses_once_and_the_forward_reads_the_choice(monkeypatch, fresh_dispatch):
    """choose_kernel records the run's kernel on every attention module, for the dtype attention runs in; the
    forward then calls no kernel_for (which a compiled layer would trace); a forward in another dtype chooses its
    own."""
    model = sdpa_llama()
    use_packed_attention(model)
    assert attention.choose_kernel(model, "cpu", torch.float32) == "per_sequence"
    modules = attention.attention_modules(model)
    assert len(modules) == 2 and all(getattr(m, attention.CHOSEN) == {torch.float32: "per_sequence"} for m in modules)
    asked = []
    monkeypatch.setattr(attention, "kernel_for", lambda *a, **k: asked.append(a) or "per_sequence")
    batch = PackingCollator(boundaries=True)(pack_rows(sft_rows(6, seed=2), max_length=32))
    with torch.no_grad():
        model(**batch, use_cache=False)
        assert asked == []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch, use_cache=False)
    assert asked == [("cpu", torch.bfloat16, False)] * 2  # not chosen for bfloat16: each layer asks


def test_the_attention_calls_the_chosen_kernel_with_the_collators_boundaries(monkeypatch, fresh_dispatch):
    """As on a GPU with torch's varlen kernel (patched in: it has no CPU kernel): the flattened q, k, v of the
    micro-batch and the collator's cu_seq_lens, and the model's outputs are those of the per-sequence path."""
    calls = []

    def varlen_here(q, k, v, cu, max_len, causal, scale, dropout=0.0):
        calls.append((q.shape, cu.tolist(), max_len, causal))
        return attention.per_sequence(q, k, v, cu, max_len, causal, scale, dropout)

    model = sdpa_llama()
    use_packed_attention(model)
    batch = PackingCollator(boundaries=True)(pack_rows(sft_rows(12, seed=2), max_length=32))
    monkeypatch.setattr(attention, "cpu_kernel", lambda *a: "per_sequence")  # the CPU's way the stand-in runs
    with torch.no_grad():
        expected = model(**batch, use_cache=False).logits
        monkeypatch.setattr(attention, "kernel_for", lambda *a, **k: "varlen")
        monkeypatch.setitem(attention._KERNEL_FUNCTIONS, "varlen", varlen_here)
        got = model(**batch, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    rows, length = batch["input_ids"].shape
    assert len(calls) == 2  # one per layer
    assert calls[0] == (torch.Size([rows * length, 4, 8]), boundaries(batch), batch["max_length_q"], True)


# --- the model: packed rows never meet, and equal the same rows padded ------------------------------------------

def test_the_trainer_switches_sdpa_models_and_keeps_other_attention():
    model = sdpa_llama()
    assert use_packed_attention(model) == attention.NAME == model.config._attn_implementation
    eager = llama()
    eager.config._attn_implementation = "eager"
    assert use_packed_attention(eager) is None and eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("rows", [1, 3])
def test_packed_sequences_never_attend_across_a_boundary(rows):
    """The probe at the micro-batch's shape passes, and rewriting the first sequence of every row leaves every
    other token's logits exactly as they were."""
    model = sdpa_llama()
    use_packed_attention(model)
    assert separation_problems(model, {"use_cache": False}, "packing", rows) == []
    packed = pack_rows([{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}],
                       max_length=12)
    batch = PackingCollator(boundaries=True)(packed * rows)
    changed = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    changed["input_ids"][:, :5] = torch.tensor([60, 61, 62, 63, 1])
    with torch.no_grad():
        before, after = (model(**b, use_cache=False).logits for b in (batch, changed))
    assert not torch.allclose(before[:, :5], after[:, :5])
    # to float rounding: the CPU's one call over the rows' block mask sums each row's products in blocks whose
    # values changed (a leak across the boundary would move the logits by ~1e-1)
    torch.testing.assert_close(after[:, 5:], before[:, 5:], atol=1e-6, rtol=0)


def test_packed_rows_give_the_loss_and_gradients_of_the_same_rows_padded():
    data = sft_rows(18, seed=5)
    packed = PackingCollator(boundaries=True)(pack_rows(data, max_length=40))
    padded = PaddingCollator()(data)
    targets = int((padded["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert int((packed["labels"][:, 1:] != IGNORE_INDEX).sum()) == targets
    results = []
    for batch, attn in ((packed, "packed"), (padded, "sdpa")):
        model = sdpa_llama()
        if attn == "packed":
            use_packed_attention(model)
        loss = model(**batch, use_cache=False, num_items_in_batch=targets).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for name, g in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("setting", [{"packing": True, "packing_length": 48}, {"padding_free": True}])
def test_the_trainer_trains_packed_rows_through_it_at_several_rows_per_micro_batch(tmp_path, setting):
    """per_device_train_batch_size=4: the model attends through stoker.attention with the collator's boundaries,
    and one optimizer step over the whole data set has the gradients of the unpacked rows."""
    data = sft_rows(16, seed=4)
    rec = GradRecorder()
    Trainer(sdpa_llama(), args(tmp_path / "rows", per_device_train_batch_size=16, max_steps=1), train_dataset=data,
            callbacks=[rec]).train()
    expected = rec.grads[0]
    t = Trainer(sdpa_llama(), args(tmp_path / "packed", **setting), train_dataset=data)
    assert t.model.config._attn_implementation == attention.NAME
    n, batches, collate = len(t.train_dataset), [], t.data_collator
    t.data_collator = lambda features: batches.append(collate(features)) or batches[-1]
    t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps, t.args.max_steps = 4, -(-n // 4), 1
    rec = GradRecorder()
    t.add_callback(rec)
    t.train()
    assert batches and all("cu_seq_lens_q" in b for b in batches)
    for name, g in expected.items():
        torch.testing.assert_close(rec.grads[0][name], g, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
