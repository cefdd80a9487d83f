"""Host syncs and torch.compile on the GPU paths, caught on the CPU: one optimizer step makes the host wait for
nothing of the device's (the step's check, deferred, is read after the next step's forwards and backwards are
queued, from a host copy), and makes no tensor from Python numbers on the device, with the model's own loss, the
chunked loss and a shared prefix; batches are copied without waiting where they are pinned, and the next one is
collated before the host waits; a compiled model serves predict() then evaluate() with the chunked loss, and the
loss-convention probe compiles nothing that training cannot reuse."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from stoker import TrainerCallback

aten = torch.ops.aten

# ops whose result needs a value of the device's memory on the host: a scalar read, or an output size that depends
# on the data (how many True values a mask has)
SCALAR_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
                aten.repeat_interleave.Tensor, aten.bincount.default}
# ops that hand the dispatcher a tensor built on the host from Python values (torch.tensor / torch.as_tensor of
# numbers or lists, a number assigned into a tensor's element). Not aten.scalar_tensor: composite ops (eager
# masks, CPU attention) make 0-d tensors with it, which on a GPU is a fill on the device, not a copy
FROM_PYTHON = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# Tensor methods that hand the host a copy of a tensor's memory without going through the dispatcher on a CPU
# tensor (on a GPU one each is a device-to-host copy that waits)
HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


def _where() -> str:
    """The innermost frames outside torch, innermost last: where a sync was asked for."""
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and __file__ != f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class HostSyncCounter(TorchDispatchMode):
    """Records every op that would make the host wait for a GPU, counted on the CPU.

    - A scalar read (`.item()`, `bool()`, `int()`, `float()` of a tensor: aten._local_scalar_dense), an op whose
      output size depends on the data (nonzero, masked_select, unique, bincount, repeat_interleave without
      output_size; indexing or index_put with a boolean mask, which is a nonzero underneath): the GPU's queue
      must drain before the host can go on.
    - `.tolist()`, `.cpu()`, `.numpy()` of a tensor (seen by a TorchFunctionMode, since on a CPU tensor they
      never reach the dispatcher): a device-to-host copy on a GPU.
    - A tensor made from Python values (torch.tensor / torch.as_tensor of numbers or lists, a number assigned into
      an element: aten.lift_fresh, lift_fresh_copy), unless empty. On a GPU such a tensor for the device is
      built on the host and copied from pageable memory, which waits; on this CPU run the device is the CPU,
      so every such tensor counts, even one a GPU run would keep on the host (conservative: the step should
      make none). Python numbers handed to an op (`x + 1`, `torch.full`, `torch.zeros`, aten.scalar_tensor
      inside composite ops) are kernel arguments or fills on the device, not copies, and do not count.

    Torch's optimizers are left out (`paused()` around optimizer.step: their step counters live on the host
    unless fused or capturable, so their `.item()` costs a GPU nothing). Each event is (kind, op, where).
    """

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, str]] = []
        self.paused = 0
        self._functions = _HostCopies(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            kind = None
            if func in SCALAR_READS or func is aten.repeat_interleave.self_Tensor and kwargs.get(
                    "output_size") is None:
                kind = "read"
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._index_put_impl_.default) and _has_bool_index(args[1]):
                kind = "read"
            elif func in FROM_PYTHON and args[0].numel():
                kind = "to_device"
            if kind:
                self.events.append((kind, str(func), _where()))
        return func(*args, **kwargs)

    def __enter__(self):
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._functions.__exit__(*exc)
        return out

    def unexpected(self, designed: str = "StepCheck.take") -> list[tuple[str, str, str]]:
        """The events not asked for from a function named `designed`."""
        return [e for e in self.events if f" {designed}" not in e[2]]


class _HostCopies(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES and not self.counter.paused:
            self.counter.events.append(("read", func.__name__, _where()))
        return func(*args, **(kwargs or {}))


class StepSyncs(TrainerCallback):
    """Counts host syncs inside every optimizer step (on_step_begin to on_step_end: the window's forwards and
    backwards, the clipping, the check and the update; the logging after it is outside), torch's optimizer step
    left out. `steps[i]` holds step i + 1's events. With `markers` (a pytest monkeypatch), each backward of the
    Trainer's backend adds ("backward", ...) and each time the host waits for a step's verdict (StepCheck.take of a
    pending step) ("wait", step of that verdict): on a GPU the wait is for the check's flags, copied to the host
    before that step's update."""

    def __init__(self, markers=None):
        self.steps, self.counter = [], None
        self._hooks = []
        if markers is not None:
            from stoker.distributed.backends import Backend
            from stoker.step import StepCheck

            backward, take = Backend.backward, StepCheck.take

            def marked_backward(backend, loss):
                self._mark("backward", "")
                return backward(backend, loss)

            def marked_take(check, received):
                if check.pending is not None:
                    self._mark("wait", check.pending.step)
                return take(check, received)

            markers.setattr(Backend, "backward", marked_backward)
            markers.setattr(StepCheck, "take", marked_take)

    def _mark(self, kind, what):
        if self.counter is not None:
            self.counter.events.append((kind, what, ""))

    def on_train_begin(self, args, state, control, **kw):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pause(*a):
            if self.counter is not None:
                self.counter.paused += 1

        def resume(*a):
            if self.counter is not None:
                self.counter.paused -= 1

        self._hooks = [register_optimizer_step_pre_hook(pause), register_optimizer_step_post_hook(resume)]

    def on_step_begin(self, args, state, control, **kw):
        self.counter = HostSyncCounter()
        self.counter.__enter__()

    def on_step_end(self, args, state, control, **kw):
        self.counter.__exit__(None, None, None)
        self.steps.append(self.counter.events)
        self.counter = None

    def on_train_end(self, args, state, control, **kw):
        for h in self._hooks:
            h.remove()


