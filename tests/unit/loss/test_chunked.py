"""The chunked cross-entropy (stoker.loss.chunked): same loss and gradients as the full logits, never the full logits,
and in the Trainer (chunked_loss=True) the same update, exact accumulation, peft and evaluation."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stoker import ConfigError, Trainer, TrainerCallback
from stoker.data import IGNORE_INDEX, PaddingCollator
from stoker.loss import chunked
from stoker.loss.chunked import chunked_causal_lm_loss, chunked_cross_entropy, output_head
from tests.helpers.gpu_stand_ins import as_on_a_gpu
from tests.helpers.tiny_jobs import GradRecorder, Regressor, args, llama, regression_rows, rows


def reference_loss(hidden, weight, bias, labels, num_items=None):
    logits = hidden @ weight.T + (bias if bias is not None else 0)
    shifted = nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    total = nn.functional.cross_entropy(logits.flatten(0, -2).float(), shifted.flatten(), reduction="sum")
    return total / (num_items if num_items is not None else (shifted != IGNORE_INDEX).sum())


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
@pytest.mark.parametrize("with_bias, given_items", [(False, True), (True, False)])
def test_chunked_cross_entropy_equals_the_full_loss_and_gradients(chunk, with_bias, given_items):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :6] = IGNORE_INDEX
    labels[2, 3] = IGNORE_INDEX
    items = 37 if given_items else None  # a window count larger than this micro-batch's targets
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    expected = reference_loss(hidden, weight, bias, labels, items)
    got = chunked_cross_entropy(hidden, weight, labels, items, bias=bias, chunk_tokens=chunk)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(expected, inputs), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_chunked_cross_entropy_gradients_match_finite_differences_in_float64():
    # torch.autograd.gradcheck runs backward several times through one graph, which the in-place scaling of
    # the stored gradients refuses (test below); so the finite differences are taken here, once per input
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 2] = IGNORE_INDEX
    loss = lambda: chunked_cross_entropy(hidden, weight, labels, None, bias=bias, chunk_tokens=3)
    analytic = torch.autograd.grad(loss() * 3.0, (hidden, weight, bias))  # an incoming gradient of 3
    eps = 1e-6
    for tensor, grad in zip((hidden, weight, bias), analytic, strict=True):
        flat = tensor.detach().view(-1)
        for k in range(flat.numel()):
            with torch.no_grad():
                flat[k] += eps
                up = loss().item()
                flat[k] -= 2 * eps
                down = loss().item()
                flat[k] += eps
            assert grad.view(-1)[k].item() == pytest.approx(3.0 * (up - down) / (2 * eps), abs=1e-7)


def test_a_second_backward_through_the_same_loss_is_refused():
    hidden = torch.randn(1, 6, 4, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(9, 4), torch.randint(0, 9, (1, 6)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_no_chunk_holds_more_than_chunk_elements_of_logits(monkeypatch):
    """The output layer's matmul is only ever asked for chunk x vocab logits, once per chunk: backward
    recomputes nothing, and without gradients (evaluation) no gradient is computed either."""
    shapes, linear = [], nn.functional.linear
    monkeypatch.setattr(chunked.nn.functional, "linear", lambda *a: shapes.append(linear(*a).shape) or linear(*a))
    monkeypatch.setattr(chunked, "CPU_CHUNK_BYTES", 50 * 8 * 4)  # float32: 8 bytes a logit, 4 tokens
    hidden = torch.randn(2, 20, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(50, 8), torch.randint(0, 50, (2, 20)))
    loss.backward()
    assert shapes and max(s[0] for s in shapes) == 4 and len(shapes) == 10  # 38 targets, 10 chunks, once each
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    one_hots, arange = [], torch.arange  # the gradient's "- one_hot(target)" indexes rows with an arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: one_hots.append(1) or arange(*a, **k))
    with torch.no_grad():
        no_grad = chunked_cross_entropy(hidden, torch.randn(50, 8), torch.randint(0, 50, (2, 20)))
    assert no_grad.grad_fn is None and len(shapes) == 20 and one_hots == []
    chunked_cross_entropy(hidden, torch.randn(50, 8), torch.randint(0, 50, (2, 20)))
    assert len(one_hots) == 10


def test_chunks_are_thousands_of_tokens_sized_from_the_free_memory_on_a_gpu(monkeypatch):
    """On a GPU an eighth of the free memory (clamped to 256 MiB .. 2 GiB, read once per device); on a CPU a fixed
    256 MiB: each chunk's float32 logits and their 16-bit copy fit."""
    cuda = torch.device("cuda", 0)
    for free, expected in ((120 * 2**30, 2790), (8 * 2**30, 1395), (2**30, 348)):
        chunked._gpu_chunk_budget.cache_clear()
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index, free=free: (free, 141 * 2**30))
        assert chunked.chunk_tokens_for(128256, cuda, torch.bfloat16) == expected
    chunked._gpu_chunk_budget.cache_clear()
    assert chunked.chunk_tokens_for(32000, torch.device("cpu"), torch.bfloat16) == 1398
    assert chunked.chunk_tokens_for(128256, torch.device("cpu")) == 261  # float32: 8 bytes a logit
    assert chunked.chunk_tokens_for(64, torch.device("cpu")) == chunked.MAX_CHUNK_TOKENS


