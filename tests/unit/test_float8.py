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
from tests.helpers.tiny_jobs import args, rows

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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_every_token_count_passes_the_float8_backward(recipe):
    """The weight gradient's matmul runs over the batch's tokens (its inner dimension), which torch._scaled_mm needs
    to be a multiple of 16: checked by its meta kernel, so the real (not emulated) float8 path runs here on the meta
    device, as on an H100 (148 tokens failed there before the padding; 144 passed)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32, dtype=torch.bfloat16),
                                    torch.nn.Linear(32, 64, dtype=torch.bfloat16))
    assert len(convert_to_float8(model, recipe)) == 2
    assert model[0].config.pad_inner_dim and not model[0].config.emulate
    for tokens in (148, 1, 17, 144, 2049):
        x = torch.empty(tokens, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        model(x).sum().backward()
        assert model[0].weight.grad.shape == (32, 64) and x.grad.shape == (tokens, 64)
        model.zero_grad(set_to_none=True)


def test_padding_the_token_dimension_leaves_the_gradients_exact():
    """Zeros added to the weight gradient's inner dimension add nothing: the emulated float8 gradients of 37 tokens
    equal those without padding."""
    import dataclasses

    from torchao.float8 import convert_to_float8_training

    from stoker.float8 import float8_config

    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 16)
    padded, unpadded = (torch.nn.Sequential(torch.nn.Linear(32, 16)) for _ in range(2))
    for m in (padded, unpadded):
        m[0].load_state_dict(plain.state_dict())
    config = float8_config("tensorwise", emulate=True)
    convert_to_float8_training(padded, config=config)
    convert_to_float8_training(unpadded, config=dataclasses.replace(config, pad_inner_dim=False))
    x = torch.randn(37, 32)
    for m in (padded, unpadded):
        m(x).square().sum().backward()
    torch.testing.assert_close(padded[0].weight.grad, unpadded[0].weight.grad, atol=0, rtol=0)


def test_quantized_layers_and_lora_adapters_stay_unconverted():
    """bitsandbytes' Linear4bit and Linear8bitLt subclass nn.Linear, and LoRA's A and B of rank 16 have aligned
    dimensions: none of them is a dense layer of the base that float8 can compute."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    from stoker.float8 import float8_filter, kbit_bits

    mixed = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64), bnb.nn.Linear8bitLt(64, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 64, dtype=torch.float16))
    keep = float8_filter(mixed)
    assert [keep(m, str(i)) for i, m in enumerate(mixed)] == [False, False, True, False]
    assert kbit_bits(mixed[:1]) == 4 and kbit_bits(mixed[1:]) == 8 and kbit_bits(mixed[2:]) is None

    peft_model = get_peft_model(small_llama(), LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    converted = convert_to_float8(peft_model, "tensorwise", emulate=True)
    assert not [n for n in converted if "lora_" in n]
    layer = "base_model.model.model.layers.0"
    assert f"{layer}.self_attn.q_proj.base_layer" in converted and f"{layer}.mlp.up_proj" in converted
    assert type(peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]) is torch.nn.Linear


def test_fp8_with_a_kbit_base_is_refused_before_any_work(tmp_path, monkeypatch):
    import bitsandbytes as bnb

    from stoker.recipes.args import ModelArguments, input_problems

    _float8_allowed(monkeypatch)
    model = small_llama()
    model.model.layers[0].mlp.up_proj = bnb.nn.Linear4bit(32, 64)
    with pytest.raises(ConfigError) as e:
        Trainer(model, args(tmp_path, fp8="rowwise", bf16=True), train_dataset=rows(4))
    (problem,) = [p for p in e.value.problems if p.startswith("fp8=")]
    assert "fp8='rowwise': the base is loaded in 4 bits" in problem and "load_in_4bit=False" in problem
    # a recipe names it before it loads the base
    m = ModelArguments(model_name_or_path="x", use_peft=True, load_in_8bit=True)
    training = args(tmp_path, fp8="tensorwise", bf16=True)
    (problem,) = input_problems({ModelArguments: m, TrainingArguments: training}, checks=())
    assert problem.startswith("fp8='tensorwise': the base is loaded in 8 bits")
    assert input_problems({ModelArguments: m, TrainingArguments: args(tmp_path, bf16=True)}, checks=()) == []
