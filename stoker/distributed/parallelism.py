"""Tensor parallelism and FSDP2 applied by transformers' own plans: `parallelism_config` (Accelerate's
ParallelismConfig, a dict or a JSON string, as transformers.Trainer takes it) and models that transformers sharded at
load (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=..., dp_replicate_size=...))`).

    read_parallelism_config   the setting as Accelerate's ParallelismConfig, or the problems with it
    parallelism_problems      what stoker refuses, from the arguments alone (TrainingArguments' validation)
    run_parallelism           the ParallelismConfig the Accelerator is built with: the arguments', or the layout of
                              a model transformers sharded at load; refuses a model that does not fit it
    shard_with_plans          a model not yet sharded, sharded by its tp_plan / fsdp_plan as from_pretrained would
    clip_across_meshes        gradient clipping over parameters whose gradients live on different meshes
    SequenceShards            sequence parallelism's collator: this rank's slice of every row of a batch

Context parallelism (cp_size > 1, with the fsdp setting's FSDP2) is stoker.distributed.context_parallel's: refused
here on a CPU, and its refusals gathered here with the others.

What the layouts share: the ranks of one tensor-parallel group read the same rows (Accelerate's data loader follows
the device mesh), so tokens are counted and the loss normalised over the data-parallel ranks only
(`data_parallel_size`); a sharded model is never wrapped in DDP (its DTensors carry their own collectives).

Sequence parallelism (sp_size, sp_backend="deepspeed": DeepSpeed's Ulysses attention, as transformers.Trainer runs
it) runs inside DeepSpeed's engine: Accelerate registers the attention and DeepSpeed's sequence-parallel groups when
it prepares the model. The ranks of one group read the same rows (the training loader is sharded over the
data-parallel groups only, so a step trains the rows one process would) and each keeps its slice of the sequence
(SequenceShards), with the labels shifted before the cut; each rank's loss is its slice's summed token losses over
the window's target tokens, so that the group's losses add up to the batch's, and DeepSpeed sums the gradients of a
group. transformers' data loader adapter instead hands each group the rows of its ranks in turn (gathered), an
order that depends on the layout.

On a CPU, Accelerate's check of a ParallelismConfig against the Accelerator does not count CPU processes as devices
(gloo runs DTensor tensor parallelism and FSDP2 all the same); stoker's config relaxes that one check for its own
Accelerator (StokerParallelismConfig), nothing process-wide.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..data import IGNORE_INDEX
from ..errors import ConfigError, suggest
from .context_parallel import context_parallel_problems
from .fsdp import fsdp_enabled

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
        p += sequence_parallel_problems(args, config)
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


# what sequence parallelism needs of the arguments: (field, value it refuses, why, what is accepted)
_SEQUENCE_REFUSALS = (
    ("packing", True, "packed rows need a mask between their sequences, which DeepSpeed's Ulysses attention drops "
     "(it attends causally over the whole gathered sequence)", "packing=False"),
    ("padding_free", True, "padding-free batches hold several sequences in one row, which DeepSpeed's Ulysses "
     "attention would let see each other", "padding_free=False"),
    ("chunked_loss", True, "the chunked loss shifts the labels of its slice itself, where each rank's slice needs "
     "the labels shifted before the sequence is cut", "chunked_loss=False"),
    ("shared_prefix", True, "the shared prefix is run once on each rank's slice, which is not the rows' prefix",
     "shared_prefix=False"),
)


def sequence_parallel_problems(args, config) -> list[str]:
    """What sequence parallelism (sp_size > 1) needs of the arguments: DeepSpeed, no other size but sp_size, and
    none of the settings that cut a row's sequence their own way."""
    name, accepted = describe(config), "accepted: sp_size equal to the number of processes, with deepspeed set"
    what = f"sequence parallelism (sp_size={config.sp_size}, sp_backend={config.sp_backend!r})"
    p = []
    if args.deepspeed in (None, "", {}):
        p.append(f"{name}: {what} runs inside DeepSpeed's engine (its Ulysses attention and sequence-parallel "
                 "groups), and deepspeed is unset; accepted: deepspeed set to a ZeRO config (stage 1, 2 or 3)")
    if config.sp_size != config.total_size:
        p.append(f"{name}: {what} with another size is not yet run by stoker; {accepted}")
    for field, refused, why, fine in _SEQUENCE_REFUSALS:
        if getattr(args, field, None) == refused:
            p.append(f"{name} and {field}={refused!r}: {why}; accepted with sp_size: {fine}")
    if args.per_device_train_batch_size > 1 and not args.dataloader_drop_last:
        p.append(f"{name} and per_device_train_batch_size={args.per_device_train_batch_size} with "
                 "dataloader_drop_last=False: DeepSpeed's Ulysses attention runs a fixed number of rows, and an "
                 "epoch's last batch may hold fewer; accepted: per_device_train_batch_size=1 or "
                 "dataloader_drop_last=True")
    return p


