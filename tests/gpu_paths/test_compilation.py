"""torch_compile on the CPU with torch.compile's eager and aot_eager backends: the decoder layers compiled in place
(stoker.compilation) hand sdpa no mask and is_causal=True for rows without padding, also when a script's collator
passes a mask of ones; batches of many lengths compile a fixed number of graphs; the probes compile nothing;
training gives the losses of the uncompiled run, with LoRA too; the whole model stays compilable."""

from __future__ import annotations

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.compilation import compile_blocks, repeated_blocks
from stoker.errors import ConfigError
from tests.gpu_paths.test_syncs import OnesMaskCollator, _llama
from tests.helpers.tiny_jobs import Regressor, args, losses, regression_rows, rows


def _compiled(block) -> bool:
    return getattr(block, "_compiled_call_impl", None) is not None


def _train(tmp_path, model, data, **kw):
    trainer = Trainer(model, args(tmp_path, per_device_train_batch_size=4, logging_steps=1, **kw), train_dataset=data)
    trainer.train()
    return trainer


@pytest.mark.parametrize("collator", [None, OnesMaskCollator()], ids=["stoker's collator", "a mask of ones"])
def test_compiled_layers_get_the_causal_kernel_without_a_mask(tmp_path, compiled_graphs, collator):
    """Rows of one length: every compiled graph calls sdpa with attn_mask=None, is_causal=True (the flash path);
    the model keeps its class and its layers are compiled in place, one graph shared by both."""
    model = _llama("sdpa")
    trainer = Trainer(model, args(tmp_path, per_device_train_batch_size=4, max_steps=2, torch_compile=True,
                                  torch_compile_backend="eager"),
                      train_dataset=rows(8, lo=16, hi=16), data_collator=collator)
    trainer.train()
    assert trainer.model_wrapped is model and all(_compiled(layer) for layer in model.model.layers)
    assert len(compiled_graphs) == 1 and compiled_graphs.attention == [[(True, True)]], compiled_graphs.attention


def test_padded_rows_keep_their_mask_and_unpadded_ones_drop_it(tmp_path, compiled_graphs):
    """Padded micro-batches need the mask: their graph calls sdpa with it; the unpadded ones of the same run use the
    causal path."""
    data = rows(4, lo=5, hi=12) + rows(4, seed=1, lo=16, hi=16)  # a padded batch, then one of equal lengths
    _train(tmp_path, _llama("sdpa"), data, max_steps=2, torch_compile_backend="eager",
           train_sampling_strategy="sequential")
    assert sorted(compiled_graphs.attention) == [[(False, False)], [(True, True)]]


def test_the_whole_model_compiled_gets_the_causal_path_for_unpadded_rows(tmp_path, compiled_graphs):
    """compile_scope='model' (transformers' whole-model compile): transformers cannot take its causal shortcut
    while tracing, but the rows the host counted as unpadded still reach sdpa without a mask."""
    trainer = _train(tmp_path, _llama("sdpa"), rows(8, lo=16, hi=16), max_steps=2, compile_scope="model",
                     torch_compile_backend="eager")
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert compiled_graphs.attention and all(calls == [(True, True)] * 2 for calls in compiled_graphs.attention)


def test_many_lengths_compile_a_fixed_number_of_graphs(tmp_path, compiled_graphs):
    """Micro-batches of 9 different lengths (and a last one of fewer rows): the layers' graphs are dynamic in
    the batch and sequence dimensions, so after the first two no batch compiles another."""
    data = [r for n in range(4, 13) for r in rows(4, seed=n, lo=n, hi=n)] + rows(2, lo=9, hi=9)
    seen = []

    class Count(__import__("stoker").TrainerCallback):
        def on_step_end(self, *a, **kw):
            seen.append(len(compiled_graphs))

    trainer = Trainer(_llama("sdpa"), args(tmp_path, per_device_train_batch_size=4, torch_compile_backend="eager",
                                           train_sampling_strategy="sequential", num_train_epochs=1),
                      train_dataset=data, callbacks=[Count()])
    trainer.train()
    assert len(seen) == 10 and seen[-1] <= 2 and seen[2:] == [seen[-1]] * 8, seen