def test_chunks_of_thousands_of_tokens_give_the_full_loss_and_gradients():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 1500, 16, generator=g, requires_grad=True)
    weight = torch.randn(96, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 96, (3, 1500), generator=g)
    labels[1, :200] = IGNORE_INDEX
    expected = reference_loss(hidden, weight, None, labels)
    got = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=2048)  # 4,297 targets: chunks of 2,048
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(expected, (hidden, weight)),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class Allocations(TorchDispatchMode):
    """The shape, dtype and size of every tensor an op makes (views and in-place results, which share memory
    already counted, are left out)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}  # an in-place op's or out= op's result is its input
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().data_ptr() not in given:
                self.made.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out

    def largest(self) -> int:
        return max(n for *_, n in self.made)


def test_at_a_128k_vocabulary_the_largest_tensor_is_a_chunk_not_the_logits():
    """Forward and backward at vocabulary 128,256 and 384 target tokens: the plain loss makes the [tokens, vocab]
    float32 logits (and their log-softmax and gradient); the chunked loss at most one chunk's logits (its
    budget) and the float32 weight gradient. No [vocab, hidden] 16-bit temporary per chunk: the weight gradient is
    summed in float32 in place."""
    g = torch.Generator().manual_seed(0)
    vocab, tokens = 128256, 384
    hidden = torch.randn(1, tokens + 1, 16, generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, 16, generator=g) / 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens + 1), generator=g)
    peaks = {}
    for name in ("plain", "chunked"):
        with Allocations() as seen:
            if name == "plain":
                loss = reference_loss(hidden, weight, None, labels)
            else:
                loss = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=128)  # 3 chunks
            loss.backward()
        peaks[name] = seen.largest()
        if name == "chunked":
            weight_sized = [(shape, dtype) for shape, dtype, _ in seen.made if shape == (vocab, 16)]
            # the float32 accumulator, and its cast to the weight's dtype once at the end
            assert weight_sized == [((vocab, 16), torch.float32), ((vocab, 16), torch.bfloat16)], weight_sized
        hidden.grad = weight.grad = None
    assert peaks["plain"] >= tokens * vocab * 4  # the float32 logits
    assert peaks["chunked"] <= max(128 * vocab * 4, vocab * 16 * 4)  # a chunk's float32 logits, the weight gradient
    assert peaks["chunked"] < peaks["plain"] / 2


def test_liger_is_used_only_where_the_run_opts_in_on_a_gpu(monkeypatch, fake_liger):
    """Installed, Liger's kernel is still not taken unless asked for (use_liger_kernel=True), and only on a GPU;
    asked for, it computes the sum of the target rows' losses with the weight's gradient summed in float32
    (accum_dtype), which the chunked loss then normalises as its own."""
    assert chunked.fused_kernel("cuda") is None and chunked.fused_kernel("cpu", True) is None
    assert chunked.fused_kernel("cuda", True) is not None
    chunked._liger.cache_clear()
    with monkeypatch.context() as uninstalled:
        uninstalled.setitem(__import__("sys").modules, "liger_kernel.transformers.functional", None)
        assert chunked.fused_kernel("cuda", True) is None
    chunked._liger.cache_clear()
    as_on_a_gpu(monkeypatch)
    hidden, weight = torch.randn(2, 9, 8, requires_grad=True), torch.randn(30, 8)
    labels = torch.randint(0, 30, (2, 9))
    labels[0, 4] = IGNORE_INDEX
    assert chunked_cross_entropy(hidden, weight, labels) is not None and fake_liger == []  # not opted in
    got = chunked_cross_entropy(hidden, weight, labels, num_items_in_batch=20, fused=True)
    assert fake_liger == [{"rows": 15, "dtype": torch.float32, "accum_dtype": torch.float32}]  # the 15 targets
    torch.testing.assert_close(got, reference_loss(hidden, weight, None, labels, 20))
    chunked_cross_entropy(hidden, weight, labels, chunk_tokens=4, fused=True)  # a chunk size asked for: stoker's
    assert len(fake_liger) == 1


def test_liger_reads_the_device_twice_a_micro_batch_and_stokers_chunks_never(monkeypatch, fake_liger):
    """Counted as a GPU would wait: the chunked loss's forward and backward of a training micro-batch (its target
    count known on the host) read nothing back; Liger's read twice, its count and its gradient check."""
    from tests.gpu_paths.test_syncs import HostSyncCounter

    class WithEquality(HostSyncCounter):  # torch.equal hands the host a bool: a read of the device too
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.equal.default and not self.paused:
                self.events.append(("read", str(func), ""))
            return super().__torch_dispatch__(func, types, args, kwargs)

    as_on_a_gpu(monkeypatch)
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 17, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    labels = torch.randint(0, 64, (4, 17))
    labels[:, :5] = IGNORE_INDEX  # prompts
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum())  # as the Trainer counts a training batch on the host
    reads = {}
    for fused in (False, True):
        with WithEquality() as counter:
            chunked_cross_entropy(hidden, weight, labels, targets, num_targets=targets, fused=fused).backward()
        reads[fused] = [op for kind, op, _ in counter.events if kind == "read"]
    assert reads[False] == []
    assert reads[True] == ["aten._local_scalar_dense.default", "aten.equal.default"]
    assert len(fake_liger) == 1