def syncs(events) -> list[tuple[str, str, str]]:
    """The events that make the host wait: reads and copies from the host, not the markers."""
    return [e for e in events if e[0] not in ("backward", "wait")]


def assert_deferred(step: int, events) -> None:
    """Step `step` waited once, for the previous step's verdict, after its own last backward; nothing else."""
    assert syncs(events) == [], f"step {step}: host syncs:\n" + "\n".join(map(str, syncs(events)))
    kinds = [e[0] for e in events]
    assert kinds.count("wait") == 1 and kinds[-1] == "wait" and "backward" in kinds, (step, events)
    assert events[-1][1] == step - 1, (step, events)  # the verdict of the step before


# --- one optimizer step: nothing read on the host but the designed check ----------------------------------

def _llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation=attention))


def _data(kind: str, lengths: str) -> list[dict]:
    from tests.helpers.tiny_jobs import prompt_rows, rows

    # 32 rows: 4 steps of 8 an epoch, so that steps 2 and 3 are no epoch's end (which settles the step at once)
    if kind == "shared_prefix":
        data = prompt_rows(32)
        if lengths == "equal":  # every row cut to the shortest: no padding, so no attention mask from the rows
            n = min(len(r["input_ids"]) for r in data)
            data = [{k: v[:n] for k, v in r.items()} for r in data]
        return data
    return rows(32) if lengths == "padded" else rows(32, lo=16, hi=16)


def _step_syncs(tmp_path, attention: str, kind: str, lengths: str, markers=None,
                optim: str = "adamw_torch_fused") -> list[list[tuple[str, str, str]]]:
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args

    counter = StepSyncs(markers)
    extra = {} if kind == "model_loss" else {kind: True}
    trainer = Trainer(_llama(attention), args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                               max_steps=3, logging_steps=1000, optim=optim, learning_rate=1e-3,
                                               **extra),
                      train_dataset=_data(kind, lengths), callbacks=[counter])
    trainer.train()
    return counter.steps


# transformers' own reads that pick the attention kernel from the padding mask (sdpa's is_causal shortcut): one
# per forward whatever stoker hands it, since an all-ones mask is read as well as a padded one
KERNEL_CHOICE = ("_ignore_causal_mask_sdpa",)