def test_the_probes_compile_nothing(tmp_path, compiled_graphs):
    """The loss convention's probes and packing's check run a model whose layers are compiled: no graph."""
    from stoker.loss import LossConvention

    model = _llama("sdpa")
    a = args(tmp_path, torch_compile_backend="eager")
    assert compile_blocks(model, a) == 2
    convention = LossConvention(model, model, "labels", {"use_cache": False}, loss_func=False, chunked=False)
    trainer = Trainer(model, a)
    convention.decide(model, trainer.data_collator(rows(4, lo=8, hi=8)), trainer.accelerator)
    assert convention.settled and convention.honours_num_items is True
    Trainer(model, args(tmp_path, packing=True, torch_compile_backend="eager"), train_dataset=rows(8))
    assert compiled_graphs == []


@pytest.mark.slow
def test_regional_compilation_trains_like_eager(tmp_path, compiled_graphs):
    """aot_eager (Dynamo and AOTAutograd's joint graph, as inductor gets it, without code generation): padded rows,
    accumulation 2, dropout off: the same losses and parameters as the eager run."""
    data = rows(16, seed=3)
    eager = _train(tmp_path / "eager", _llama("sdpa"), data, max_steps=2, gradient_accumulation_steps=2)
    compiled = _train(tmp_path / "compiled", _llama("sdpa"), data, max_steps=2, gradient_accumulation_steps=2,
                      torch_compile_backend="aot_eager")
    assert compiled_graphs
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_a_lora_model_compiles_its_layers_in_place(tmp_path, compiled_graphs):
    """peft LoRA on every linear layer: the base model's decoder layers are the compiled blocks (with the adapters
    inside their graph), the losses are the eager run's, and the saved adapter has the same keys."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    def lora():
        return get_peft_model(_llama("sdpa"), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))

    data = rows(8, seed=5)
    eager = _train(tmp_path / "eager", lora(), data, max_steps=2)
    model = lora()
    compiled = _train(tmp_path / "compiled", model, data, max_steps=2, torch_compile_backend="eager")
    assert [type(b).__name__ for b in repeated_blocks(model)] == ["LlamaDecoderLayer"] * 2
    assert all(_compiled(b) for b in repeated_blocks(model)) and compiled_graphs
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-5)
    for t in (eager, compiled):
        t.save_model(str(tmp_path / f"{id(t)}"))
    keys = [set(load_file(str(tmp_path / f"{id(t)}" / "adapter_model.safetensors"))) for t in (eager, compiled)]
    assert keys[0] == keys[1] and keys[0]


def test_a_model_without_repeated_blocks_is_compiled_whole(tmp_path, compiled_graphs):
    """compile_scope='auto' (the default) compiles the whole model where it has no repeated blocks (a plain
    module), as transformers.Trainer compiles every model."""
    trainer = Trainer(Regressor(), args(tmp_path, per_device_train_batch_size=2, max_steps=2,
                                        torch_compile_backend="eager"), train_dataset=regression_rows(8))
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule" and compiled_graphs


def test_the_scope_is_checked_and_implies_compiling():
    assert TrainingArguments(compile_scope="blocks").torch_compile is True
    assert TrainingArguments().torch_compile is False and TrainingArguments().compile_scope == "auto"
    with pytest.raises(ConfigError, match=r"compile_scope='layers': accepted: 'auto', 'blocks', 'model'"):
        TrainingArguments(compile_scope="layers")


@pytest.mark.parametrize("setting", ["plain", "packing", "lora_chunked_loss"])
def test_compiled_layers_trace_without_a_graph_break(tmp_path, compiled_graphs, setting):
    """One training step with the decoder layers compiled: no graph break in a layer for padded rows, packed rows
    (stoker.attention, whose kernel was chosen when the run was set up: a compiled layer reads it as a constant
    rather than tracing the choice's cache and log line), and a LoRA model's layers (the adapters inside the graph)
    with the chunked loss (the layers' hidden states to the loss in chunks), in one run."""
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters

    from tests.helpers.tiny_jobs import sft_rows

    model = _llama("sdpa")
    if setting == "lora_chunked_loss":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    extra = {"packing": {"packing": True}, "lora_chunked_loss": {"chunked_loss": True}}.get(setting, {})
    data = sft_rows(16, seed=4) if setting == "packing" else rows(8, seed=2)
    counters.clear()
    _train(tmp_path, model, data, max_steps=1, torch_compile_backend="eager", **extra)
    assert compiled_graphs and dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
