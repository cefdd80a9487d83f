"""Tensor parallelism and FSDP2 applied by transformers' own plans: `parallelism_config` (Accelerate's
ParallelismConfig, a dict or a JSON string, as transformers.Trainer takes it) and models that transformers sharded at
load (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=..., dp_replicate_size=...))`).

    read_parallelism_config   the setting as Accelerate's ParallelismConfig, or the problems with it
    parallelism_problems      what stoker refuses, from the arguments alone (TrainingArguments' validation)
    run_parallelism           the ParallelismConfig the Accelerator is built with: the arguments', or the layout of
                              a model transformers sharded at load; refuses a model that does not fit it
    shard_with_plans          a model not yet sharded, sharded by its tp_plan / fsdp_plan as from_pretrained would
    clip_across_meshes        gradient clipping over parameters whose gradients live on different meshes

Context parallelism (cp_size > 1, with the fsdp setting's FSDP2) is stoker.distributed.context_parallel's, sequence
parallelism (sp_size > 1, in DeepSpeed) stoker.distributed.sequence_parallel's: their refusals are gathered here with
the others.

What the layouts share: the ranks of one tensor-parallel group read the same rows (Accelerate's data loader follows
the device mesh), so tokens are counted and the loss normalised over the data-parallel ranks only
(`data_parallel_size`); a sharded model is never wrapped in DDP (its DTensors carry their own collectives).

On a CPU, Accelerate's check of a ParallelismConfig against the Accelerator does not count CPU processes as devices
(gloo runs DTensor tensor parallelism and FSDP2 all the same); stoker's config relaxes that one check for its own
Accelerator (StokerParallelismConfig), nothing process-wide.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..errors import ConfigError, suggest
from .context_parallel import context_parallel_problems
from .fsdp import fsdp_enabled
from .sequence_parallel import sequence_handler, sequence_model_problems, sequence_parallel_problems, splits_sequences

# the sizes of a ParallelismConfig, as Accelerate names them, and its other settings
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
SETTINGS = SIZES + ("cp_backend", "sp_backend", "tp_handler", "cp_handler", "sp_handler")


def _parallelism_class():
    from accelerate import ParallelismConfig

    class StokerParallelismConfig(ParallelismConfig):
        """Accelerate's ParallelismConfig whose check against the Accelerator counts CPU processes (gloo) as
        devices, as it counts GPUs: that check alone refuses tensor parallelism on CPU processes, which run it."""

        def _validate_accelerator(self, accelerator):
            super()._validate_accelerator(_ProcessesAsDevices(accelerator))

    return StokerParallelismConfig


class _ProcessesAsDevices:
    """An Accelerator seen by ParallelismConfig's check, with CPU processes counted as devices."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    @property
    def multi_device(self) -> bool:
        acc = self._accelerator
        return acc.multi_device or str(acc.distributed_type).rsplit(".", 1)[-1] == "MULTI_CPU"

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def describe(config) -> str:
    """`parallelism_config={'tp_size': 2}`: the sizes that are not 1, as messages name the value."""
    return f"parallelism_config={ {n: getattr(config, n) for n in SIZES if getattr(config, n) != 1}!r}"


def parallelism_sizes(config) -> dict:
    """A ParallelismConfig's sizes and backends as plain values (how the arguments write it to JSON)."""
    return {k: getattr(config, k) for k in SETTINGS if not k.endswith("_handler")}


def read_parallelism_config(value):
    """(Accelerate's ParallelismConfig or None, problems) for a parallelism_config given as a ParallelismConfig or
    a dict (TrainingArguments has already parsed a JSON string)."""
    from accelerate import ParallelismConfig

    if value is None or isinstance(value, ParallelismConfig):
        return value, []
    accepted = "accepted: Accelerate's ParallelismConfig, a dict or a JSON object string of its fields"
    if not isinstance(value, dict):
        return None, [f"parallelism_config={value!r}: {accepted}"]
    unknown = [k for k in value if k not in SETTINGS]
    if unknown:
        return None, [f"parallelism_config[{k!r}]: unknown field{suggest(k, SETTINGS)}; {accepted} "
                      f"({', '.join(SIZES)}, cp_backend, sp_backend)" for k in unknown]
    bad = [f"parallelism_config[{k!r}]={value[k]!r}: must be a whole number >= 1" for k in SIZES if k in value and (
        isinstance(value[k], bool) or not isinstance(value[k], int) or value[k] < 1)]
    if bad:
        return None, bad
    try:
        return ParallelismConfig(**value), []
    except ValueError as e:  # Accelerate's own checks (backends, cp with sp)
        return None, [f"parallelism_config={value!r}: {e}"]