@pytest.mark.parametrize("lengths", ["padded", "equal"])
@pytest.mark.parametrize("kind", ["model_loss", "chunked_loss", "shared_prefix"])
def test_a_training_step_reads_nothing_on_the_host_but_the_agreed_check(tmp_path, kind, lengths, monkeypatch):
    """Tiny Llama, accumulation 2, eager attention (whose mask needs no read of its own), the default optimizer
    (fused AdamW, which skips a non-finite update on the device): steps 2 and 3 (step 1 holds the loss convention's
    probes, once per run) make the host wait for nothing of the device's; each waits once, for the previous step's
    verdict, after its own backwards are queued. The chunked loss's target count and the shared prefix's length,
    which the host needs (a shape, a slice), are counted on the host before the batch is copied to the device
    (stoker.data.RowCounts), so neither reads the device."""
    for step, events in enumerate(_step_syncs(tmp_path, "eager", kind, lengths, monkeypatch)[1:], start=2):
        assert_deferred(step, events)


def test_an_optimizer_that_cannot_skip_on_the_device_reads_its_verdict_in_its_own_step(tmp_path, monkeypatch):
    """SGD without fused kernels keeps the synchronous check: the host waits for the step's own verdict (one sync),
    after its backwards and before its update, which a non-finite verdict then never runs."""
    for step, events in enumerate(_step_syncs(tmp_path, "eager", "model_loss", "equal", monkeypatch, "sgd")[1:],
                                  start=2):
        kinds = [e[0] for e in events]
        assert syncs(events) == [] and kinds[-1] == "wait" and events[-1][1] == step, (step, events)


class OutOfMemoryInStep(TrainerCallback):
    """Makes the model's first forward of step `step` raise a CUDA-style out-of-memory error (once)."""

    def __init__(self, model, step: int):
        import functools

        self.step, self.armed = step, False
        forward = model.forward

        @functools.wraps(forward)  # keeps the signature, from which unused columns are dropped
        def failing(*a, **kw):
            if self.armed:
                self.armed = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(*a, **kw)

        model.forward = failing

    def on_step_begin(self, args, state, control, **kw):
        self.armed = state.global_step + 1 == self.step


def test_a_step_halved_after_running_out_of_memory_reads_nothing_more(tmp_path, monkeypatch):
    """auto_find_batch_size: an out-of-memory error in step 2 reruns its window as micro-batches of half the rows;
    their host counts are the halves of the batch's (the shared prefix of 4 rows of 8, the chunked loss's count),
    so the rerun reads the device no more than a step that fits."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, prompt_rows

    model, counter = _llama("eager"), StepSyncs(monkeypatch)
    trainer = Trainer(model, args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=3,
                                  logging_steps=1000, auto_find_batch_size=True, shared_prefix=True,
                                  chunked_loss=True, optim="adamw_torch_fused", learning_rate=1e-3),
                      train_dataset=prompt_rows(48), callbacks=[counter, OutOfMemoryInStep(model, 2)])
    trainer.train()
    assert trainer.state.train_batch_size == 4
    for step, events in enumerate(counter.steps[1:], start=2):
        assert_deferred(step, events)


def test_a_plain_modules_training_step_reads_nothing_on_the_host_but_the_agreed_check(tmp_path, monkeypatch):
    """A plain module with one label per row: the window's item count (rows, known on the host) is made on the
    device without a copy from the host."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import Regressor, args, regression_rows

    counter = StepSyncs(monkeypatch)
    Trainer(Regressor(), args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                              logging_steps=1000, optim="adamw_torch_fused", learning_rate=1e-3),
            train_dataset=regression_rows(16), callbacks=[counter]).train()
    for step, events in enumerate(counter.steps[1:], start=2):
        assert_deferred(step, events)


