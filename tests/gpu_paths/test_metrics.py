"""The GPU-only figures and refusals, checked on the CPU: MFU's FLOPs count under ZeRO-3, QLoRA and packed rows,
the peak-FLOPs table's names, the bf16 refusal on a GPU that only emulates bfloat16, and the memory planner's
GPU parts (FSDP's unsharded gradients through accumulation, the foreach optimizer's copy, the allocator's and
NCCL's headroom)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stoker import ConfigError, TrainingArguments
from stoker import diagnostics as d
from stoker.memory_plan import ALLOCATOR_HEADROOM, NCCL_BUFFERS, Setup, estimate
from tests.helpers.gpu_stand_ins import fake_gpu
from tests.helpers.launching import free_port
from tests.helpers.tiny_jobs import llama
from tests.unit.test_memory_plan import SHAPE

ROOT = Path(__file__).resolve().parents[1]

# tests.test_trainer.llama() by hand: vocab 64, hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 key/value heads
LAYER = (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32) + 3 * 64 * 32 + 2 * 32  # q k v o, gate up down, two norms
MATMUL = 2 * LAYER + 32 + 64 * 32  # the layers, the final norm, lm_head (the untied input embedding is a lookup)
WIDTH, LAYERS = 4 * 8, 2


def hand_flops(params: int, trainable: int, seq_len: float) -> float:
    return 4 * params + 2 * trainable + 12 * LAYERS * WIDTH * seq_len


def model_count(model):
    return d.model_flops_shape(model)


def test_the_hand_count_is_the_models():
    model = llama()
    assert model_count(model) == (MATMUL, MATMUL, LAYERS, WIDTH)
    assert sum(p.numel() for p in model.parameters()) == MATMUL + 64 * 32


ZERO3 = """
import json, os, sys
sys.path.insert(0, {root!r})
import deepspeed.comm.torch
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the gloo group needs no shared-memory op
import deepspeed
from stoker.diagnostics import model_flops_shape
from tests.helpers.tiny_jobs import llama
deepspeed.init_distributed(dist_backend="gloo")
with deepspeed.zero.Init(config_dict_or_path={{"zero_optimization": {{"stage": 3}},
                                              "train_micro_batch_size_per_gpu": 1}}):
    model = llama()
print("RESULT " + json.dumps({{"numel": sum(p.numel() for p in model.parameters()),
                              "ds_numel": sum(p.ds_numel for p in model.parameters()),
                              "shape": model_flops_shape(model)}}))
