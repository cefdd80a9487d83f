"""Optimizers by name and learning-rate schedules.

Only trainable parameters reach the optimizer, in two groups: with weight decay, and without it for biases
and normalisation weights (decaying those only pulls them towards zero and hurts).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .arguments import TrainingArguments


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


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for _, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:  # tied weights appear twice
                continue
            seen.add(id(param))
            (decay if _decays(module, name) else no_decay).append(param)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def _bnb(name: str):
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(f"optim={name!r} needs bitsandbytes: pip install bitsandbytes") from e
    return bnb.optim


def optimizer_cls_and_kwargs(args: TrainingArguments) -> tuple[type, dict]:
    """The optimizer class that args.optim names and its keyword arguments, as
    transformers.Trainer.get_optimizer_cls_and_kwargs returns them."""
    name, lr, extra = args.optim, args.learning_rate, args.optimizer_kwargs()
    adam = {"lr": lr, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if name == "adamw_torch":
        return torch.optim.AdamW, {**adam, **extra}
    if name == "adamw_torch_fused":
        return torch.optim.AdamW, {**adam, "fused": True, **extra}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, **extra}
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": lr, **extra}
    if name == "rmsprop":
        return torch.optim.RMSprop, {"lr": lr, **extra}
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # a fixed learning rate as transformers.Trainer uses it, so the schedule stays in charge
        return Adafactor, {"lr": lr, "scale_parameter": False, "relative_step": False, **extra}
    if name in ("adamw_bnb_8bit", "adamw_8bit"):
        return _bnb(name).AdamW8bit, {**adam, **extra}
    if name in ("paged_adamw_8bit", "paged_adamw_32bit"):
        optim = _bnb(name)
        return (optim.PagedAdamW8bit if name.endswith("8bit") else optim.PagedAdamW32bit), {**adam, **extra}
    if name in ("lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit"):
        optim = _bnb(name)
        cls = {"lion_8bit": optim.Lion8bit, "lion_32bit": optim.Lion32bit,
               "paged_lion_8bit": optim.PagedLion8bit, "paged_lion_32bit": optim.PagedLion32bit}[name]
        return cls, {"lr": lr, "betas": (args.adam_beta1, args.adam_beta2), **extra}
    raise ValueError(f"optim={name!r}: unknown optimizer")  # unreachable: TrainingArguments validates names


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    groups = parameter_groups(model, args.weight_decay)
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
