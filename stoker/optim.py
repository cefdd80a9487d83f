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
    """One optimizer name: the class that builds it ('module:Class', imported when used, or TRANSFORMERS), which
    keyword arguments it takes from TrainingArguments ('adam': lr, betas, eps; 'lion': lr, betas; 'lr': lr only),
    fixed ones, the package it imports beyond stoker's own dependencies (checked when the arguments are validated;
    `pip` names its distribution where that differs), and what the run must do for it: `loop` ('modes': train()
    and eval() around evaluation, 'fused_backward': the update inside the backward, 'layerwise': one optimizer
    per parameter stepped in backward hooks), `targets` (optim_target_modules names the projected modules),
    `cuda` (needs a CUDA GPU), `unsaved` (why stoker's pickle-free checkpoints cannot hold its state) and `unsharded`
    (refused with fsdp and deepspeed, which hand the optimizer pieces of each matrix)."""

    name: str
    builds: str
    takes: str = "adam"
    fixed: dict = {}
    package: str | None = None
    pip: str | None = None
    loop: str = ""
    targets: bool = False
    cuda: bool = False
    unsaved: str = ""
    unsharded: bool = False

    @property
    def distribution(self) -> str | None:
        """The pip package that installs `package`: `pip`, else the same name."""
        return self.pip or self.package

    @property
    def needs(self) -> str:
        """What the name needs, in words (docs/arguments.md's optimizer table)."""
        parts = [f"pip install {self.distribution}"] if self.package else []
        parts += [text for flag, text in ((self.targets, "optim_target_modules"), (self.cuda, "a CUDA GPU"),
                                          (self.loop in ("fused_backward", "layerwise"),
                                           "gradient_accumulation_steps=1"),
                                          (self.loop in ("fused_backward", "layerwise"), "one process"),
                                          (self.unsaved, "save_only_model=True or save_strategy='no'"),
                                          (self.unsharded, "no fsdp or deepspeed")) if flag]
        return ", ".join(parts) or "nothing"


# built by transformers.Trainer.get_optimizer_cls_and_kwargs, with the model: the same classes and keyword
# arguments (optim_args read its way), parameter groups (GaLore / APOLLO's projected ones), LOMO's model and the
# layerwise hooks, so that nothing of what these packages need is written twice
TRANSFORMERS = "transformers"
_PROJECTORS = "its state holds the projector objects of the low-rank projection"
_SUBCLASSES = "its state is torchao tensor subclasses"
_PER_PARAMETER = "its state is one optimizer per parameter, held by backward hooks"
# (transformers' torch.save checkpoint loads it too, keyed by copies, and the resumed run starts the state afresh)
_KEYED_BY_TENSORS = "its state sits in its parameter groups keyed by the parameter tensors themselves"


def _low_rank(name: str, package: str) -> Optimizer:
    """A GaLore / APOLLO name: projects the weights of optim_target_modules; '_layerwise' steps one optimizer per
    parameter inside the backward; GaLore's '_8bit' is bitsandbytes' 8-bit state on CUDA."""
    layerwise = name.endswith("_layerwise")
    return Optimizer(name, TRANSFORMERS, package=package, pip=package.replace("_", "-"),
                     loop="layerwise" if layerwise else "", targets=True, cuda="_8bit" in name,
                     unsaved=_PER_PARAMETER if layerwise else _PROJECTORS)