def parallelism_problems(args, world_size: int, on_cuda: bool) -> list[str]:
    """What stoker refuses of args.parallelism_config before any work, each naming the size, why, and what is
    accepted. Runs, over every process of the run: tp_size (the model's tp_plan), dp_shard_size (FSDP2 by the model's
    fsdp_plan), dp_replicate_size beside them (HSDP, a replicated tensor-parallel model) and their combinations;
    cp_size on CUDA (stoker.distributed.context_parallel); sp_size alone, in DeepSpeed."""
    config, p = read_parallelism_config(args.parallelism_config)
    if config is None:
        return p
    name = describe(config)
    if config.cp_size > 1:  # on a CPU, that refusal alone (stoker.distributed.context_parallel)
        p += context_parallel_problems(args, config, on_cuda, name)
        if not on_cuda:
            return p
    if config.sp_size > 1:
        p += sequence_parallel_problems(args, config, name)
    if not p and config.total_size != world_size and config.total_size > 1:
        p.append(f"{name}: its sizes multiply to {config.total_size} processes and this run has {world_size} (the "
                 f"launcher's WORLD_SIZE); accepted: sizes whose product is {world_size}")
    for other in ("fsdp", "deepspeed"):
        if other == "deepspeed" and config.sp_size == config.total_size:  # sequence parallelism runs in DeepSpeed
            continue
        if other == "fsdp" and config.cp_size > 1:  # context parallelism runs with FSDP2 (asked for above)
            continue
        if getattr(args, other) not in (None, "", {}, []) and config.total_size > 1:
            p.append(f"{name} and {other}={getattr(args, other)!r}: parallelism_config shards the model by its own "
                     f"plans (transformers' tp_plan and fsdp_plan); leave {other} unset")
    return p


def is_sharded_model(model) -> bool:
    """Whether any parameter of `model` is a DTensor (sharded, by transformers at load or by hand)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def loaded_layout(model) -> dict | None:
    """{tp_size, dp_shard_size, dp_replicate_size} of a model transformers sharded at load (its DistributedConfig),
    or None. Replicas alone (dp_replicate_size with fsdp_size and tp_size 1) are FSDP2 over a mesh of one shard per
    replica, a sharded model all the same: read as dp_shard_size, as transformers.Trainer reads every layout."""
    base = getattr(model, "get_base_model", lambda: model)()
    distributed = getattr(getattr(base, "config", None), "distributed_config", None)
    if not getattr(base, "is_distributed_loading_by_transformers", False) or distributed is None:
        return None
    if distributed.fsdp_size == distributed.tp_size == 1:
        return {"tp_size": 1, "dp_shard_size": distributed.dp_size, "dp_replicate_size": 1}
    return {"tp_size": distributed.tp_size, "dp_shard_size": distributed.fsdp_size,
            "dp_replicate_size": distributed.dp_replicate_size}


def run_parallelism(args, model, world_size: int):
    """The ParallelismConfig (StokerParallelismConfig) the Accelerator of a run is built with, or None: the
    arguments', else the layout of a model transformers sharded at load. Raises ConfigError, before any work, for a
    sharded model that does not fit: one sharded by hand (no DistributedConfig to read its layout from) without a
    parallelism_config, one whose layout differs from parallelism_config's, or a model without the plan a size needs."""
    config, _ = read_parallelism_config(args.parallelism_config)  # validated already
    sharded = model is not None and is_sharded_model(model)
    layout = loaded_layout(model) if sharded else None
    problems = []
    # (a model FSDP sharded in an earlier run of this Trainer is the fsdp setting's to prepare again)
    if sharded and config is None and layout is None and not fsdp_enabled(args.fsdp):
        problems.append("the model has DTensor parameters but no DistributedConfig (it was not sharded by "
                        "transformers' from_pretrained), so its layout is unknown: set parallelism_config to it "
                        "(tp_size for tensor parallelism, dp_shard_size for FSDP2)")
    if config is not None and layout is not None and any(getattr(config, k) != v for k, v in layout.items()):
        problems.append(f"{describe(config)}: the model was sharded at load with "
                        f"{', '.join(f'{k}={v}' for k, v in layout.items())}; accepted: the same sizes, or "
                        "parallelism_config unset")
    # (under context parallelism the fsdp setting's FSDP2 shards the model, not its plans)
    if config is not None and not sharded and config.total_size > 1 and config.cp_size == 1:
        problems += (sequence_model_problems(model, config, describe(config)) if splits_sequences(config)
                     else _plan_problems(model, config))
    if problems:
        raise ConfigError(problems, "distributed configuration")
    sizes = {k: getattr(config, k) for k in SETTINGS} if config is not None else layout
    if sizes is None:
        return None
    if splits_sequences(config) and getattr(sizes.get("sp_handler"), "sp_attn_implementation", None) is None:
        sizes["sp_handler"] = sequence_handler(model)
    if math.prod(sizes.get(k) or 1 for k in SIZES) == 1 and world_size > 1:
        sizes["dp_replicate_size"] = world_size  # all 1 on several processes: plain data parallelism (DDP)
    return _parallelism_class()(**sizes)