def test_a_torch_that_refuses_the_out_dtype_matmul_is_said_once(monkeypatch, caplog):
    """The weight gradient's 16-bit matmul into the float32 sum (torch.addmm(out_dtype=...)): where a torch build
    refuses it, one warning, and the float32 matmul from then on, with the same sum."""
    monkeypatch.setattr(chunked, "_OUT_DTYPE_MATMUL", [True])
    tried = []

    def refusing_addmm(*args, **kwargs):
        tried.append(kwargs.get("out_dtype"))
        raise RuntimeError("out_dtype is not supported for this build")

    monkeypatch.setattr(torch, "addmm", refusing_addmm)
    torch.manual_seed(0)
    probs, h = torch.randn(6, 40), torch.randn(6, 8, dtype=torch.bfloat16)
    grad_w = torch.zeros(40, 8)
    with caplog.at_level("WARNING", logger="stoker"):
        for _ in range(3):
            if not chunked._out_dtype_matmul(grad_w, probs.to(torch.bfloat16), h):
                grad_w.addmm_(probs.t(), h.float())
    assert tried == [torch.float32]  # tried once, not on every chunk
    (record,) = [r for r in caplog.records if "out_dtype" in r.getMessage()]
    assert "refuses torch.addmm(out_dtype=torch.float32)" in record.getMessage() and "not supported" in \
        record.getMessage()
    torch.testing.assert_close(grad_w, 3 * probs.t() @ h.float())


