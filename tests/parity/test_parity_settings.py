"""Settings transformers.Trainer honours that a script may rely on, run through both Trainers where both run:
activation checkpointing's every_n_layers and offload (stoker's offload also runs on a CPU-only host, where
transformers' fails), accelerator_config's use_seedable_sampler, and the refusals of settings that cannot run here
(use_liger_kernel without a GPU driver for triton, ddp_backend without a launch)."""

from __future__ import annotations

import pytest
import torch
import transformers
from accelerate.state import PartialState
from transformers import LlamaConfig, LlamaForCausalLM

import stoker
from stoker import ConfigError
from stoker.data import PaddingCollator
from tests.helpers.tiny_jobs import Regressor, regression_rows, rows

FRAMEWORKS = {"hf": transformers, "stoker": stoker}


def four_layer_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def settings(module, out, **kw):
    values = dict(output_dir=str(out), report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                  optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", seed=7, logging_steps=1,
                  per_device_train_batch_size=4, max_steps=2, max_grad_norm=0.0)
    values.update(kw)
    return module.TrainingArguments(**values)


def layer_runs(model) -> list[int]:
    """How often each decoder layer's MLP ran: a checkpointed layer runs it again in the backward (counted in its
    forward: torch's non-reentrant recompute calls no module hooks)."""
    runs = [0] * len(model.model.layers)

    def counted(forward, i):
        def forward_counted(*args, **kwargs):
            runs[i] += 1
            return forward(*args, **kwargs)

        return forward_counted

    for i, layer in enumerate(model.model.layers):
        layer.mlp.forward = counted(layer.mlp.forward, i)
    return runs


def trained(module, out, **kw):
    """(logged losses, layer runs, final parameters) of a 2-step run of the 4-layer Llama through `module`."""
    model = four_layer_llama()
    runs = layer_runs(model)
    trainer = module.Trainer(model, settings(module, out, **kw), train_dataset=rows(8, seed=2),
                             data_collator=PaddingCollator(0))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return losses, runs, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory):
    return trained(stoker, tmp_path_factory.mktemp("plain"))


