"""The memory planner (stoker.memory_plan): each part follows its setting, proposals keep the global batch and fit,
and `stoker plan` prints both. Accuracy against measured memory is benchmarks/plan_accuracy.py's job."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from stoker.memory_plan import GIB, ModelShape, Setup, estimate, propose

SHAPE = ModelShape(params=7_000_000_000, linear_params=6_400_000_000, embedding_params=262_000_000, tied=False,
                   layers=32, hidden=4096, kv_width=1024, intermediate=14336, vocab=128256,
                   linear_shapes=((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
                                  (14336, 4096), (4096, 14336)))


def test_model_shape_from_a_model_and_from_its_config_agree(tiny_llama):
    model = tiny_llama()
    shape = ModelShape.from_model(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.kv_width, shape.intermediate, shape.vocab) == (2, 32, 16, 64, 64)
    assert shape.linear_params == 2 * (32 * 32 * 2 + 16 * 32 * 2 + 64 * 32 * 3) and not shape.tied
    assert len(shape.linear_shapes) == 7
    assert ModelShape.from_config(model.config) == shape  # built on the meta device: no memory


def test_optimizer_state_by_optimizer():
    per_param = {name: estimate(SHAPE, Setup(optim=name)).optimizer / SHAPE.params
                 for name in ("adamw_torch", "adamw_8bit", "lion_32bit", "sgd", "adafactor")}
    assert per_param["adamw_torch"] == 8 and per_param["adamw_8bit"] == 2 and per_param["lion_32bit"] == 4
    assert per_param["sgd"] == 0 and 0 < per_param["adafactor"] < 0.01  # factored: rows + columns per matrix


def test_async_save_counts_a_host_copy_of_the_checkpoint():
    """One checkpoint in flight: the saved model and the optimizer state in host memory, per process (a LoRA
    adapter alone; FSDP's shards), not on the device."""
    plain, background = estimate(SHAPE, Setup()), estimate(SHAPE, Setup(async_save=True))
    assert plain.snapshot == 0 and background.snapshot == background.weights + background.optimizer
    assert background.peak == plain.peak and "host (async_save)" in background.table()
    lora = estimate(SHAPE, Setup(lora_r=16, async_save=True))
    assert lora.snapshot == pytest.approx(12 * (lora.weights - SHAPE.params * 4) / 4)  # 4 + 8 bytes per LoRA value
    sharded = estimate(SHAPE, Setup(world_size=4, fsdp="full_shard", async_save=True))
    assert sharded.snapshot == pytest.approx(background.snapshot / 4)


def test_spike_rollback_counts_its_pinned_snapshot_in_host_memory_per_process():
    """spike_rollback pins host copies of the trainable parameters and the optimizer state on every process: 12
    bytes per parameter with float32 AdamW, each of a node's DDP processes its own; FSDP shards them."""
    plain, rolling = estimate(SHAPE, Setup()), estimate(SHAPE, Setup(spike_rollback=True))
    assert plain.rollback == 0 and rolling.rollback == 12 * SHAPE.params
    assert rolling.peak == plain.peak and "host (rollback)" in rolling.table()
    assert estimate(SHAPE, Setup(world_size=8, spike_rollback=True)).rollback == 12 * SHAPE.params  # DDP: each
    assert estimate(SHAPE, Setup(world_size=8, fsdp="full_shard", spike_rollback=True)).rollback == (
        pytest.approx(12 * SHAPE.params / 8))
    lora = estimate(SHAPE, Setup(weights_dtype="bfloat16", lora_r=16, spike_rollback=True))
    assert lora.rollback == pytest.approx(12 * (lora.weights - SHAPE.params * 2) / 4)  # float32 adapters only


def test_the_trainer_refuses_or_warns_about_the_rollback_snapshot_before_any_work(tiny_llama, make_args, clm_rows,
                                                                                 monkeypatch, caplog):
    import logging

    from stoker import Trainer
    from stoker.errors import ConfigError
    from stoker.memory_plan import rollback_line

    model, args = tiny_llama(), make_args(spike_rollback=True, max_steps=2, optim="adamw_torch")
    per_process = 12 * sum(p.numel() for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # a node of 8 DDP processes, each with its own snapshot
    level, line = rollback_line(model, args, 8, memory=(8 * per_process - 1, 8 * per_process))
    assert level == "error" and "spike_rollback=True" in line and "spike_rollback=False" in line
    assert f"{per_process / 2**20:.1f} MiB of pinned host memory per process" in line
    assert f"{8 * per_process / 2**20:.1f} MiB for the 8 process(es)" in line
    assert rollback_line(model, args, 8, memory=(10 * per_process, 15 * per_process))[0] == "warning"
    assert rollback_line(model, args, 8, memory=(10 * per_process, 17 * per_process))[0] == "info"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr("stoker.memory_plan.host_memory", lambda: (per_process - 1, per_process))
    trainer = Trainer(model, args, train_dataset=clm_rows(8))
    with pytest.raises(ConfigError, match="spike_rollback=True"):
        trainer.train()
    assert trainer.state.global_step == 0
    monkeypatch.setattr("stoker.memory_plan.host_memory", lambda: (4 * per_process, per_process))
    with caplog.at_level(logging.WARNING, logger="stoker"):
        Trainer(tiny_llama(), args, train_dataset=clm_rows(8)).train()
    assert [r.getMessage() for r in caplog.records if "spike_rollback=True" in r.getMessage()] == [
        rollback_line(model, args, 1, memory=(4 * per_process, per_process))[1]]


def test_weights_gradients_and_lora():
    full = estimate(SHAPE, Setup())
    assert full.weights == 4 * SHAPE.params and full.gradients == 4 * SHAPE.params
    bf16 = estimate(SHAPE, Setup(weights_dtype="bfloat16"))
    assert bf16.weights == 2 * SHAPE.params and bf16.gradients == 2 * SHAPE.params
    lora = estimate(SHAPE, Setup(weights_dtype="bfloat16", lora_r=16))
    adapters = 16 * sum(o + i for o, i in SHAPE.linear_shapes) * SHAPE.layers
    assert lora.gradients == 4 * adapters and lora.optimizer == 8 * adapters  # float32 adapters only
    qlora = estimate(SHAPE, Setup(weights_dtype="bfloat16", lora_r=16, quantization=4))
    assert qlora.weights < 0.35 * bf16.weights  # 4-bit linear layers, the rest in bfloat16
    assert qlora.peak < lora.peak < full.peak


def test_activations_follow_batch_checkpointing_and_chunked_loss():
    base = Setup(micro_batch=4, seq_len=2048)
    plain = estimate(SHAPE, base)
    assert estimate(SHAPE, dataclasses.replace(base, micro_batch=8)).activations == 2 * plain.activations
    checkpointed = estimate(SHAPE, dataclasses.replace(base, gradient_checkpointing=True))
    assert checkpointed.activations < plain.activations / 8
    chunked = estimate(SHAPE, dataclasses.replace(base, chunked_loss=True))
    assert plain.logits == 3 * 4 * 2048 * SHAPE.vocab * 4  # float32 log-softmax and two gradients
    # a chunk of thousands of tokens (2 GiB of logits at most) and the float32 weight gradient
    assert chunked.logits < plain.logits / 2 and chunked.peak < plain.peak


def test_fsdp_shards_and_offload_moves_state_to_the_host():
    alone = estimate(SHAPE, Setup())
    sharded = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard"))
    assert sharded.optimizer == alone.optimizer / 8 and sharded.gradients == alone.gradients / 8
    assert alone.weights / 8 < sharded.weights < alone.weights / 4  # a shard plus the gathered layers
    offloaded = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard offload"))
    assert offloaded.optimizer == 0 and offloaded.host > sharded.optimizer and offloaded.peak < sharded.peak
    assert estimate(SHAPE, Setup(world_size=1, fsdp="full_shard")).peak == alone.peak  # nothing to shard over


# the tiny Llama of tests/distributed/test_parallelism.py: hidden 64, MLP 128, 2 layers, 4 heads, 2 KV heads of 16
TINY = ModelShape(params=82_240, linear_params=2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3), embedding_params=4096,
                  tied=False, layers=2, hidden=64, kv_width=32, intermediate=128, vocab=64, heads=4)


def test_the_tiny_llama_shape_is_read_from_the_model(tiny_llama):
    assert ModelShape.from_model(tiny_llama(hidden_size=64, intermediate_size=128)) == dataclasses.replace(
        TINY, linear_shapes=((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)))


def test_tensor_parallelism_divides_its_shards_and_the_sharded_projections_activations():
    """tp_size=2: the decoder Linear weights (73,728), the embedding and the output layer (4,096 each) are halved,
    the norms (320) whole on each rank: 41,280 parameters a process, with their gradients and AdamW's 8 bytes; per
    token and layer the norms keep 2 x 3h = 384 values and the halved projections (q, its rotary copy, the output:
    3h, k and v: 2kv, the gated MLP: 4i) 768 / 2; the final norm 3h. No DDP buckets: the model is never wrapped."""
    setup = Setup(micro_batch=2, seq_len=16, world_size=2, tp_size=2, device="cpu")
    alone, sharded = estimate(TINY, dataclasses.replace(setup, world_size=1, tp_size=1)), estimate(TINY, setup)
    assert (sharded.weights, sharded.gradients, sharded.optimizer) == (4 * 41_280, 4 * 41_280, 8 * 41_280)
    assert (alone.weights, alone.gradients, alone.optimizer) == (4 * 82_240, 4 * 82_240, 8 * 82_240)
    tokens = 2 * 16
    assert alone.activations == tokens * 4 * (2 * (2 * 192 + 768) + 192)
    assert sharded.activations == tokens * 4 * (2 * (2 * 192 + 768 / 2) + 192)
    assert sharded.logits == alone.logits == 3 * tokens * 64 * 4  # gathered whole on every rank
    assert sharded.buckets == 0 and estimate(TINY, dataclasses.replace(setup, tp_size=1)).buckets > 0
    assert setup.global_batch == 2  # both ranks read the same rows
    rolling = estimate(TINY, dataclasses.replace(setup, spike_rollback=True, async_save=True))
    assert rolling.rollback == 12 * 41_280 and rolling.snapshot == 12 * 41_280  # a process's own shards


def test_fsdp2_by_the_fsdp_plan_divides_by_dp_shard_size():
    """dp_shard_size=2: every parameter, gradient and optimizer value is halved, plus the two layers gathered
    whole while computed (37,024 parameters each: the model but its embedding and output layer, per layer); the
    gradients are reduce-scattered after each micro-batch, so accumulation keeps only the shards."""
    setup = Setup(micro_batch=1, seq_len=16, accumulation=2, world_size=2, dp_shard_size=2, device="cpu")
    sharded = estimate(TINY, setup)
    assert sharded.weights == 4 * 82_240 / 2 + 2 * 4 * 37_024
    assert (sharded.gradients, sharded.optimizer) == (4 * 82_240 / 2, 8 * 82_240 / 2)
    assert sharded.buckets == sharded.unsharded_gradients == 0 and setup.global_batch == 4
    assert sharded.activations == estimate(TINY, dataclasses.replace(setup, world_size=1, dp_shard_size=1)).activations
    assert estimate(TINY, dataclasses.replace(setup, spike_rollback=True)).rollback == 12 * 82_240 / 2


def test_the_trainers_lines_and_stoker_plan_read_parallelism_config(tiny_llama, make_args, tmp_path):
    from stoker.cli import setup_from_arguments
    from stoker.memory_plan import async_save_line, describe, rollback_line

    model, args = tiny_llama(hidden_size=64, intermediate_size=128), make_args(optim="adamw_torch")
    buffers = sum(b.numel() * 4 for b in model.buffers())
    level, line = rollback_line(model, args, 2, memory=(2**40, 2**40), parallelism={"tp_size": 2})
    share = 41_280 / 82_240
    assert f"{(share * (4 * 82_240 + buffers) + share * 8 * 82_240) / 2**20:.1f} MiB" in line
    assert f"{12 * 82_240 / 2**20:.1f} MiB" in rollback_line(model, args, 2, memory=(2**40, 2**40))[1]
    assert f"{(12 * 82_240 + buffers) / 2 / 2**20:.1f} MiB" in async_save_line(model, args, 2, {"dp_shard_size": 2})
    args.parallelism_config = {"tp_size": 2}
    setup = setup_from_arguments(SimpleNamespace(), SimpleNamespace(max_length=16), args, 2)
    assert (setup.tp_size, setup.dp_shard_size, setup.global_batch) == (2, 1, args.per_device_train_batch_size)
    assert "parallelism_config tp_size=2, dp_shard_size=1 (1 data-parallel rank(s))" in describe(setup)


def test_propose_keeps_the_global_batch_and_fits_cheapest_first():
    setup = Setup(micro_batch=16, seq_len=2048, accumulation=2, world_size=8, weights_dtype="bfloat16",
                  mixed_precision="bf16")
    assert estimate(SHAPE, setup).peak > 40 * GIB
    option, fitted = propose(SHAPE, setup, 40 * GIB)
    assert fitted.peak <= 40 * GIB and option.global_batch == setup.global_batch
    assert option.fsdp is not None  # 7B with its AdamW state (78 GiB before activations) needs sharding
    assert estimate(SHAPE, dataclasses.replace(option, fsdp=None)).peak > 40 * GIB  # sharding was needed
    assert option.micro_batch >= 2  # not the slowest setting that fits: a few rows per micro-batch are kept
    lora = dataclasses.replace(setup, world_size=1, lora_r=16, quantization=4)
    option, fitted = propose(SHAPE, lora, 24 * GIB)  # QLoRA on one 24 GiB card
    assert fitted.peak <= 24 * GIB and option.micro_batch * option.accumulation == 32 and option.fsdp is None
    assert propose(SHAPE, lora, 1000 * GIB)[0].micro_batch == 32  # room to spare: the largest micro-batch
    assert propose(SHAPE, Setup(world_size=1), 8 * GIB) is None  # 7B in float32 with AdamW on 8 GiB: no


def test_stoker_plan_command_prints_the_parts_and_a_proposal(capsys):
    from stoker.cli import main

    assert main(["plan", "--recipe", "clm", "--per_device_train_batch_size", "64", "--max_length", "512"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer state", "activations", "logits and loss", "peak (estimated)"):
        assert part in out
    assert main(["plan", "--recipe", "clm", "--per_device_train_batch_size", "64", "--max_length", "512",
                 "--budget_gb", "0.2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "to fit 0.2 GiB: micro-batch" in out and "global batch 64" in out
    assert main(["plan", "--recipe", "clm", "--budget_gb", "0.0001"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main(["plan", "--recipe", "clm", "--async_save"]) == 0  # the flag, as the recipes parse it
    assert "host (async_save)" in capsys.readouterr().out
    assert main(["plan", "--recipe", "clm", "--spike_rollback"]) == 0
    assert "host (rollback)" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--per_device_train_batch_size", "0"], ["--no_such_field", "1"]])
def test_stoker_plan_reports_bad_configuration(capsys, bad):
    from stoker.cli import main

    assert main(["plan", *bad]) == 2
    assert "stoker:" in capsys.readouterr().err


def test_training_a_causal_lm_prints_its_plan_first(tmp_path, capsys):
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=1), train_dataset=rows(4)).train()
    err = capsys.readouterr().err
    longest = max(len(r["input_ids"]) for r in rows(4))
    assert "memory plan: about" in err and f"for rows of {longest} tokens" in err


# --- families, distribution and precision -----------------------------------------------------------------


def tiny(family: str, **kw):
    import transformers as t

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    if family == "gpt2":
        config = t.GPT2Config(n_embd=32, n_inner=96, n_layer=2, n_head=4, vocab_size=64)
        config._attn_implementation = kw.get("attention", "sdpa")
        return t.GPT2LMHeadModel(config)
    if family == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=32, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                            vocab_size=64, word_embed_proj_dim=32))
    if family == "gpt-neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**sizes))
    return t.BertForMaskedLM(t.BertConfig(**sizes))


def test_model_shape_reads_each_family_from_its_modules_and_config():
    found = {f: ModelShape.from_model(tiny(f)) for f in ("gpt2", "opt", "gpt-neox", "bert")}
    described = {f: (s.norm, s.mlp, s.rotary, s.attention_dropout, s.hidden_dropout, s.masked_lm, s.tied)
                 for f, s in found.items()}
    assert described == {"gpt2": ("layer", "gelu_new", False, 0.1, 0.1, False, True),
                         "opt": ("layer", "relu", False, 0.0, 0.1, False, True),
                         "gpt-neox": ("layer", "gelu", True, 0.0, 0.0, False, False),
                         "bert": ("layer", "gelu", False, 0.1, 0.1, True, True)}
    # GPT-2's Conv1D layers are Linear layers stored transposed: c_attn, attn c_proj, c_fc, mlp c_proj
    assert found["gpt2"].linear_shapes == ((96, 32), (32, 32), (96, 32), (32, 96))
    assert found["gpt2"].intermediate == 96 and found["gpt2"].linear_params == 2 * 32 * (96 + 32 + 96 + 96)
    llama = ModelShape.from_model(__import__("tests.helpers.tiny_jobs", fromlist=["llama"]).llama())
    assert (llama.norm, llama.mlp, llama.rotary) == ("rms", "gated", True)


def test_eager_attention_keeps_its_probabilities_and_sdpa_does_not():
    eager, sdpa = (ModelShape.from_model(tiny("gpt2", attention=a)) for a in ("eager", "sdpa"))
    assert eager.attention == "eager" and sdpa.attention == "sdpa"
    setup = Setup(micro_batch=2, seq_len=128)
    extra = estimate(eager, setup).activations - estimate(sdpa, setup).activations
    # per layer and token: heads x seq probabilities, their dropped copy and the dropout mask (a byte each)
    assert extra == 2 * 128 * 2 * 4 * 128 * 2.25 * 4
    # on the CPU, sdpa with attention dropout runs torch's math kernel, which keeps them too
    cpu = dataclasses.replace(setup, device="cpu")
    assert estimate(sdpa, cpu).activations == estimate(eager, cpu).activations


def test_ddp_buckets_offload_with_one_process_and_mixed_precision_casts():
    one, two = estimate(SHAPE, Setup(world_size=1)), estimate(SHAPE, Setup(world_size=2))
    assert two.buckets == two.gradients == 4 * SHAPE.params and one.buckets == 0
    assert (two.peak - two.allocator - two.nccl) - (one.peak - one.allocator) == two.buckets  # before headroom
    offloaded = estimate(SHAPE, Setup(world_size=1, fsdp="full_shard offload"))
    assert offloaded.host == 16 * SHAPE.params and offloaded.optimizer == offloaded.gradients == 0
    assert offloaded.weights < SHAPE.params  # two gathered layers in float32 are all that stay on the device
    mixed = estimate(SHAPE, Setup(mixed_precision="bf16"))
    pure = estimate(SHAPE, Setup(mixed_precision="bf16", weights_dtype="bfloat16"))
    plain_activations = estimate(SHAPE, Setup(weights_dtype="bfloat16")).activations
    assert pure.activations == plain_activations  # 16-bit weights: nothing to cast
    # float32 master weights: autocast's 16-bit copies of every Linear weight and of lm_head live to backward
    assert mixed.activations - pure.activations == 2 * (SHAPE.linear_params + SHAPE.vocab * SHAPE.hidden)
    assert estimate(SHAPE, Setup(device="cpu")).context == 0 < one.context


# Accelerate's FSDP benchmark (GPT-2 Large and XL, fp32, AdamW, block size 12, 24 GiB GPUs): what fit and what
# ran out of memory. (model, sharding, processes, micro-batch per process, fitted)
SEED_TABLE = [
    ("large", None, 2, 7, True), ("large", "shard_grad_op", 2, 11, True), ("large", "full_shard", 2, 15, True),
    ("large", "full_shard offload", 2, 22, True), ("xl", None, 1, 1, False), ("xl", None, 2, 1, False),
    ("xl", "full_shard", 2, 5, True), ("xl", "full_shard offload", 1, 10, True),
    ("xl", "full_shard offload", 2, 14, True),
]


def test_the_seed_table_of_gpt2_large_and_xl_fits_where_it_fit():
    from transformers import GPT2Config

    shapes = {}
    for name, (width, layers, heads) in {"large": (1280, 36, 20), "xl": (1600, 48, 25)}.items():
        config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, architectures=["GPT2LMHeadModel"])
        config._attn_implementation = "eager"  # as transformers ran GPT-2 then
        shapes[name] = ModelShape.from_config(config)
    assert round(shapes["large"].params / 1e6) == 774 and round(shapes["xl"].params / 1e6) == 1558
    predicted = [estimate(shapes[m], Setup(micro_batch=b, seq_len=12, world_size=w, fsdp=f)).peak <= 24 * GIB
                 for m, f, w, b, _ in SEED_TABLE]
    assert predicted == [fitted for *_, fitted in SEED_TABLE]


def test_stoker_plan_reads_a_model_folder_a_config_json_and_says_what_fits(tmp_path, capsys):
    import json

    from stoker.cli import main

    tiny("gpt2").config.save_pretrained(tmp_path / "gpt2")
    for source in (str(tmp_path / "gpt2"), str(tmp_path / "gpt2" / "config.json")):
        assert main(["plan", source, "--max_length", "64", "--budget_gb", "0.6"]) == 0
        out = capsys.readouterr().out
        assert "layer norm, gelu_new MLP, sdpa attention" in out and "0.1M parameters" in out
        assert "largest micro-batch per device within 0.6 GiB with 1 process(es), 64 tokens per row" in out
        ddp, fsdp, offload = (int(re.search(rf"{re.escape(n)}\s+(\d+)", out).group(1))
                              for n in ("DDP", "FSDP (full_shard)", "FSDP + CPU offload"))
        assert 0 < ddp <= fsdp <= offload
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "no-such-model"}))
    for bad in (str(tmp_path / "bad.json"), str(tmp_path / "missing-folder")):
        assert main(["plan", bad]) == 2
        assert f"model_name_or_path={bad!r}:" in capsys.readouterr().err


