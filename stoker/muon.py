"""optim='muon': torch's Muon for the weight matrices of the hidden layers, torch's AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each weight matrix's momentum (a few Newton-Schulz iterations) and steps along
it; it is made for the 2-D weights of hidden layers only. The rest stays with AdamW, as Moonlight and Kimi split it:
embeddings, the output layer (also when tied to the input embedding), normalisation weights, biases and every
parameter that is not 2-D. A LoRA adapter's A and B matrices of a hidden layer are 2-D weights of that layer and go to
Muon too (optim='muon' with LoRA would otherwise train nothing with Muon); those of an embedding or of the output
layer stay with AdamW.

The two run as one optimizer, `MuonWithAdamW`, so that the Trainer, the schedule, clipping, the step's check,
checkpoints, the spike rollback and `trainer.optimizer` see one torch optimizer: its `param_groups` are the two
optimizers' own group dicts (a schedule or a rollback that sets a group's lr reaches the step) and its `state` is one
dict both write into, so that torch's `state_dict()` / `load_state_dict()` over all groups are the checkpoint's
(safetensors + JSON, as any optimizer's).

Muon's learning rate is adjusted per matrix (`adjust_lr_fn`): stoker's default, 'match_rms_adamw' (Moonlight's
0.2 * sqrt(max(rows, columns))), gives Muon's update the RMS of AdamW's, so the learning_rate and weight_decay tuned for
AdamW carry over; torch's own default, 'original' (Keller Jordan's sqrt(max(1, rows / columns))), wants a larger
Muon learning rate (muon_lr in optim_args, e.g. 0.02).

Muon needs whole matrices: FSDP shards each one along its first dimension and DeepSpeed's ZeRO hands the optimizer
flat partitions, so optim='muon' is refused with either (`muon_problems`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .distributed.fsdp import fsdp_enabled

# torch.optim.Muon's Newton-Schulz coefficients (Keller Jordan's), its default
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = ("match_rms_adamw", "original")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# what optim_args may set with optim='muon', and what each accepts: Muon's options (torch.optim.Muon's names, but
# ns_eps for its `eps`, which in optim_args is Adam's), its own learning rate and weight decay, and AdamW's
OPTIONS = {
    "momentum": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "nesterov": (lambda v: isinstance(v, bool), "True or False"),
    "ns_coefficients": (lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and all(map(_number, v)),
                        "three numbers (a, b, c), e.g. (3.4445, -4.775, 2.0315)"),
    "ns_steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 100,
                 "a whole number of Newton-Schulz steps in [1, 99]"),
    "ns_eps": (lambda v: _number(v) and v > 0, "a number > 0"),
    "adjust_lr_fn": (lambda v: v in ADJUST_LR_FNS, " or ".join(map(repr, ADJUST_LR_FNS))),
    "muon_lr": (lambda v: v is None or (_number(v) and v >= 0), "a learning rate >= 0 for Muon's matrices "
                                                                 "(default: learning_rate)"),
    "muon_weight_decay": (lambda v: v is None or (_number(v) and v >= 0), "a weight decay >= 0 for Muon's matrices "
                                                                          "(default: weight_decay)"),
    "betas": (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
              "AdamW's two betas in [0, 1)"),
    "eps": (lambda v: _number(v) and v > 0, "AdamW's epsilon, a number > 0"),
}


def muon_problems(args) -> list[str]:
    """What keeps these arguments (TrainingArguments with optim='muon') from running Muon: an optim_args key or
    value it does not take, a sharding that splits its matrices. Each names the field, the value, what is accepted."""
    p = []
    try:
        options = args.optimizer_kwargs()
    except ValueError:
        options = {}  # optim_args that do not parse are reported by TrainingArguments itself
    for key, value in options.items():
        if key not in OPTIONS:
            p.append(f"optim_args={args.optim_args!r}: {key!r} is not an option of optim='muon'; accepted: "
                     f"{', '.join(OPTIONS)}")
        elif not OPTIONS[key][0](value):
            p.append(f"optim_args={args.optim_args!r}: {key}={value!r} is not accepted; {key} takes {OPTIONS[key][1]}")
    why = ("Muon orthogonalises each weight matrix whole, and {what}, so every process would orthogonalise its own "
           "piece (a different update, not Muon's); accepted with optim='muon': one process or DDP")
    if fsdp_enabled(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        p.append(f"optim='muon' with fsdp={args.fsdp!r}: "
                 + why.format(what="FSDP shards every matrix along its first dimension over the processes"))
    if args.deepspeed not in (None, "", {}) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        p.append(f"optim='muon' with deepspeed={args.deepspeed!r}: "
                 + why.format(what="DeepSpeed hands its optimizer flat partitions of the parameters"))
    return p


# ---------------------------------------------------------------------------------------------------
# which parameters Muon trains


def _output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that makes the model's outputs: transformers' get_output_embeddings() (a causal LM's lm_head), else
    the last nn.Linear registered outside the repeated blocks (nn.ModuleList) -- transformers registers a task head
    (BERT's classifier, Llama's score) after the body, a plain module its last layer last; a headless body (LlamaModel)
    has none outside its blocks."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        return head
    named = list(model.named_modules())
    blocks = [name for name, m in named if isinstance(m, nn.ModuleList)]
    linear = [m for name, m in named if isinstance(m, nn.Linear) and not any(name.startswith(f"{b}.") for b in blocks)]
    return linear[-1] if linear else None


def _input_embedding(model: nn.Module) -> nn.Module | None:
    try:  # transformers' models without token embeddings (speech, vision) raise NotImplementedError
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:
        return None
    return embedding if isinstance(embedding, nn.Module) else None


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters Muon steps: 2-D weights outside every embedding and the output layer (whose weights,
    with a LoRA adapter's, a tied weight included, stay with AdamW), each once, in the model's order."""
    edges = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    edges += [m for m in (_input_embedding(model), _output_layer(model)) if m is not None]
    outside = {id(p) for m in edges for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in outside]