"""


def test_zero3_partitioned_parameters_count_at_their_full_size(tmp_path):
    """A real deepspeed.zero.Init (one process, gloo, DeepSpeed's CPU accelerator): every parameter is an empty
    placeholder (numel 0) that stands for ds_numel values; MFU counts the full model."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ZERO3.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    assert result["numel"] == 0 and result["ds_numel"] == MATMUL + 64 * 32  # really partitioned
    assert tuple(result["shape"]) == (MATMUL, MATMUL, LAYERS, WIDTH)
    assert d.flops_per_token(*result["shape"], seq_len=16) == hand_flops(MATMUL, MATMUL, 16)


def test_a_qlora_model_counts_its_4bit_weights_at_full_size(tmp_path):
    """bitsandbytes packs two 4-bit values a byte (Params4bit's numel is half the weight's); the frozen base
    counts whole (4 FLOPs a parameter), the adapter 6."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    llama().save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32))
    q = base.model.layers[0].self_attn.q_proj.weight
    assert type(q).__name__ == "Params4bit" and q.numel() == 32 * 32 // 2  # packed
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    # r x (in + out) per adapted Linear: q 32+32, k 32+16, v 32+16, o 32+32, gate/up 32+64, down 64+32
    adapter = LAYERS * 4 * ((64 + 48 + 48 + 64) + 3 * 96)
    assert model.get_nb_trainable_parameters()[0] == adapter
    assert model_count(model) == (MATMUL + adapter, adapter, LAYERS, WIDTH)
    assert d.flops_per_token(*model_count(model), seq_len=16) == hand_flops(MATMUL + adapter, adapter, 16)


# --- packed rows: attention per sequence -------------------------------------------------------------------


def packed_batch(lengths_per_row: list[list[int]], row_length: int) -> dict:
    from stoker.packing import PackingCollator

    features = []
    for lengths in lengths_per_row:
        features.append({"input_ids": [1] * sum(lengths), "labels": [1] * sum(lengths),
                         "position_ids": [p for n in lengths for p in range(n)]})
    return PackingCollator(pad_to_multiple_of=row_length)(features)


def test_packed_rows_count_attention_per_sequence_not_per_row():
    lengths = [[5, 3, 7], [10, 2]]
    batch = packed_batch(lengths, row_length=16)
    assert batch["input_ids"].shape == (2, 16) and "attention_mask" not in batch
    # each pad token (position 0) is a one-token sequence of its own
    pads = 16 * 2 - sum(map(sum, lengths))
    expected = sum(n * n for row in lengths for n in row) + pads
    assert int(d.attention_pairs(batch)) == expected == 25 + 9 + 49 + 100 + 4 + pads
    assert expected < 2 * 16 ** 2  # what a row-long sequence would count
    # flash-attention's flattened form: cumulative sequence lengths
    cu = torch.tensor([0, 5, 8, 15, 25, 27])
    assert int(d.attention_pairs({"input_ids": torch.ones(1, 27), "cu_seq_lens_q": cu})) == 25 + 9 + 49 + 100 + 4
    # padded rows: each row's real length; no mask: the whole row
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert int(d.attention_pairs({"input_ids": torch.ones(2, 4), "attention_mask": mask})) == 9 + 16
    assert d.attention_pairs({"input_ids": torch.ones(3, 4, dtype=torch.long)}) == 3 * 16


class FakeAccelerator:
    """A one-process accelerator on a 'cuda' device, for LogSums.diagnostics."""

    device = SimpleNamespace(type="cuda")
    num_processes = 1

    @staticmethod
    def unwrap_model(model):
        return model


def test_the_logged_mfu_of_a_packed_window_uses_each_sequences_length(monkeypatch):
    """LogSums on a patched GPU (bf16, peak_tflops=989.4): the window's MFU is the hand-computed FLOPs of its
    tokens, attention from sum(length^2) of the packed sequences, over the peak."""
    from stoker.step import LogSums

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GH200 480GB")
    log = LogSums(torch.device("cpu"))
    lengths = [[5, 3, 7, 1], [10, 2, 4]]
    batch = packed_batch(lengths, row_length=16)  # full rows: no padding
    log.count(batch, num_processes=1)
    tokens, all_tokens, _ = log.fold_tokens(FakeAccelerator, "no")
    assert tokens == all_tokens == 32
    args = SimpleNamespace(peak_tflops=989.4, mixed_precision="bf16", dataloader_num_workers=0,
                           dataloader_pin_memory=True)
    out = log.diagnostics(args, FakeAccelerator, llama(), tokens, all_tokens, samples=2, elapsed=1e-9)
    pairs = sum(n * n for row in lengths for n in row)
    flops = tokens * (6 * MATMUL) + 12 * LAYERS * WIDTH * pairs
    assert out["mfu"] == round(flops / 1e-9 / 989.4e12, 4)
    row_long = tokens * hand_flops(MATMUL, MATMUL, 16)  # what counting each row as one sequence gives
    assert out["mfu"] < round(row_long / 1e-9 / 989.4e12, 4)


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA GH200 144G HBM3e", "tf32", 494.7),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "fp16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H800", "bf16", 989.4),
])
def test_the_peak_table_knows_the_hopper_names_cuda_reports(name, precision, expected):
    assert d.peak_tflops(name, precision) == expected


# --- bf16 on a GPU that only emulates it ---------------------------------------------------------------------


@pytest.mark.parametrize("name, capability", [("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(monkeypatch, name, capability):
    fake_gpu(monkeypatch, name, capability)
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="x", bf16=True, report_to="none")
    message = str(e.value)
    assert "bf16=True" in message and name in message and f"{capability[0]}.{capability[1]}" in message
    assert "fp16=True" in message and "8.0" in message  # what is accepted


def test_bf16_is_accepted_on_an_ampere_gpu_and_the_recipes_call_it_fast(monkeypatch):
    from stoker.recipes.args import fast_bf16

    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert TrainingArguments(output_dir="x", bf16=True, report_to="none").bf16
    assert fast_bf16(torch.device("cuda"))[0]
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert fast_bf16(torch.device("cuda")) == (False, "this GPU lacks bf16 support")


# --- the memory planner on a GPU ------------------------------------------------------------------------------


def test_fsdp_keeps_unsharded_gradients_through_an_accumulation_window():
    """FSDP's no_sync (FSDP2: set_requires_gradient_sync(False)) accumulates every parameter's full gradient
    until the window's last micro-batch: the gradients alive at the next micro-batch's backward are the whole
    model's, not a shard's."""
    one_step = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard", accumulation=1, device="cpu"))
    window = estimate(SHAPE, Setup(world_size=8, fsdp="full_shard", accumulation=4, device="cpu"))
    # the peak is then at the start of a later micro-batch's backward, with every full gradient alive
    assert window.peak - one_step.peak == pytest.approx(4 * SHAPE.params, rel=0.05)
    assert window.gradients == one_step.gradients == 4 * SHAPE.params / 8  # what the step holds: a shard
    assert window.unsharded_gradients == 4 * SHAPE.params and one_step.unsharded_gradients == 0
    ddp = estimate(SHAPE, Setup(world_size=8, accumulation=4, device="cpu"))
    assert ddp.unsharded_gradients == 0  # without FSDP the gradients are never sharded: nothing changes
    assert "FSDP no_sync grads" in window.table()


def test_the_foreach_optimizer_step_allocates_a_copy_of_the_trainable_parameters():
    gpu = estimate(SHAPE, Setup(optim="adamw_torch", micro_batch=1, seq_len=16))
    fused = estimate(SHAPE, Setup(optim="adamw_torch_fused", micro_batch=1, seq_len=16))
    # a short batch: the optimizer step is the peak, one float32 copy of the parameters above the fused one's
    assert gpu.peak - fused.peak == pytest.approx((1 + ALLOCATOR_HEADROOM) * (4 * SHAPE.params - 2 * max(
        SHAPE.vocab * SHAPE.hidden, SHAPE.intermediate * SHAPE.hidden) * 4))
    assert gpu.optimizer_copy == 4 * SHAPE.params and fused.optimizer_copy == 0
    sharded = estimate(SHAPE, Setup(optim="adamw_torch", world_size=8, fsdp="full_shard", micro_batch=1, seq_len=16))
    assert sharded.optimizer_copy == 4 * SHAPE.params / 8  # a copy of this process's shard
    offloaded = estimate(SHAPE, Setup(optim="adamw_torch", world_size=8, fsdp="full_shard offload"))
    assert offloaded.optimizer_copy == 0  # the step runs on the host
    # on the CPU torch runs the for-loop implementation: no copy (benchmarks/plan_accuracy.py's estimates)
    assert estimate(SHAPE, Setup(optim="adamw_torch", device="cpu")).optimizer_copy == 0


def test_gpu_estimates_leave_headroom_for_the_allocator_and_nccl_and_cpu_ones_do_not():
    cpu = estimate(SHAPE, Setup(device="cpu", optim="adamw_torch_fused"))
    gpu = estimate(SHAPE, Setup(device="cuda", optim="adamw_torch_fused"))
    tensors = cpu.peak  # no context, no headroom on the CPU
    assert gpu.peak == pytest.approx(tensors * (1 + ALLOCATOR_HEADROOM) + gpu.context)
    eight, eight_cpu = (estimate(SHAPE, Setup(device=device, world_size=8, fsdp="full_shard"))
                        for device in ("cuda", "cpu"))
    assert eight.peak == pytest.approx(eight_cpu.peak * (1 + ALLOCATOR_HEADROOM) + eight.context + NCCL_BUFFERS)
    assert cpu.allocator == cpu.nccl == cpu.context == 0
    assert gpu.allocator == pytest.approx(ALLOCATOR_HEADROOM * tensors) and gpu.nccl == 0  # one process
    assert eight.nccl == NCCL_BUFFERS and "NCCL buffers" in eight.table() and "allocator headroom" in eight.table()
    assert "NCCL buffers" not in cpu.table() and "allocator headroom" not in cpu.table()