# The one list of optimizer names: validation, --help and the arguments tables (docs/arguments.md) read it, and
# optimizer_cls_and_kwargs builds from it. transformers' OptimizerNames that run here, with its kwargs.
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
    *(Optimizer(name, TRANSFORMERS, package="bitsandbytes") for name in (
        "ademamix", "ademamix_8bit", "paged_ademamix_8bit", "paged_ademamix_32bit", "rmsprop_bnb",
        "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")),
    *(Optimizer(name, TRANSFORMERS, package="torchao", unsaved=_SUBCLASSES)
      for name in ("adamw_torch_4bit", "adamw_torch_8bit")),
    *(_low_rank(name, "galore_torch") for name in ("galore_adamw", "galore_adafactor", "galore_adamw_layerwise",
                                                   "galore_adamw_8bit", "galore_adamw_8bit_layerwise")),
    *(_low_rank(name, "apollo_torch") for name in ("apollo_adamw", "apollo_adamw_layerwise")),
    *(Optimizer(name, TRANSFORMERS, package="lomo_optim", pip="lomo-optim", loop="fused_backward",
                cuda=name == "adalomo") for name in ("lomo", "adalomo")),
    Optimizer("grokadamw", TRANSFORMERS, package="grokadamw", unsaved=_KEYED_BY_TENSORS),
    *(Optimizer(name, TRANSFORMERS, package="schedulefree", loop="modes")
      for name in ("schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd")),
    Optimizer("stable_adamw", TRANSFORMERS, package="optimi", pip="torch-optimi"),
    Optimizer("adamw_anyprecision", TRANSFORMERS, package="torchdistx"),  # (from github.com/pytorch/torchdistx)
    # the AdamW of an accelerator's own torch package: refused where that package is missing
    Optimizer("adamw_torch_xla", TRANSFORMERS, package="torch_xla", pip="torch-xla"),
    Optimizer("adamw_torch_npu_fused", TRANSFORMERS, package="torch_npu", pip="torch-npu"),
    # torch's Muon for the hidden layers' matrices, AdamW for the rest (stoker.muon; optim_args: its options)
    Optimizer("muon", "stoker.muon:MuonWithAdamW", unsharded=True),
)}


def optimizer_problems(args: TrainingArguments, world_size: int, on_cuda: bool) -> list[str]:
    """What args.optim needs of the other arguments and of the machine, said before any work (as transformers
    raises it when the optimizer is built, or where the run could not be what the name promises)."""
    o, p = OPTIMIZERS.get(args.optim), []
    if o is None:
        return p  # an unknown name, said by the caller
    name = f"optim={args.optim!r}"
    if o.cuda and not on_cuda:
        p.append(f"{name}: needs a CUDA GPU (its kernels have no CPU version); use "
                 f"{args.optim.replace('_8bit', '').replace('adalomo', 'lomo')!r} on the CPU")
    if o.targets and args.optim_target_modules is None:
        p.append(f"{name}: needs optim_target_modules, the modules whose linear weights it projects (a list of "
                 "names, a regular expression or 'all-linear')")
    if not o.targets and args.optim_target_modules is not None:
        p.append(f"optim_target_modules={args.optim_target_modules!r}: is read by the GaLore / APOLLO optimizers "
                 f"only ({', '.join(n for n, x in OPTIMIZERS.items() if x.targets)}); leave it unset with {name}")
    if o.loop in ("fused_backward", "layerwise") and args.gradient_accumulation_steps != 1:
        p.append(f"{name} with gradient_accumulation_steps={args.gradient_accumulation_steps}: it updates the "
                 "parameters inside each backward, so there is no gradient to accumulate; set it to 1")
    if o.loop in ("fused_backward", "layerwise") and (world_size > 1 or args.fsdp or args.deepspeed):
        p.append(f"{name} on {world_size} processes{' with fsdp or deepspeed' if args.fsdp or args.deepspeed else ''}"
                 ": it updates each parameter inside the backward, before the processes average its gradient "
                 "(Layer-wise optimizers do not support DDP); run it on one process, without fsdp or deepspeed")
    if o.unsaved and args.save_strategy != "no" and not args.save_only_model:
        p.append(f"{name} with save_strategy={args.save_strategy!r}: {o.unsaved}, which stoker's checkpoints "
                 "(safetensors and JSON, never a pickle) cannot hold; set save_only_model=True (checkpoints "
                 "without optimizer state, not resumable) or save_strategy='no'")
    return p


class _TransformersArguments:
    """`args` as transformers' optimizer builders read them: the same fields, optim as its OptimizerNames member
    (their tables are keyed by the enum, which hashes by member name)."""

    def __init__(self, args: TrainingArguments):
        from transformers.training_args import OptimizerNames

        self._args, self.optim = args, OptimizerNames(args.optim)

    def __getattr__(self, name: str):
        return getattr(self._args, name)


def optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[type, dict]:
    """The optimizer class that args.optim names and its keyword arguments, as
    transformers.Trainer.get_optimizer_cls_and_kwargs returns them (the names it builds itself need `model`)."""
    o = OPTIMIZERS[args.optim]  # a name TrainingArguments validated against this table
    if o.builds == TRANSFORMERS:
        from transformers import Trainer

        return Trainer.get_optimizer_cls_and_kwargs(_TransformersArguments(args), model)
    module, cls = o.builds.split(":")
    betas = {"betas": (args.adam_beta1, args.adam_beta2)}
    takes = {"adam": {**betas, "eps": args.adam_epsilon}, "lion": betas, "lr": {}}[o.takes]
    return getattr(importlib.import_module(module), cls), {"lr": args.learning_rate, **takes, **o.fixed,
                                                           **args.optimizer_kwargs()}