@pytest.mark.parametrize("lengths", ["padded", "equal"])
def test_with_sdpa_only_transformers_kernel_choice_reads_the_mask(tmp_path, lengths, monkeypatch):
    """sdpa reads the padding mask of a padded micro-batch once per forward to pick its causal kernel
    (transformers' own); a micro-batch the host counted as unpadded is not read at all (stoker.sdpa_mask, which a
    run on a CUDA device uses); nothing else is read, the packed-rows check of mask-free rows
    (find_packed_sequence_indices) included."""
    monkeypatch.setattr("stoker.trainer.answers_mask", lambda model, args, device: True)
    for events in _step_syncs(tmp_path, "sdpa", "model_loss", lengths)[1:]:
        kernel = [e for e in events if any(f" {name}" in e[2] for name in KERNEL_CHOICE)]
        others = [e for e in events if e not in kernel]
        assert others == [], "\n".join(map(str, others))
        assert len(kernel) <= (4 if lengths == "padded" else 0)  # two micro-batches, at most two reads each


class OnesMaskCollator:
    """A script's collator that always hands the model an attention mask (of ones, for rows of one length)."""

    def __call__(self, features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(
            [f["labels"] for f in features])}


def test_unpadded_rows_from_a_scripts_collator_read_no_mask(tmp_path, monkeypatch):
    """A script's collator passing an attention mask of ones: the host counts it before the copy to the device, so
    sdpa takes its causal path without a read of the mask, and the step reads nothing. (Under this counter's
    dispatch mode torch.compile runs eagerly; tests/gpu_paths/test_compilation.py checks the compiled layers'
    attention.)"""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args

    monkeypatch.setattr("stoker.trainer.answers_mask", lambda model, args, device: True)  # as on a CUDA device
    counter = StepSyncs(monkeypatch)
    Trainer(_llama("sdpa"), args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 max_steps=3, logging_steps=1000, optim="adamw_torch_fused", learning_rate=1e-3),
            train_dataset=_data("model_loss", "equal"), data_collator=OnesMaskCollator(), callbacks=[counter]).train()
    for step, events in enumerate(counter.steps[1:], start=2):
        assert_deferred(step, events)


# transformers' own check, once per forward, that mask-free rows with position_ids are packed (it reads whether any
# row restarts its positions, whatever attention then runs)
PACKED_CHECK = ("find_packed_sequence_indices",)


@pytest.mark.parametrize("setting", ["packing", "padding_free"])
def test_packed_rows_attend_within_their_sequences_without_reading_the_boundaries(tmp_path, monkeypatch, setting):
    """packing and padding_free with sdpa, 4 rows a micro-batch: the attention within each sequence
    (stoker.attention) gets its boundaries from the collator, computed on the host, so its GPU kernels read
    nothing. Run with the dense kernel (the GPU's fallback, made on the device from the boundaries; the others have
    no CPU kernel): nothing is read but transformers' packed-rows check."""
    from stoker import Trainer, attention
    from tests.helpers.tiny_jobs import args, sft_rows

    monkeypatch.setattr(attention, "kernel_for", lambda *a, **k: "dense")
    counter = StepSyncs(monkeypatch)
    trainer = Trainer(_llama("sdpa"), args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                           max_steps=3, logging_steps=1000, optim="adamw_torch_fused",
                                           learning_rate=1e-3, **{setting: True}),
                      train_dataset=sft_rows(48, seed=3), callbacks=[counter])
    assert trainer.model.config._attn_implementation == attention.NAME
    trainer.train()
    for step, events in enumerate(counter.steps[1:], start=2):
        packed_check = [e for e in events if any(f" {name}" in e[2] for name in PACKED_CHECK)]
        others = [e for e in syncs(events) if e not in packed_check]
        assert others == [], f"step {step}:\n" + "\n".join(map(str, others))
        assert len(packed_check) <= 2  # one per micro-batch