def muon_groups(model: nn.Module, groups: list[dict]) -> list[dict]:
    """`groups` (stoker.optim.parameter_groups: with and without weight decay) split for MuonWithAdamW: each group's
    hidden matrices as a group of its own tagged use_muon=True (keeping the group's weight decay), after the AdamW
    groups, which keep the rest (so the first group, whose learning rate the logs show, is AdamW's where it has one)."""
    muon = {id(p) for p in hidden_matrices(model)}
    adamw = [{**g, "params": [p for p in g["params"] if id(p) not in muon], "use_muon": False} for g in groups]
    matrices = [{**g, "params": [p for p in g["params"] if id(p) in muon], "use_muon": True} for g in groups]
    return [g for g in (*adamw, *matrices) if g["params"]]


# ---------------------------------------------------------------------------------------------------
# the optimizer


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the parameter groups tagged use_muon=True, torch.optim.AdamW over the others, as one
    torch optimizer (`muon_groups` tags them; groups without the tag go to AdamW).

    lr, betas, eps and weight_decay are AdamW's, and Muon's too unless muon_lr / muon_weight_decay are given (a
    group's own lr and weight_decay win, as in any torch optimizer); momentum, nesterov, ns_coefficients, ns_steps,
    ns_eps (Muon's eps) and adjust_lr_fn are Muon's, with adjust_lr_fn='match_rms_adamw' by default (see the module).
    Its param_groups are the two optimizers' group dicts and its state one dict that both use, so that torch's
    state_dict() and load_state_dict() over every group are the checkpoint's, and a rollback's in-place restore
    reaches both."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_steps: int = 5,
                 ns_eps: float = 1e-7, adjust_lr_fn: str = "match_rms_adamw", muon_lr: float | None = None,
                 muon_weight_decay: float | None = None):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{"use_muon": False, **g} for g in groups]
        muon = [{**g, **({"lr": muon_lr} if muon_lr is not None else {}),
                 **({"weight_decay": muon_weight_decay} if muon_weight_decay is not None else {})}
                for g in groups if g["use_muon"]]
        adamw = [g for g in groups if not g["use_muon"]]
        # a side without parameters has no optimizer (torch refuses an empty one): a LoRA run whose adapters are all
        # hidden matrices has no AdamW, a model with no hidden matrix no Muon
        self._parts = [part for part in (
            adamw and torch.optim.AdamW(adamw, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
            muon and torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), eps=ns_eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn)) if part]
        # the same group dicts, in the parts' order: AdamW's, then Muon's
        super().__init__([g for part in self._parts for g in part.param_groups], {})
        self._share()
        self._built = True

    def _share(self) -> None:
        """Each part steps its own groups among this optimizer's (the same dicts) and writes into this state."""
        for part in self._parts:
            part.param_groups = [g for g in self.param_groups if g["use_muon"] == isinstance(part, torch.optim.Muon)]
            part.state = self.state

    def add_param_group(self, param_group: dict) -> None:
        """Only while the optimizer is built: a group added later would reach neither part's step."""
        if getattr(self, "_built", False):
            raise NotImplementedError("MuonWithAdamW takes its parameter groups when it is built (muon_groups tags "
                                      "each for Muon or AdamW); build a new one with every group")
        super().add_param_group(param_group)

    def __getstate__(self) -> dict:
        """torch's (defaults, state, groups) and the two parts, for a copy (copy.deepcopy) or a pickle."""
        return {**super().__getstate__(), "_parts": self._parts, "_built": True}

    def __setstate__(self, state: dict) -> None:
        """torch's; then the parts step this optimizer's groups and write into its state, which torch's
        load_state_dict (through here) replaces with new objects."""
        super().__setstate__(state)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        """One step of each part (AdamW, then Muon: they share no parameter, so the order does not matter)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss
