"""Optimizers by name and learning-rate schedules.

Only trainable parameters reach the optimizer, in two groups: with weight decay, and without it for biases
and normalisation weights (decaying those only pulls them towards zero and hurts).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .muon import muon_groups

# optim sits below arguments (TrainingArguments validates names against OPTIMIZERS): the functions here read the
# run's arguments by field name, without importing the class
TrainingArguments = Any


def _is_norm(module: nn.Module) -> bool:
    # by class name: covers torch's LayerNorm/GroupNorm/RMSNorm/BatchNorm*, and the RMSNorm classes that
    # transformers models define for themselves (LlamaRMSNorm, ...)
    return "norm" in type(module).__name__.lower()


def _decays(module: nn.Module, name: str) -> bool:
    return not (_is_norm(module) or name == "bias")


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that weight decay applies to (transformers' get_decay_parameter_names)."""
    return [f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False) if _decays(module, name)]


def parameter_groups(model: nn.Module, weight_decay: float, optim: str | None = None) -> list[dict]:
    """The trainable parameters with and without weight decay; for optim='muon', with the hidden layers' matrices in
    groups of their own (stoker.muon)."""
    decay, no_decay, seen = [], [], set()
    for _, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:  # tied weights appear twice
                continue
            seen.add(id(param))
            (decay if _decays(module, name) else no_decay).append(param)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return muon_groups(model, groups) if optim == "muon" else groups


class Optimizer(NamedTuple):
    """One optimizer name: the class that builds it ('module:Class', imported when used), which keyword arguments
    it takes from TrainingArguments ('adam': lr, betas, eps; 'lion': lr, betas; 'lr': lr only), fixed ones, and
    the pip package it needs beyond stoker's own dependencies (checked when the arguments are validated)."""

    name: str
    builds: str
    takes: str = "adam"
    fixed: dict = {}
    package: str | None = None


# The one list of optimizer names: validation, --help and the arguments table (docs/arguments.md) read it, and
# optimizer_cls_and_kwargs builds from it. A subset of transformers' OptimizerNames, with its kwargs.
OPTIMIZERS = {o.name: o for o in (
    Optimizer("adamw_torch", "torch.optim:AdamW"),
    Optimizer("adamw_torch_fused", "torch.optim:AdamW", fixed={"fused": True}),
    # a fixed learning rate as transformers.Trainer uses it, so the schedule stays in charge
    Optimizer("adafactor", "transformers.optimization:Adafactor", "lr",
              {"scale_parameter": False, "relative_step": False}),
    Optimizer("sgd", "torch.optim:SGD", "lr"),
    Optimizer("adagrad", "torch.optim:Adagrad", "lr"),
    Optimizer("rmsprop", "torch.optim:RMSprop", "lr"),
    # bitsandbytes' AdamW and Lion, told their state's bits and paging, as transformers builds them
    *(Optimizer(name, f"bitsandbytes.optim:{cls}", takes, {"optim_bits": bits, "is_paged": paged}, "bitsandbytes")
      for name, cls, takes, bits, paged in (
          ("adamw_bnb_8bit", "AdamW", "adam", 8, False), ("adamw_8bit", "AdamW", "adam", 8, False),
          ("paged_adamw_8bit", "AdamW", "adam", 8, True), ("paged_adamw_32bit", "AdamW", "adam", 32, True),
          ("lion_8bit", "Lion", "lion", 8, False), ("lion_32bit", "Lion", "lion", 32, False),
          ("paged_lion_8bit", "Lion", "lion", 8, True), ("paged_lion_32bit", "Lion", "lion", 32, True))),
    # torch's Muon for the hidden layers' matrices, AdamW for the rest (stoker.muon; optim_args: its options)
    Optimizer("muon", "stoker.muon:MuonWithAdamW"),
)}


def optimizer_cls_and_kwargs(args: TrainingArguments) -> tuple[type, dict]:
    """The optimizer class that args.optim names and its keyword arguments, as
    transformers.Trainer.get_optimizer_cls_and_kwargs returns them."""
    o = OPTIMIZERS[args.optim]  # a name TrainingArguments validated against this table
    module, cls = o.builds.split(":")
    betas = {"betas": (args.adam_beta1, args.adam_beta2)}
    takes = {"adam": {**betas, "eps": args.adam_epsilon}, "lion": betas, "lr": {}}[o.takes]
    return getattr(importlib.import_module(module), cls), {"lr": args.learning_rate, **takes, **o.fixed,
                                                           **args.optimizer_kwargs()}


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    groups = parameter_groups(model, args.weight_decay, args.optim)
    if not groups:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    cls, kwargs = optimizer_cls_and_kwargs(args)
    return cls(groups, **kwargs)


# The four schedules nearly every run uses, written with torch's LambdaLR and the same formulas as
# transformers.optimization (a test compares every step's learning rate with it). Importing that module
# imports transformers.trainer_utils, and with it peft, bitsandbytes and torch._inductor: over a second of
# start-up that a run with these schedules does not need. Every other name goes to transformers.get_scheduler.
def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0


def _constant(step: int) -> float:
    return 1.0


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, max_steps: int):
    """The learning-rate schedule `lr_scheduler_type` names, as transformers.get_scheduler builds it."""
    name, warmup, extra = args.lr_scheduler_type, args.warmup_for(max_steps), dict(args.lr_scheduler_kwargs or {})
    own = {"linear": (_linear, {"warmup": warmup, "total": max_steps}),
           "cosine": (_cosine, {"warmup": warmup, "total": max_steps, **extra}),
           "constant_with_warmup": (_constant_with_warmup, {"warmup": warmup}),
           "constant": (_constant, {})}
    if name in own and (name == "cosine" or not extra):  # transformers refuses kwargs the others do not take
        function, kwargs = own[name]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(function, **kwargs))
    from transformers import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps,
                         scheduler_specific_kwargs=extra)