def test_the_trainer_takes_liger_for_the_chunked_loss_only_with_use_liger_kernel(tmp_path):
    plain = Trainer(llama(), args(tmp_path, chunked_loss=True), train_dataset=rows(4))
    opted = Trainer(llama(), args(tmp_path, chunked_loss=True, use_liger_kernel=True), train_dataset=rows(4))
    assert (plain._loss.fused, opted._loss.fused) == (False, True)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_equals_the_models_own_loss_and_gradients(monkeypatch, tied):
    monkeypatch.setattr(chunked, "CPU_CHUNK_BYTES", 64 * 8 * 7)  # vocab 64 in float32: chunks of 7 tokens
    batch = PaddingCollator()(rows(6, seed=1))
    own, mine = _llama(tied), _llama(tied)
    expected = own(**batch, use_cache=False).loss
    expected.backward()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    got, outputs = chunked_causal_lm_loss(mine, output_head(mine), inputs | {"use_cache": False}, batch["labels"])
    got.backward()
    assert outputs.logits.shape[1] == 0  # the model never computed its logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for (name, p), q in zip(own.named_parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


class HeadShapes(TrainerCallback):
    """Records the shape of every lm_head output from the start of training."""

    def __init__(self):
        self.shapes = []

    def on_train_begin(self, args, state, control, model=None, **kw):
        output_head(model).register_forward_hook(lambda m, i, o: self.shapes.append(tuple(o.shape)))


def test_trainer_chunked_loss_gives_the_same_update_with_exact_accumulation(tmp_path):
    data = rows(8)
    plain = Trainer(llama(), args(tmp_path / "a", per_device_train_batch_size=8, max_steps=2),
                    train_dataset=data, callbacks=[rec_plain := GradRecorder()])
    plain.train()
    shapes = HeadShapes()
    small = Trainer(llama(), args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                  max_steps=2, chunked_loss=True),
                    train_dataset=data, callbacks=[rec := GradRecorder(), shapes])
    small.train()
    for step in range(2):
        for name, g in rec_plain.grads[step].items():
            torch.testing.assert_close(rec.grads[step][name], g, atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
    losses = lambda t: [r["loss"] for r in t.state.log_history if "loss" in r]
    assert losses(small) == pytest.approx(losses(plain), abs=1e-5)
    assert len(shapes.shapes) == 8 and all(s[1] == 0 for s in shapes.shapes)  # no logits in training


def counted(batch: dict) -> dict:
    """`batch` as the Trainer's training loader hands it to the loop with chunked_loss or shared_prefix: counted on
    the host, then copied to the device (the CPU here, where the copy is the tensor itself)."""
    from stoker.data import HostCounting

    return dict(HostCounting(lambda rows: rows, "labels")(batch).to("cpu"))


def test_the_target_count_is_taken_on_the_host_and_dropped_after_an_in_place_write():
    from stoker.data import host_target_count
    from stoker.evaluation import split_batch

    torch.manual_seed(0)
    labels = torch.randint(0, 5, (6, 9))
    labels[labels == 0] = IGNORE_INDEX
    batch = counted({"input_ids": torch.randint(1, 9, (6, 9)), "labels": labels})
    assert host_target_count(batch["labels"]) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    halves = split_batch(batch, 4)  # out-of-memory halving: each part keeps its rows' counts
    assert [host_target_count(h["labels"]) for h in halves] == [
        int((labels[rows, 1:] != IGNORE_INDEX).sum()) for rows in (slice(0, 4), slice(4, 6))]
    assert host_target_count(labels.clone()) is None  # another tensor: read from the device
    batch["labels"][:, -1] = IGNORE_INDEX  # written in place (a compute_loss override masking labels)
    assert host_target_count(batch["labels"]) is None


def test_batches_collated_in_loader_workers_are_counted_when_copied():
    """A batch made in a loader worker comes back pickled: still a CountedBatch that knows its labels column, so
    its copy to the device is counted as one made in the main process."""
    from torch.utils.data import DataLoader

    from stoker.data import HostCounting, host_counts, host_target_count

    data = [{"input_ids": [1, 2, 3, i + 4], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, i + 4]} for i in range(4)]
    loader = DataLoader(data, batch_size=2, num_workers=1, collate_fn=HostCounting(PaddingCollator(), "labels"))
    for batch in loader:
        moved = batch.to("cpu")
        assert host_target_count(moved["labels"]) == 4 and host_counts(moved["input_ids"]).same_as_next == (3, 4)