def instantiate(cls: type, kwargs: dict, groups: list[dict], model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer `cls(groups, **kwargs)`, as transformers.Trainer.create_optimizer makes it: what the builder
    handed in place of the groups (GaLore / APOLLO's projected groups as `params`, LOMO's `model`, the layerwise
    `optimizer_dict`) is used instead, and a bitsandbytes optimizer of 8-bit state keeps the embeddings' state in
    32 bits (bitsandbytes' advice for stability: an embedding row's update is too sparse for 8-bit blocks)."""
    kwargs = dict(kwargs)
    for key in ("params", "model", "optimizer_dict"):  # transformers' precedence: the last one present wins
        if key in kwargs:
            groups = kwargs.pop(key)
    optimizer = cls(groups, **kwargs)
    if cls.__module__.startswith("bitsandbytes") and kwargs.get("optim_bits") == 8:
        keep_embeddings_in_32_bits(model)
    return optimizer


def keep_embeddings_in_32_bits(model: nn.Module) -> None:
    """Register every nn.Embedding's weight for 32-bit optimizer state with bitsandbytes' GlobalOptimManager (read
    by the optimizer at its first step); its other parameters keep 8-bit state."""
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def set_mode(optimizer, mode: str) -> None:
    """optimizer.train() or .eval() where it has them (schedule-free optimizers: in eval mode the parameters are
    the average the run evaluates and saves), as transformers.Trainer calls them; nothing for the others."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    switch = getattr(inner, mode, None)
    if callable(switch):
        switch()


def fuses_backward(optimizer) -> bool:
    """Whether `optimizer` is LOMO / AdaLomo, whose fused_backward updates the parameters as the backward reaches
    them: the backward needs the learning rate, and the step itself does nothing."""
    return hasattr(getattr(optimizer, "optimizer", optimizer), "fused_backward")


def updates_in_backward(optimizer) -> bool:
    """Whether the parameters are updated inside the backward (LOMO, a layerwise optimizer's hooks), before the
    step's check could skip the update."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return fuses_backward(inner) or hasattr(inner, "optimizer_dict")


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    groups = parameter_groups(model, args.weight_decay, args.optim)
    if not groups:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    cls, kwargs = optimizer_cls_and_kwargs(args, model)
    return instantiate(cls, kwargs, groups, model)


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
    if hasattr(optimizer, "optimizer_dict"):  # transformers' LayerWiseDummyOptimizer
        return _layerwise_schedules(optimizer, args, max_steps)
    return _schedule(optimizer, args, max_steps)


def _schedule(optimizer: torch.optim.Optimizer, args: TrainingArguments, max_steps: int):
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


def _layerwise_schedules(optimizer, args: TrainingArguments, max_steps: int):
    """A layerwise optimizer's schedules: one per parameter's optimizer, stepped in a hook right after that
    parameter's update (the hook transformers' builder registered first), and the same schedule on the placeholder
    optimizer the loop steps, whose rate is logged. transformers.get_scheduler would do the same, but its
    LayerWiseDummyScheduler fails on torch's strict zip of rates and groups, and transformers.Trainer builds its
    schedule on Accelerate's wrapper, which hides the placeholder: there the parameters' rates never move."""
    schedules = {param: _schedule(inner, args, max_steps) for param, inner in optimizer.optimizer_dict.items()}
    for param in schedules:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: schedules[p].step())
    return _schedule(optimizer, args, max_steps)


def steps_on_metric(scheduler) -> bool:
    """Whether the schedule steps on an evaluation metric after each evaluation rather than after every step:
    torch's ReduceLROnPlateau and transformers' GreedyLR (lr_scheduler_type='greedy'), as transformers treats
    them. GreedyLR is looked up where transformers.optimization is already loaded: otherwise nothing built one."""
    import sys

    optimization = sys.modules.get("transformers.optimization")
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or (
        optimization is not None and isinstance(scheduler, getattr(optimization, "GreedyLR", ())))