def _plan_problems(model, config) -> list[str]:
    """A model to shard needs transformers' plan for each size that shards it."""
    base = getattr(model, "get_base_model", lambda: model)() if model is not None else None
    if base is not None and base is not model:
        return [f"{describe(config)} with a peft model: sharding an adapter's base is not yet run by stoker; "
                "accepted: parallelism_config unset"]
    if not hasattr(base, "maybe_distribute_model"):
        return [f"{describe(config)}: the model ({type(base).__name__}) is not a transformers PreTrainedModel, "
                "whose tp_plan / fsdp_plan say how to shard it; accepted: a transformers model, or parallelism_config "
                "unset"]
    p = []
    for size, plan in (("tp_size", "tp_plan"), ("dp_shard_size", "fsdp_plan")):
        if getattr(config, size) > 1 and not getattr(base, plan, None):
            p.append(f"{describe(config)}: {type(base).__name__} has no {plan} (its config's base_model_{plan}); "
                     f"accepted: {size}=1 for this model")
    return p


def is_layout_sharded(config) -> bool:
    """Whether a run's ParallelismConfig shards the model by its plans (tensor parallelism or FSDP2), rather than
    replicate it; not under context parallelism, whose model the fsdp setting's FSDP2 shards."""
    return config is not None and config.cp_size == 1 and (config.tp_size > 1 or config.dp_shard_size > 1)


def shard_with_plans(model, config, device):
    """`model` sharded in place as from_pretrained(..., distributed_config=DistributedConfig(tp_size, fsdp_size,
    dp_replicate_size)) shards it: its tp_plan over tp_size processes, then FSDP2 by its fsdp_plan over
    dp_shard_size (HSDP: replicated over dp_replicate_size, the one dimension without tp_size); a model already
    sharded is taken as it is. Every rank first takes rank 0's weights (as DDP does when it wraps a model), since each
    rank keeps its slice of its own copy."""
    if is_sharded_model(model):
        return model
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    model.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    # dp_replicate_size beside a size that shards: transformers' HSDP, FSDP2 over the (dp_replicate, fsdp) mesh
    # (sharded within a group, replicated across it; a tensor-parallel model with dp_shard_size 1 is replicated
    # only), gradients averaged over every data-parallel rank
    wanted = DistributedConfig(tp_size=config.tp_size, fsdp_size=config.dp_shard_size,
                               dp_replicate_size=config.dp_replicate_size)
    wanted, _, mesh = type(model).prepare_distribute_model(wanted)
    # from_pretrained distributes a model built untied (its plans name the head's weight and the embedding's
    # apart) and ties them afterwards; a model built tied is untied the same way first, its head keeping the
    # embedding's storage
    tied = _untie(model)
    model = type(model).maybe_distribute_model(model, wanted, mesh)
    if tied:
        model.tie_weights(recompute_mapping=False)
    return model


def _untie(model) -> bool:
    """Give each tied weight of `model` (transformers' all_tied_weights_keys: the head tied to the embedding) a
    parameter of its own over the same storage; whether any was tied."""
    tied = [(target, source) for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items()
            if model.get_parameter(target) is model.get_parameter(source)]
    for target, _ in tied:
        module, _, name = target.rpartition(".")
        owner = model.get_submodule(module)
        setattr(owner, name, torch.nn.Parameter(getattr(owner, name).data))
    return bool(tied)


def spans_meshes(parameters) -> bool:
    """Whether the gradients of `parameters` are DTensors mixed with plain tensors, or on several meshes:
    torch's clip_grad_norm_ cannot stack their norms."""
    from torch.distributed.tensor import DTensor

    meshes = {g.device_mesh if isinstance(g, DTensor) else None for g in (p.grad for p in parameters)
              if g is not None}
    return len(meshes) > 1


def clip_across_meshes(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """clip_grad_norm_ over gradients on different meshes (and plain ones): one norm per mesh, made whole over its
    mesh, then the norm of those; the gradients scaled by it. A plain gradient (a tensor-parallel group's
    replicated norm weights) is the same on every rank of its group, so counted once."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for params in groups.values():
        norm = get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if max_norm != math.inf:
        for params in groups.values():
            clip_grads_with_norm_(params, max_norm, total)
    return total