def test_a_compute_loss_override_that_masks_labels_in_place_gets_the_loss_of_what_it_masked(tmp_path):
    """The batch's host count no longer holds once an override writes into its labels: the chunked loss then
    counts them on the device, and gives the model's own loss of the masked labels."""

    class MaskingFirstTargets(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs["labels"][:, :6] = IGNORE_INDEX
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    runs = []
    for chunked_on in (False, True):
        trainer = MaskingFirstTargets(llama(), args(tmp_path / str(chunked_on), per_device_train_batch_size=4,
                                                    max_steps=2, chunked_loss=chunked_on),
                                      train_dataset=rows(8), callbacks=[rec := GradRecorder()])
        trainer.train()
        runs.append(rec.grads)
    for step in range(2):
        for name, g in runs[0][step].items():
            torch.testing.assert_close(runs[1][step][name], g, atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_chunked_loss_trains_a_lora_adapter_like_the_full_loss(tmp_path):
    from peft import LoraConfig

    grads = []
    for chunk in (False, True):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        t = Trainer(llama(), args(tmp_path / str(chunk), per_device_train_batch_size=4, max_steps=1,
                                  chunked_loss=chunk),
                    train_dataset=rows(8, seed=2), peft_config=lora, callbacks=[rec := GradRecorder()])
        t.train()
        grads.append(rec.grads[0])
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=0)


def test_evaluation_with_chunked_loss_computes_logits_only_for_predictions(tmp_path):
    data = rows(10, seed=6)
    reference = Trainer(llama(), args(tmp_path / "ref", per_device_eval_batch_size=4), eval_dataset=data).evaluate()
    t = Trainer(llama(), args(tmp_path / "c", per_device_eval_batch_size=4, chunked_loss=True), eval_dataset=data,
                callbacks=[shapes := HeadShapes()])
    output_head(t.model).register_forward_hook(lambda m, i, o: shapes.shapes.append(tuple(o.shape)))
    assert t.evaluate()["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
    assert shapes.shapes and all(s[1] == 0 for s in shapes.shapes)
    shapes.shapes.clear()
    pred = t.predict(data)  # predictions are wanted: full logits, same loss
    assert pred.predictions.shape == (10, 17, 64)
    assert pred.metrics["test_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
    assert all(s[1] > 0 for s in shapes.shapes)


def test_chunked_loss_under_bf16_autocast_runs_the_head_in_bf16(tmp_path):
    batch = PaddingCollator()(rows(4, seed=3))
    model = llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**batch, use_cache=False).loss
        got, _ = chunked_causal_lm_loss(model, output_head(model), {k: v for k, v in batch.items() if k != "labels"}
                                        | {"use_cache": False}, batch["labels"])
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected.item(), abs=2e-2)  # both bf16 logits; summation order differs
    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=2, bf16=True, chunked_loss=True),
                train_dataset=rows(8))
    t.train()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in t.state.log_history if "loss" in r)


def test_chunked_loss_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ConfigError, match="chunked_loss=True: Regressor is not a transformers causal LM"):
        Trainer(Regressor(), args(tmp_path, chunked_loss=True), train_dataset=regression_rows())
    with pytest.raises(ConfigError, match="chunked_loss=True: replaces the model's own loss"):
        Trainer(llama(), args(tmp_path, chunked_loss=True), train_dataset=rows(4),
                compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.logits.sum())
    with pytest.raises(ConfigError, match="would ignore label_smoothing_factor=0.1"):
        Trainer(llama(), args(tmp_path, chunked_loss=True, label_smoothing_factor=0.1), train_dataset=rows(4))
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="output layer of LlamaForCausalLM is peft.*Linear, not a plain"):
        Trainer(llama(), args(tmp_path, chunked_loss=True), train_dataset=rows(4),
                peft_config=LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    capped = llama()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0"):
        Trainer(capped, args(tmp_path, chunked_loss=True), train_dataset=rows(4))

