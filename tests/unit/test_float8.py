"""float8 training (TrainingArguments.fp8, stoker.float8): refused without a GPU of compute capability 8.9, the right
layers converted through torchao (its emulation on this CPU), and checkpoints of plain weights that a float8 run and
a bfloat16 run resume from each other."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stoker import ConfigError, Trainer, TrainingArguments
from stoker import arguments as arguments_module
from stoker.float8 import convert_to_float8, float8_problems
from tests.integration.test_trainer import args, rows

pytest.importorskip("torchao", reason="float8 training needs torchao (the dev extra installs it)")


def small_llama(intermediate: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64))


def test_fp8_is_refused_before_any_work_without_a_float8_gpu(tmp_path):
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path), fp8="tensorwise", bf16=True)
    (problem,) = [p for p in e.value.problems if p.startswith("fp8=")]
    assert "compute capability 8.9" in problem and "no CUDA GPU here" in problem
    with pytest.raises(ConfigError, match="fp8='e4m3': not a float8 recipe; accepted: 'tensorwise', 'rowwise'"):
        TrainingArguments(output_dir=str(tmp_path), fp8="e4m3", bf16=True)
    # an A100 (8.0) has bfloat16 but no float8 matmuls; without bf16 the second problem is named too
    older = float8_problems("rowwise", False, (8, 0))
    assert len(older) == 2 and "this GPU (compute capability 8.0) has no float8 matmuls" in older[0]
    assert "set bf16=True too" in older[1]
    assert float8_problems("rowwise", True, (9, 0)) == [] and float8_problems(None, False, None) == []


def test_the_output_layer_and_layers_not_aligned_to_16_stay_unconverted():
    model = small_llama()
    converted = convert_to_float8(model, "tensorwise", emulate=True)
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert converted == [f"model.layers.{i}.{n}" for i in range(2) for n in per_layer]
    assert type(model.lm_head) is torch.nn.Linear  # the output layer: logits feed the loss
    odd = small_llama(intermediate=72)  # the MLP's 72 is no multiple of 16: its three layers stay
    assert [n for n in convert_to_float8(odd, "rowwise", emulate=True) if "mlp" in n] == []
    assert type(odd.model.layers[0].mlp.up_proj) is torch.nn.Linear


def _float8_allowed(monkeypatch):
    """As on an H100: the device check passes (the conversion then emulates float8 on this CPU)."""
    monkeypatch.setattr(arguments_module, "float8_problems", lambda *a: [])


def test_a_float8_checkpoint_resumes_in_bfloat16_and_the_reverse(tmp_path, monkeypatch):
    _float8_allowed(monkeypatch)
    data = rows(16)
    common = dict(bf16=True, per_device_train_batch_size=4, max_steps=2, save_steps=2, save_strategy="steps")
    fp8 = Trainer(small_llama(), args(tmp_path / "fp8", fp8="tensorwise", **common), train_dataset=data)
    assert type(fp8.model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    fp8.train()
    saved = load_file(str(tmp_path / "fp8" / "out" / "checkpoint-2" / "model.safetensors"))
    plain_names = set(small_llama().state_dict())
    assert set(saved) == plain_names  # the same names and tensors as an unconverted model's
    assert all(t.dtype == torch.float32 for t in saved.values())  # the weights as trained, not float8
    trained = {n: p.detach().clone() for n, p in fp8.model.named_parameters()}

    # resumed without float8: the float8 run's weights, and training goes on from step 2
    plain = Trainer(small_llama(seed=1), args(tmp_path / "fp8", **{**common, "max_steps": 3}), train_dataset=data)
    plain.train(resume_from_checkpoint=str(tmp_path / "fp8" / "out" / "checkpoint-2"))
    assert plain.state.global_step == 3
    loaded = load_file(str(tmp_path / "fp8" / "out" / "checkpoint-3" / "model.safetensors"))
    assert set(loaded) == plain_names
    changed = [n for n in trained if not torch.equal(loaded[n], trained[n])]
    assert changed  # one more step moved them

    # and the reverse: the plain run's checkpoint resumed with float8
    again = Trainer(small_llama(seed=2), args(tmp_path / "fp8", fp8="rowwise", **{**common, "max_steps": 4}),
                    train_dataset=data)
    again.train(resume_from_checkpoint=str(tmp_path / "fp8" / "out" / "checkpoint-3"))
    assert again.state.global_step == 4
    assert type(again.model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"


def test_resuming_loads_exactly_the_saved_weights_into_either_model(tmp_path, monkeypatch):
    """The weights a float8 run saved load bit for bit into a plain model and into a float8 one."""
    _float8_allowed(monkeypatch)
    fp8 = Trainer(small_llama(), args(tmp_path, fp8="tensorwise", bf16=True, per_device_train_batch_size=4,
                                      max_steps=1), train_dataset=rows(8))
    fp8.train()
    fp8.save_model(str(tmp_path / "final"))
    weights = load_file(str(tmp_path / "final" / "model.safetensors"))
    plain, converted = small_llama(seed=3), small_llama(seed=4)
    convert_to_float8(converted, "tensorwise", emulate=True)
    for model in (plain, converted):
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert unexpected == [] and set(missing) <= {"lm_head.weight"}
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), weights[name], atol=0, rtol=0)
