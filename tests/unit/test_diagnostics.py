"""Throughput diagnostics (stoker.diagnostics): the data-waiting fraction and its warning, the MFU formula and
the peak-FLOPs table, and on a GPU the MFU and peak-memory logs."""

from __future__ import annotations

import time

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.diagnostics import (
    data_wait_advice,
    flops_per_token,
    mfu,
    model_flops_shape,
    peak_tflops,
)
from tests.helpers.tiny_jobs import Regressor, args, llama, regression_rows, rows


class SlowRows(torch.utils.data.Dataset):
    """A dataset whose every row takes `delay` seconds to load (a tokeniser in __getitem__, a slow disk)."""

    def __init__(self, data, delay: float):
        self.data, self.delay = data, delay

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.data[i]


def logged(trainer, key):
    """The values of `key` in the training records of metrics.jsonl, where stoker's diagnostics are written."""
    import json
    import os

    with open(os.path.join(trainer.args.output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r[key] for r in records if key in r and "loss" in r]


def test_a_slow_dataset_warns_once_with_advice(tmp_path, capsys):
    # 200 ms of loading per step against well under a millisecond of compute: the loop around it (the step,
    # the log) took up to 180 ms with both cores shared by three test runs
    t = Trainer(Regressor(), args(tmp_path, per_device_train_batch_size=4, max_steps=4, learning_rate=0.01),
                train_dataset=SlowRows(regression_rows(16), delay=0.05))
    t.train()
    waits = logged(t, "data_wait_fraction")
    # Accelerate's loader fetches one batch ahead, so the last window has nothing left to wait for
    assert len(waits) == 4 and min(waits[:-1]) > 0.5
    err = capsys.readouterr().err
    assert err.count("waiting for data") == 1  # once per run, not once per log
    assert "dataloader_num_workers=" in err and "pack_rows" in err


def test_a_fast_dataset_does_not_warn(tmp_path, capsys, tiny_llama):
    # rows already in memory, and a model big enough that a step is far longer than collating its batch
    model = tiny_llama(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
    t = Trainer(model, args(tmp_path, per_device_train_batch_size=16, max_steps=4, logging_steps=2),
                train_dataset=rows(64, lo=48, hi=64))
    t.train()
    assert max(logged(t, "data_wait_fraction")) < 0.1
    assert "waiting for data" not in capsys.readouterr().err


def test_advice_names_what_to_change():
    cpu = data_wait_advice(0.3, TrainingArguments(output_dir="x"), on_gpu=False)
    assert "30.0%" in cpu and "dataloader_num_workers=" in cpu and "pin_memory" not in cpu
    gpu = data_wait_advice(0.3, TrainingArguments(output_dir="x", dataloader_num_workers=2,
                                                  dataloader_pin_memory=False), on_gpu=True)
    assert "more dataloader_num_workers (now 2)" in gpu and "dataloader_pin_memory=True" in gpu


# --- MFU -------------------------------------------------------------------------------------------------


def test_flops_per_token_is_palm_6n_plus_attention():
    # 6 FLOPs per trainable parameter, 12 * layers * width * sequence for attention (PaLM appendix B)
    assert flops_per_token(params=1_000_000, trainable=1_000_000, layers=2, attention_width=64, seq_len=128) \
        == 6_000_000 + 12 * 2 * 64 * 128
    # frozen parameters need no weight gradient: 4 per parameter (LoRA: only the adapter gets 6)
    assert flops_per_token(params=1_000_000, trainable=10_000) == 4_000_000 + 20_000
    # a 7B Llama at 4k context: about 6 * 6.5e9 + 12 * 32 * 4096 * 4096 = 4.55e10 FLOPs per token
    assert flops_per_token(6_476_000_000, 6_476_000_000, 32, 4096, 4096) == pytest.approx(4.53e10, rel=0.01)


def test_mfu_formula():
    # 3000 tokens/s x 4.53e10 FLOPs/token on 2 devices of 312 TFLOPS = 21.8%
    assert mfu(3000, 4.53e10, 312.0, 2) == pytest.approx(3000 * 4.53e10 / (2 * 312e12))
    assert mfu(3000, 4.53e10, 312.0, 2) == pytest.approx(0.2178, abs=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_shape_counts_matmul_parameters(tiny_llama, tied):
    model = tiny_llama(tie_word_embeddings=tied)
    params, trainable, layers, width = model_flops_shape(model)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    # an untied input embedding is a lookup, not a matmul; tied, it is the output layer and counts once
    assert params == (total if tied else total - embedding) and trainable == params
    assert (layers, width) == (2, 32)
    model.model.layers[0].requires_grad_(False)
    assert model_flops_shape(model)[1] == params - sum(p.numel() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A10", "fp16", 125.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("Tesla T4", "bf16", None),      # no bfloat16 tensor cores
    ("Some Future GPU", "bf16", None),
])
def test_peak_flops_table(name, precision, expected):
    assert peak_tflops(name, precision) == expected


def test_peak_tflops_must_be_positive():
    from stoker import ConfigError

    with pytest.raises(ConfigError, match="peak_tflops=0"):
        TrainingArguments(output_dir="x", peak_tflops=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="MFU and allocated memory are logged on GPUs")
def test_gpu_logs_mfu_and_peak_memory(tmp_path):
    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=2, peak_tflops=100.0),
                train_dataset=rows(8))
    t.train()
    assert all(0 < m < 1 for m in logged(t, "mfu")) and len(logged(t, "mfu")) == 2
    assert all(g > 0 for g in logged(t, "peak_memory_allocated_gb"))
