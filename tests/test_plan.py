"""The memory planner (stoker.plan): each part follows its setting, proposals keep the global batch and fit,
and `stoker plan` prints both. Accuracy against measured memory is benchmarks/plan_accuracy.py's job."""

from __future__ import annotations

import dataclasses

import pytest

from stoker.plan import GIB, ModelShape, Setup, estimate, propose

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
    assert chunked.logits < plain.logits / 5 and chunked.peak < plain.peak


def test_fsdp_shards_and_offload_moves_state_to_the_host():
    alone = estimate(SHAPE, Setup())
    sharded = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard"))
    assert sharded.optimizer == alone.optimizer / 8 and sharded.gradients == alone.gradients / 8
    assert alone.weights / 8 < sharded.weights < alone.weights / 4  # a shard plus the gathered layers
    offloaded = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard offload"))
    assert offloaded.optimizer == 0 and offloaded.host > sharded.optimizer and offloaded.peak < sharded.peak
    assert estimate(SHAPE, Setup(world_size=1, fsdp="full_shard")).peak == alone.peak  # nothing to shard over


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
                 "--budget_gb", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "to fit 0.2 GiB: micro-batch" in out and "global batch 64" in out
    assert main(["plan", "--recipe", "clm", "--budget_gb", "0.0001"]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--per_device_train_batch_size", "0"], ["--no_such_field", "1"]])
def test_stoker_plan_reports_bad_configuration(capsys, bad):
    from stoker.cli import main

    assert main(["plan", *bad]) == 2
    assert "stoker:" in capsys.readouterr().err


def test_training_a_causal_lm_prints_its_plan_first(tmp_path, capsys):
    from stoker import Trainer
    from tests.test_trainer import args, llama, rows

    Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=1), train_dataset=rows(4)).train()
    err = capsys.readouterr().err
    longest = max(len(r["input_ids"]) for r in rows(4))
    assert "memory plan: about" in err and f"for rows of {longest} tokens" in err