# --- gradient_checkpointing_kwargs every_n_layers / offload --------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_every_n_layers_checkpoints_every_nth_layer_as_transformers(tmp_path, unchecked, reentrant):
    """{"every_n_layers": 2} on 4 layers: layers 0 and 2 recompute in the backward, 1 and 3 keep their activations
    (over 2 steps, 2 runs more of a checkpointed layer than without checkpointing; stoker's own forwards before the
    run, the same for every layer, count in both), as with transformers.Trainer; the run equals the one without
    checkpointing. Before, the key reached torch's checkpoint as a forward argument: every
    layer checkpointed, or "Unexpected keyword arguments: every_n_layers" with use_reentrant=True."""
    kw = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2,
                                                                          "use_reentrant": reentrant})
    ours = trained(stoker, tmp_path / "stoker", **kw)
    theirs = trained(transformers, tmp_path / "hf", **kw)
    assert theirs[1] == [4, 2, 4, 2]
    assert [a - b for a, b in zip(ours[1], unchecked[1], strict=True)] == [2, 0, 2, 0]
    assert ours[0] == pytest.approx(unchecked[0], abs=1e-6) and ours[0] == pytest.approx(theirs[0], abs=1e-6)
    for name, p in unchecked[2].items():
        torch.testing.assert_close(ours[2][name], p, atol=1e-6, rtol=0)


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, counting the tensors it packs and remembering whether it was asked to pin."""
    packed, pinned = 0, []

    def __init__(self, pin_memory=False, device_type="cuda"):
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        CountingSaveOnCpu.pinned.append(pin_memory)
        pack = self.pack_hook

        def counting(tensor):
            CountingSaveOnCpu.packed += 1
            return pack(tensor)

        self.pack_hook = counting


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_offload_puts_the_checkpointed_inputs_through_save_on_cpu_and_runs_on_a_cpu_only_host(
        tmp_path, unchecked, monkeypatch, reentrant):
    """{"offload": True}: each checkpointed layer runs under save_on_cpu (here every second one of 4, over 2
    steps: 4 entries), unpinned on the CPU, and the run equals the one without checkpointing. transformers pins on
    every host and fails on one without an accelerator."""
    if torch.accelerator.is_available():
        pytest.skip("checks the CPU-only host; on an accelerator transformers' offload runs")
    kw = dict(gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True, "use_reentrant": reentrant})
    with pytest.raises(RuntimeError, match="pin_memory=True requires"):
        trained(transformers, tmp_path / "hf", **kw)
    monkeypatch.setattr(CountingSaveOnCpu, "packed", 0)
    monkeypatch.setattr(CountingSaveOnCpu, "pinned", [])
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    losses, runs, params = trained(stoker, tmp_path / "stoker", **kw)
    assert [a - b for a, b in zip(runs, unchecked[1], strict=True)] == [2, 0, 2, 0]
    assert CountingSaveOnCpu.pinned == [False] * 4 and CountingSaveOnCpu.packed >= 4
    assert losses == pytest.approx(unchecked[0], abs=1e-6)
    for name, p in unchecked[2].items():
        torch.testing.assert_close(params[name], p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs, named", [({"every_n_layers": 0}, "every_n_layers=0"),
                                           ({"every_n_layers": "2"}, "every_n_layers='2'"),
                                           ({"offload": "yes"}, "offload='yes'")])
def test_bad_checkpointing_kwargs_are_refused_by_name(tmp_path, kwargs, named):
    with pytest.raises(ConfigError, match=f"gradient_checkpointing_kwargs {named}: accepted"):
        settings(stoker, tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)


# --- accelerator_config use_seedable_sampler=False -------------------------------------------------------------


def test_an_unseeded_shuffle_is_refused_by_name_where_transformers_draws_from_the_global_generator(tmp_path):
    """transformers trains with use_seedable_sampler=False, its order drawn from the global generator (not
    readable again by a resume); stoker refused nothing and shuffled as with True. Now train() refuses it by name
    before the first step; evaluation and an unshuffled run are unaffected."""
    unseeded = dict(accelerator_config={"use_seedable_sampler": False}, max_steps=2, per_device_train_batch_size=2)
    hf = transformers.Trainer(Regressor(as_dict=True), settings(transformers, tmp_path / "hf", **unseeded),
                              train_dataset=regression_rows(8))
    assert hf.train().global_step == 2
    ours = stoker.Trainer(Regressor(as_dict=True), settings(stoker, tmp_path / "stoker", **unseeded),
                          train_dataset=regression_rows(8), eval_dataset=regression_rows(4))
    with pytest.raises(ConfigError, match=r"accelerator_config.use_seedable_sampler=False: .* accepted: True"):
        ours.train()
    assert ours.state.global_step == 0 and "eval_loss" in ours.evaluate()
    in_order = stoker.Trainer(Regressor(as_dict=True), settings(stoker, tmp_path / "seq", **unseeded,
                                                                 train_sampling_strategy="sequential"),
                              train_dataset=regression_rows(8))
    assert in_order.train().global_step == 2


# --- refusals: use_liger_kernel on the CPU, ddp_backend without a launch -----------------------------------------


@pytest.mark.parametrize("installed", [False, True], ids=["without_liger", "with_liger"])
def test_liger_on_the_cpu_is_refused_before_the_first_step(tmp_path, monkeypatch, installed):
    """transformers patches the model and fails in the first forward, inside train(), with Triton's "0 active
    drivers" (where liger-kernel is installed); stoker refuses at train()'s start, naming use_liger_kernel and
    why, whether or not the package is there (here it is made to look installed: the refusal must not depend on
    it). Without the package both problems are named."""
    import importlib.util

    if torch.accelerator.is_available():
        pytest.skip("checks a CPU-only host")
    found = importlib.util.find_spec
    if installed:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: object() if name == "liger_kernel" else found(name, *a))
    trainer = stoker.Trainer(four_layer_llama(), settings(stoker, tmp_path, use_liger_kernel=True),
                             train_dataset=rows(8), data_collator=PaddingCollator(0))
    with pytest.raises(ConfigError) as refused:
        trainer.train()
    problems = refused.value.problems
    assert len(problems) == (1 if installed else 2) and trainer.state.global_step == 0
    assert problems[-1].startswith("use_liger_kernel=True: Liger's kernels are Triton GPU kernels, and this run is "
                                   "on the CPU") and "'0 active drivers'" in problems[-1]


def test_ddp_backend_in_a_process_no_launcher_started_is_refused_naming_the_launch(tmp_path, monkeypatch):
    """transformers.Trainer and Accelerate fail with torch's "Default process group has not been initialized";
    stoker refuses when the Trainer is built, naming ddp_backend, its value and the launchers."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # transformers' failure leaves Accelerate's process-wide state half set up, which would break every later
    # Accelerator of this process: put back what was there
    before = dict(PartialState._shared_state)
    try:
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            transformers.Trainer(Regressor(as_dict=True), settings(transformers, tmp_path / "hf", ddp_backend="gloo"),
                                 train_dataset=regression_rows(4)).train()
    finally:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(before)
    with pytest.raises(ConfigError, match=r"ddp_backend='gloo': .* started alone .*torchrun --nproc_per_node N"):
        stoker.Trainer(Regressor(as_dict=True), settings(stoker, tmp_path / "stoker", ddp_backend="gloo"),
                       train_dataset=regression_rows(4))