def _sequence_model_problems(model, config) -> list[str]:
    """A model DeepSpeed's Ulysses attention can split: a transformers model whose attention implementation it
    intercepts (not eager, which needs the whole 4-D mask), with heads that divide over sp_size."""
    base = getattr(model, "get_base_model", lambda: model)() if model is not None else None
    text = getattr(getattr(base, "config", None), "get_text_config", lambda: None)()
    if text is None:
        return [f"{describe(config)}: the model ({type(base).__name__}) is not a transformers model, whose attention "
                "DeepSpeed's Ulysses attention replaces; accepted: a transformers model, or sp_size=1"]
    p, attention = [], base.config._attn_implementation
    if attention in ("eager", "flex_attention", None):
        p.append(f"{describe(config)}: the model's attn_implementation={attention!r}, which DeepSpeed's Ulysses "
                 "attention does not run; accepted: 'sdpa', 'flash_attention_2' or 'flash_attention_3' "
                 "(from_pretrained(..., attn_implementation=...))")
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % config.sp_size or (kv % config.sp_size and config.sp_size % kv):
        p.append(f"{describe(config)}: {type(base).__name__} has {heads} attention heads and {kv} key/value heads, "
                 f"which sp_size={config.sp_size} must divide (or, for key/value heads, be a multiple of); accepted: "
                 "an sp_size that does")
    return p


def splits_sequences(config) -> bool:
    """Whether a run's ParallelismConfig splits each row's sequence over processes (sequence parallelism)."""
    return config is not None and config.sp_size > 1


# transformers' attention functions as they were before the first sequence-parallel run of this process replaced
# one with DeepSpeed's Ulysses wrapper (name -> function)
_ATTENTION_BEFORE_ULYSSES: dict = {}


def fresh_sequence_parallelism(attention: str) -> None:
    """Before Accelerate registers DeepSpeed's Ulysses attention for a run: what an earlier run of this process
    left is undone, DeepSpeed's sequence-parallel groups (which it refuses to build twice) and the wrapper it put in
    transformers' attention functions under `attention` (which it would wrap again: two exchanges per layer)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parallel_state_sp._release_sequence_parallel_groups()
    original = _ATTENTION_BEFORE_ULYSSES.setdefault(attention, ALL_ATTENTION_FUNCTIONS[attention])
    ALL_ATTENTION_FUNCTIONS[attention] = original


class SequenceShards:
    """A collator whose batches are this rank's slice of every row's sequence (sequence parallelism): the batch
    `collator` makes, right-padded to a multiple of `size` positions (labels -100, mask 0: the Ulysses attention is
    causal, so no real token sees the padding), with position_ids counted over the whole row (unless the rows have
    their own) and shift_labels, the labels shifted by one before the cut (a slice's last position predicts the next
    slice's first token); then positions [rank x L / size, (rank + 1) x L / size) of each. The labels stay (the
    model computes its loss only when given them), the shifted ones taking their place in the loss."""

    def __init__(self, collator, rank: int, size: int, label_name: str = "labels"):
        self.collator, self.rank, self.size, self.label_name = collator, rank, size, label_name

    def __call__(self, features):
        batch = dict(self.collator(features))
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("sequence parallelism needs right-padded rows: DeepSpeed's Ulysses attention drops the "
                             "attention mask and attends causally, so a row's real tokens would see its left "
                             "padding; accepted: a collator (tokenizer) padding on the right (padding_side='right')")
        rows, length = ids.shape
        padded = -(-length // self.size) * self.size
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(length, dtype=torch.long).expand(rows, length)
        labels = batch.get(self.label_name)
        if isinstance(labels, torch.Tensor) and "shift_labels" not in batch:
            batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        width = padded // self.size
        cut = slice(self.rank * width, (self.rank + 1) * width)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                if padded != length:
                    fill = (IGNORE_INDEX if key in (self.label_name, "shift_labels") else
                            length if key == "position_ids" else 0)
                    extra = value.new_full((rows, padded - length), fill)
                    if key == "position_ids":  # the padding continues the row's positions
                        extra = value[:, -1:] + 1 + torch.arange(padded - length, dtype=value.dtype)
                    value = torch.cat([value, extra], dim=1)
                batch[key] = value[:, cut].contiguous()
        return batch


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
        problems += _sequence_model_problems(model, config) if splits_sequences(config) else _plan_problems(model,
                                                                                                          config)
    if problems:
        raise ConfigError(problems, "distributed configuration")
    sizes = {k: getattr(config, k) for k in SETTINGS} if config is not None else layout
    if sizes is None:
        return None
    if splits_sequences(config) and getattr(sizes.get("sp_handler"), "sp_attn_implementation", None) is None:
        sizes["sp_handler"] = _sequence_handler(model)
    if math.prod(sizes.get(k) or 1 for k in SIZES) == 1 and world_size > 1:
        sizes["dp_replicate_size"] = world_size  # all 1 on several processes: plain data parallelism (DDP)
    return _parallelism_class()(**sizes)


def _sequence_handler(model):
    """Accelerate's settings of DeepSpeed's Ulysses attention for `model`: its own attention implementation (which
    the Ulysses attention wraps; Accelerate leaves it unset), rows of any length, and evaluation unsplit (every rank
    runs whole rows of its own, as without sequence parallelism)."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    base = getattr(model, "get_base_model", lambda: model)()
    return DeepSpeedSequenceParallelConfig(sp_attn_implementation=base.config._attn_implementation,
                                           sp_seq_length_is_variable=True, sp_disable_in_eval=True)


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
