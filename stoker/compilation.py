"""What `torch_compile` compiles: each repeated block of the model (its decoder layers) in place, or the whole model.

Compiling the blocks rather than the whole model (Accelerate's "regional compilation", torchtitan's per-block
compile) keeps transformers' attention mask and rotary tables out of the graph: they are built once per forward in
eager mode, where transformers can hand sdpa `attn_mask=None, is_causal=True` for rows without padding (its
causal shortcut, which selects the flash kernel and skips the masked triangle). Under a whole-model trace it
cannot take that shortcut on torch < 2.14 and hands sdpa an explicit mask with `is_causal=False` instead. All
blocks of one class share their graphs (Dynamo caches by code, the parameters are graph inputs), so the compile
time is one block's, whatever the depth.

The blocks are compiled in place (`nn.Module.compile`): the model keeps its class, its module tree, its
state-dict keys and its hooks, so saving, peft, DDP and the chunked loss see the same model as without
compilation. Sharded runs (FSDP, DeepSpeed) leave it to Accelerate's regional compilation, which compiles at the
point of their preparation that each needs (after activation checkpointing, before sharding).

Lengths that vary from batch to batch would recompile a static graph for every new length; the blocks are
compiled with dynamic shapes (`dynamic=True`: the batch and sequence dimensions symbolic from the first graph),
except with `packing`, whose rows all have `packing_length` tokens and keep a graph specialised to them (a last
short batch then costs one recompile, to a dynamic batch dimension).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# compile_scope's values: "auto" compiles the repeated blocks where the model has them, else the whole model
COMPILE_SCOPES = ("auto", "blocks", "model")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of every ModuleList whose children are all of one class (a transformer's layers: Llama's
    `model.model.layers`, T5's encoder and decoder blocks), outermost lists only: Accelerate's rule for regional
    compilation (`accelerate.utils.is_repeated_blocks`)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) and all(type(m) is type(child[0]) for m in child):
                found.extend(child)
            else:
                visit(child)

    visit(model)
    return found


def resolved_scope(args, model: nn.Module) -> str | None:
    """What a run compiles: "blocks", "model", or None (torch_compile off). "auto" is "blocks" where the model has
    repeated blocks, else "model"."""
    if not args.torch_compile:
        return None
    if args.compile_scope != "auto":
        return args.compile_scope
    return "blocks" if repeated_blocks(model) else "model"


def dynamic_shapes(args) -> bool | None:
    """torch.compile's `dynamic` for a run: True (sequence and batch dimensions symbolic from the first graph, so
    that varying lengths never recompile) unless packing makes every row `packing_length` tokens long (None:
    torch's default, a graph specialised to the first shapes, made dynamic on the first change)."""
    return None if args.packing else True


def compile_blocks(model: nn.Module, args) -> int:
    """Compile each repeated block of `model` in place with the run's backend and mode; returns how many. A block
    already compiled (a second train() on the same model) is left as it is."""
    blocks = repeated_blocks(model)
    kwargs = {"backend": args.torch_compile_backend or "inductor", "dynamic": dynamic_shapes(args)}
    if args.torch_compile_mode is not None:
        kwargs["mode"] = args.torch_compile_mode
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**kwargs)
    return len(blocks)


@contextlib.contextmanager
def uncompiled():
    """Runs what is inside without compiling or running a compiled graph (torch's "force_eager" stance): the
    probes (the loss convention, packing's check) run a model on a few rows once, which would compile graphs
    that training never reuses, and the batch size of their rows would make the next graph's batch dimension
    dynamic."""
    with torch.compiler.set_stance("force_eager"):
        yield