def test_the_counter_sees_each_kind_of_host_sync():
    """The helper itself: every kind it promises to count is counted, and kernel arguments are not."""
    x = torch.arange(6.0)
    with HostSyncCounter() as counter:
        x.sum().item(), bool(x.sum()), int(x.max()), x.tolist(), x.cpu(), x.numpy()
        x[x > 2], x.nonzero(), torch.as_tensor(3, device=x.device), torch.tensor([1.0, 2.0])
    kinds = [e[0] for e in counter.events]
    assert kinds.count("read") == 8 and kinds.count("to_device") == 2, counter.events
    with HostSyncCounter() as quiet:
        y = x + 1
        y.mul_(2.5).clamp_min_(0)
        torch.zeros(3), torch.full((2,), 7), torch.tensor([]), x[torch.tensor([0, 2])]
    assert quiet.events[:1] == [("to_device", "aten.lift_fresh.default",
                                 quiet.events[0][2])] and len(quiet.events) == 1  # the index list only


def test_pinned_batches_are_copied_to_the_device_without_waiting(tmp_path, monkeypatch):
    """Where the loader pins its batches (dataloader_pin_memory on a GPU), Accelerate copies them with
    non_blocking=True: a copy from pinned memory never needs the host to wait. Where nothing is pinned the copy
    stays blocking unless accelerator_config asks (as transformers: non_blocking without pinned memory warns)."""
    from stoker import Trainer
    from stoker.distributed import accelerator as accelerator_module
    from tests.helpers.tiny_jobs import args, llama, rows

    def loader_copies(**kw):
        trainer = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, **kw), train_dataset=rows(8))
        loader = trainer.get_train_dataloader()  # prepared by Accelerate, which copies each batch to the device
        assert loader._non_blocking is trainer.accelerator.dataloader_config.non_blocking
        return loader._non_blocking

    assert loader_copies() is False  # the CPU pins nothing
    assert loader_copies(accelerator_config={"non_blocking": True}) is True
    monkeypatch.setattr(accelerator_module, "pins_memory", lambda a: a.dataloader_pin_memory)
    assert loader_copies() is True  # as on a GPU with dataloader_pin_memory=True (the default)
    assert loader_copies(dataloader_pin_memory=False) is False


def test_the_next_batch_is_collated_before_the_host_waits(tmp_path, monkeypatch):
    """When the host waits for a step's verdict (in step k, after step k's backwards are queued), the batch of step
    k + 1 is collated already: Accelerate's loader fetches one batch ahead of the one it hands out (and copies that
    one without waiting where it is pinned), so the host's collation overlaps the GPU's queued work."""
    from stoker import Trainer
    from stoker.data import PaddingCollator
    from stoker.step import StepCheck
    from tests.helpers.tiny_jobs import args

    collated, seen_at_wait, take = [], {}, StepCheck.take

    def counting(rows):
        collated.append(len(rows))
        return PaddingCollator(0, always_mask=True)(rows)

    def marked_take(check, received):
        if check.pending is not None:
            seen_at_wait[check.pending.step + 1] = len(collated)
        return take(check, received)

    class Start(TrainerCallback):  # the checks of the first rows before the run collate a batch of their own
        def on_train_begin(self, args, state, control, **kw):
            collated.clear()

    monkeypatch.setattr(StepCheck, "take", marked_take)
    Trainer(_llama("eager"), args(tmp_path, per_device_train_batch_size=4, max_steps=5, logging_steps=1000,
                                  optim="adamw_torch_fused", learning_rate=1e-3),
            train_dataset=_data("model_loss", "equal"), data_collator=counting, callbacks=[Start()]).train()
    # waiting in step k (step 5's verdict is settled at the run's end): the batches of steps 1 .. k + 1 are collated
    assert {k: n for k, n in seen_at_wait.items() if k <= 5} == {2: 3, 3: 4, 4: 5, 5: 6}


# --- torch.compile -------------------------------------------------------------------------------------------

def test_a_compiled_model_evaluates_with_the_chunked_loss_after_predicting(tmp_path, compiled_graphs):
    """predict() on rows without labels compiles the forward without the chunked loss's lm_head hook; the
    loss-only evaluate() after it must not reuse that graph (Dynamo does not guard on a module's hooks)."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    data = rows(8, lo=16, hi=16)
    plain = Trainer(llama(), args(tmp_path / "plain", per_device_eval_batch_size=4, chunked_loss=True),
                    eval_dataset=data).evaluate()["eval_loss"]
    trainer = Trainer(llama(), args(tmp_path / "compiled", per_device_eval_batch_size=4, chunked_loss=True,
                                    torch_compile=True, torch_compile_backend="eager"), eval_dataset=data)
    trainer.predict([{"input_ids": r["input_ids"]} for r in data])
    assert compiled_graphs  # predict ran the compiled model
    assert trainer.evaluate()["eval_loss"] == pytest.approx(plain, abs=1e-6)


def test_a_compiled_model_trains_with_the_chunked_loss_as_the_uncompiled_one(tmp_path, compiled_graphs):
    """The bypass hook traced into the compiled graph hands the hidden states on with their gradients."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import GradRecorder, args, llama, rows

    grads = []
    for compiled in (False, True):
        extra = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}
        trainer = Trainer(llama(), args(tmp_path / str(compiled), per_device_train_batch_size=4, max_steps=2,
                                        chunked_loss=True, **extra),
                          train_dataset=rows(16, lo=16, hi=16), callbacks=[rec := GradRecorder()])
        trainer.train()
        grads.append(rec.grads)
    assert compiled_graphs and len(grads[1]) == len(grads[0]) == 2
    for plain, compiled in zip(*grads, strict=True):
        for name, g in plain.items():
            torch.testing.assert_close(compiled[name], g, atol=1e-6, rtol=1e-5)


def test_the_loss_probe_compiles_no_graph_that_training_cannot_reuse(tmp_path, compiled_graphs):
    """The loss convention's probe (2 rows) runs uncompiled: training at batch 8 compiles its decoder layers once,
    for 8 rows, and the probe's verdicts are those of the uncompiled run."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    def run(**kw):
        trainer = Trainer(llama(), args(tmp_path / str(len(kw)), per_device_train_batch_size=8, max_steps=3,
                                        logging_steps=1000, **kw), train_dataset=rows(32, lo=16, hi=16))
        trainer.train()
        return trainer._convention

    compiled = run(torch_compile=True, torch_compile_backend="eager")
    # one graph, shared by both decoder layers, whose first input is the hidden states of the 8 training rows
    assert [graph[0][0][0] for graph in compiled_graphs] == [8], compiled_graphs
    plain = run()
    assert (compiled.causal, compiled.honours_num_items) == (plain.causal, plain.honours_num_items) == (True, True)


def test_the_global_batch_routing_pass_reads_no_mask_of_unpadded_rows(tmp_path, monkeypatch):
    """moe_aux_loss_scope='global_batch' with accumulation 2: the routing pass runs every micro-batch's forward before
    the first backward, inside the same unpadded-attention scope as the training forwards (stoker.sdpa_mask), so
    sdpa's causal shortcut reads no mask on the device there either (one wait per micro-batch on a GPU otherwise).
    Mixtral's experts read their own routing (which tokens go where), which this test leaves aside; steps 2 and 3
    (step 1 holds the loss convention's probes)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from stoker import Trainer
    from tests.helpers.tiny_jobs import args
    from tests.parity.families import _moe_config

    monkeypatch.setattr("stoker.trainer.answers_mask", lambda model, args, device: True)  # as on a CUDA device
    torch.manual_seed(0)
    model = MixtralForCausalLM(_moe_config(MixtralConfig, 0.5, intermediate_size=16, num_local_experts=4,
                                           attn_implementation="sdpa"))
    counter = StepSyncs()
    Trainer(model, args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                        logging_steps=1000, moe_aux_loss_scope="global_batch"),
            train_dataset=_data("model_loss", "equal"), data_collator=OnesMaskCollator(), callbacks=[counter]).train()
    for step, events in enumerate(counter.steps[1:], start=2):  # step 1 holds the loss convention's probes
        kernel = [e for e in events if any(f" {name}" in e[2] for name in KERNEL_CHOICE)]
        assert kernel == [], f"step {step}:\n" + "\n".join(map(str, kernel))
