"""The pieces of the tiny training jobs that test files across the folders share: models, rows, arguments, a
recorder and comparisons of what a job left. Plain functions and classes, imported by name
(`from tests.helpers.tiny_jobs import llama, rows`), also by the scripts of tests/helpers/ that run in processes
of their own; the fixtures of tests/conftest.py are the factories a test asks for by argument.

    llama            a freshly initialised LlamaForCausalLM of ~40k parameters (vocabulary 64), seeded
    rows             causal-LM rows of very different lengths, some label positions masked
    sft_rows         prompt / answer rows, the prompt's labels masked, as an SFT recipe makes them
    PREFIX           a "system prompt" of 12 tokens; prompt_rows: rows that all start with it
    args             TrainingArguments of a quiet plain-SGD run (constant lr 0.5, no clipping, no checkpoints)
    Regressor        a plain nn.Module whose forward returns a mean loss (a tensor, or a dict with as_dict)
    regression_rows  its rows: 4 features and a target each
    Scalar           a one-weight module, loss (w * x)^2, NaN for a row whose x is 999
    GradRecorder     a callback copying every parameter's gradient when the optimizer is about to step
    losses           the training losses a trainer logged, in order
    params_of        a trainer's parameters by name; assert_params_close compares two such dicts
"""

from __future__ import annotations

import random

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from stoker import TrainerCallback, TrainingArguments
from stoker.data import IGNORE_INDEX


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def rows(n: int, seed: int = 0, lo: int = 3, hi: int = 17) -> list[dict]:
    """Causal-LM rows of very different lengths, with some label positions masked."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1, 63) for _ in range(rng.randint(lo, hi))]
        labels = [IGNORE_INDEX if rng.random() < 0.3 else t for t in ids]
        out.append({"input_ids": ids, "labels": labels})
    return out


def sft_rows(n: int, seed: int = 0, lo: int = 2, hi: int = 20) -> list[dict]:
    """Prompt/answer rows: the prompt's labels are -100, as an SFT recipe makes them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1, 63) for _ in range(rng.randint(lo, hi))]
        prompt = rng.randint(0, len(ids) - 1)
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


PREFIX = [5, 9, 2, 33, 17, 8, 41, 12, 3, 27, 6, 50]  # a "system prompt" every row starts with


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of PREFIX + a prompt (no targets) + an answer (targets), of different lengths (so padded)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randint(1, 63) for _ in range(rng.randint(2, 6))]
        answer = [rng.randint(1, 63) for _ in range(rng.randint(2, 8))]
        out.append({"input_ids": PREFIX + prompt + answer,
                    "labels": [IGNORE_INDEX] * (len(PREFIX) + len(prompt)) + answer})
    return out


def args(tmp_path, **kw) -> TrainingArguments:
    base = {"output_dir": str(tmp_path / "out"), "report_to": "none", "disable_tqdm": True,
            "save_strategy": "no", "logging_steps": 1, "max_grad_norm": 0.0, "optim": "sgd",
            "learning_rate": 0.5, "lr_scheduler_type": "constant", "seed": 7}
    return TrainingArguments(**{**base, **kw})


class Regressor(nn.Module):
    """A plain module: forward takes the batch's keys and returns a mean loss (a tensor or a dict)."""

    def __init__(self, as_dict: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 1))
        self.as_dict = as_dict

    def forward(self, x, labels):
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), labels)
        return {"loss": loss} if self.as_dict else loss


def regression_rows(n=12):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(-1) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class Scalar(nn.Module):
    """loss = (w * x)^2, and NaN for a row whose x is 999."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        loss = ((self.w * x) ** 2).mean()
        return {"loss": torch.where((x == 999).any(), torch.tensor(float("nan")), loss)}


class GradRecorder(TrainerCallback):
    """Copies every parameter's gradient when the optimizer is about to step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def params_of(trainer) -> dict:
    return {n: p.detach() for n, p in trainer.model.named_parameters()}