def test_stoker_plan_reads_a_hub_id_when_the_hub_answers(monkeypatch, capsys):
    from transformers import AutoConfig

    from stoker import preflight
    from stoker.cli import main

    asked = []

    def hub(name, *args, **kwargs):  # the hub, answering for one model only (this machine has no network)
        asked.append(name)
        return tiny("gpt-neox").config

    def hub_has(repo_id, repo_type):  # what the input check asks the hub before any work
        return None if repo_id == "org/tiny-neox" else (
            "not a local folder, not in the local cache, and the hub is unreachable")

    monkeypatch.setattr(AutoConfig, "from_pretrained", hub)
    monkeypatch.setattr(preflight, "_ask_hub", hub_has)
    assert main(["plan", "org/tiny-neox", "--max_length", "64"]) == 0
    assert "layer norm, gelu MLP, sdpa attention" in capsys.readouterr().out
    assert main(["plan", "org/unreachable"]) == 2
    assert asked == ["org/tiny-neox"]  # an unreachable model is refused before anything loads it
    assert ("model_name_or_path='org/unreachable': not a local folder, not in the local cache, and the hub is "
            "unreachable") in capsys.readouterr().err


def test_largest_micro_batch_is_the_edge_of_the_budget():
    from stoker.memory_plan import largest_micro_batch

    setup = Setup(micro_batch=1, seq_len=512, world_size=8, fsdp="full_shard")
    budget = 40 * GIB
    most = largest_micro_batch(SHAPE, setup, budget)
    assert estimate(SHAPE, dataclasses.replace(setup, micro_batch=most)).peak <= budget
    assert estimate(SHAPE, dataclasses.replace(setup, micro_batch=most + 1)).peak > budget
    assert largest_micro_batch(SHAPE, Setup(world_size=1), 8 * GIB) == 0


def test_model_shape_of_a_lora_model_is_that_of_its_base(tiny_llama):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    plain = ModelShape.from_model(model)
    assert ModelShape.from_model(get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))) == plain
