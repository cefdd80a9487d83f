"""LoRA and QLoRA in the Trainer: wrapping, checkpointing of the adapter only, exact resume, merging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from stoker import ConfigError, Trainer, TrainingArguments
from stoker.cli import main as cli
from stoker.lora import merge_adapter
from tests.helpers.tiny_jobs import GradRecorder, llama, rows


def lora(**kw) -> LoraConfig:
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear",
                         "task_type": "CAUSAL_LM", **kw})


def make_args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "report_to": "none", "disable_tqdm": True, "logging_steps": 1,
            "save_strategy": "steps", "save_steps": 2, "per_device_train_batch_size": 2, "max_steps": 6,
            "learning_rate": 1e-2, "optim": "adamw_torch", "seed": 3}
    return TrainingArguments(**{**base, **kw})


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base")
    llama().save_pretrained(out)
    return out


def four_bit(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32))


def adapter_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_peft_config_trains_only_the_adapter_and_reports_it(tmp_path, capsys):
    model = llama()
    frozen = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    t = Trainer(model, make_args(tmp_path, save_strategy="no"), train_dataset=rows(8), peft_config=lora())
    t.train()
    assert isinstance(t.model, PeftModel)
    assert torch.equal(t.model.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight, frozen)
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in t.model.parameters() if p.requires_grad}
    assert "trainable parameters of" in capsys.readouterr().err


def test_an_existing_peft_model_is_used_as_is(tmp_path):
    model = get_peft_model(llama(), lora())
    t = Trainer(model, make_args(tmp_path, save_strategy="no", max_steps=1), train_dataset=rows(4))
    assert t.model is model
    with pytest.raises(ConfigError, match="already a PeftModel"):
        Trainer(model, make_args(tmp_path), train_dataset=rows(4), peft_config=lora())


def test_unknown_target_modules_name_what_the_model_has(tmp_path):
    with pytest.raises(ConfigError, match=r"\['qkv'\].*'q_proj'"):
        Trainer(llama(), make_args(tmp_path), train_dataset=rows(4), peft_config=lora(target_modules=["qkv"]))


def test_gpt2_conv1d_projections_take_an_adapter(tmp_path):
    """GPT-2's c_attn / c_proj / c_fc are transformers Conv1D layers (linear, weight transposed), which peft
    adapts: naming them is accepted and trains their adapter."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    t = Trainer(model, make_args(tmp_path, save_strategy="no", max_steps=1), train_dataset=rows(4),
                peft_config=lora(target_modules=["c_attn"]))
    t.train()
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable and all("c_attn.lora_" in n for n in trainable)


def test_a_kbit_model_needs_an_adapter(base_dir, tmp_path):
    with pytest.raises(ConfigError, match="pass peft_config"):
        Trainer(four_bit(base_dir), make_args(tmp_path), train_dataset=rows(4))


def test_gradient_checkpointing_with_lora_gives_the_same_gradients(tmp_path):
    """Non-reentrant checkpointing recomputes the same float32 graph: gradients agree to 1e-6."""
    grads = []
    for gc in (False, True):
        rec = GradRecorder()
        t = Trainer(llama(), make_args(tmp_path / str(gc), save_strategy="no", max_steps=1, gradient_checkpointing=gc,
                                       per_device_train_batch_size=4),
                    train_dataset=rows(8), peft_config=lora(), callbacks=[rec])
        t.train()
        assert t.model.get_base_model().is_gradient_checkpointing is gc
        grads.append(rec.grads[0])
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=0)


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_checkpoints_hold_the_adapter_only_and_resume_exactly(base_dir, tmp_path, quantized):
    def model():
        return four_bit(base_dir) if quantized else AutoModelForCausalLM.from_pretrained(base_dir)

    full = Trainer(model(), make_args(tmp_path / "full"), train_dataset=rows(16), peft_config=lora())
    full.train()
    names = set(p.name for p in (tmp_path / "full" / "checkpoint-2").iterdir())
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names
    resumed = Trainer(model(), make_args(tmp_path / "resumed"), train_dataset=rows(16), peft_config=lora())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    a, b = adapter_params(full.model), adapter_params(resumed.model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and the saved adapter loads with peft, with the trained weights
    loaded = PeftModel.from_pretrained(model(), tmp_path / "full" / "checkpoint-6")
    loaded_lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert loaded_lora.keys() == a.keys()
    for name in a:
        assert torch.equal(loaded_lora[name], a[name]), name


def test_merge_function_and_command_give_the_same_logits(base_dir, tmp_path):
    t = Trainer(AutoModelForCausalLM.from_pretrained(base_dir), make_args(tmp_path / "run", save_strategy="no"),
                train_dataset=rows(8), peft_config=lora())
    t.train()
    t.save_model(str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    merge_adapter(str(base_dir), str(tmp_path / "adapter"), str(tmp_path / "merged"))
    assert cli(["merge", "--base", str(base_dir), "--adapter", str(tmp_path / "adapter"),
                "--out", str(tmp_path / "merged_cli")]) == 0
    with torch.no_grad():
        reference = with_adapter.eval()(ids).logits
        for folder in ("merged", "merged_cli"):
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval()
            assert not any("lora" in n for n, _ in merged.named_parameters())
            torch.testing.assert_close(merged(ids).logits, reference, atol=1e-5, rtol=0)  # float32 merge
    missing_base = ["merge", "--base", str(tmp_path / "nope"), "--adapter", str(base_dir), "--out", str(tmp_path / "x")]
    assert cli(missing_base) == 2
