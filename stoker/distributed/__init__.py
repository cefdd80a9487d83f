"""How a run is distributed. Every distributed mechanic is Accelerate's (and through it torch.distributed's, FSDP's
and DeepSpeed's); this package decides what to ask Accelerate for, refuses combinations that Accelerate would
silently run as something else, and keeps sharded and partitioned state in stoker's checkpoint format
(safetensors + JSON, never a pickle).

    launch      the launcher's world: world size, accelerator availability, one process group, decisions all
                ranks take together
    parsing     distributed settings as transformers reads them (dicts or JSON files, booleans)
    fsdp        `fsdp` / `fsdp_config` -> Accelerate's FSDP plugin; FSDP shard I/O, the gathered full model,
                `consolidate`
    deepspeed   `deepspeed` config loading, "auto" filling, validation; ZeRO partition I/O, ZeRO-3 gathers
    options     the arguments' problems, what this machine cannot run, the Accelerator options for a run
    backends    one object per backend (plain/DDP, FSDP1, FSDP2, DeepSpeed) that the Trainer calls: prepare, the
                state dict for saving, its checkpoint parts, its refusals. Imported by the Trainer as
                `stoker.distributed.backends` (not re-exported here: it builds on the optimizers, which build on
                TrainingArguments, which imports this package)

Cheap to import: torch, accelerate, transformers and deepspeed are imported where they are used.
"""

from __future__ import annotations

from .deepspeed import (
    deepspeed_config,
    deepspeed_plugin,
    deepspeed_problems,
    fill_deepspeed_config,
    finish_deepspeed_config,
    is_deepspeed,
    is_zero_checkpoint,
    load_zero3_weights,
    load_zero_partitions,
    save_zero_partition,
    zero_stage,
)
from .fsdp import (
    MODEL_SHARDS,
    OPTIMIZER_SHARDS,
    consolidate,
    fsdp_enabled,
    fsdp_plugin,
    fsdp_plugin_kwargs,
    full_tensor,
    gather_full_model,
    is_sharded,
    load_shards,
    save_shards,
)
from .launch import accelerator_available, check_world_size, launcher_world_size, parameters_finite, wants_cpu
from .options import AcceleratorOptions, accelerator_options, argument_problems, check_sharding_active, runtime_problems
from .parsing import load_json_config

__all__ = [
    "MODEL_SHARDS", "OPTIMIZER_SHARDS", "AcceleratorOptions", "accelerator_available", "accelerator_options",
    "argument_problems", "check_sharding_active", "check_world_size", "consolidate", "deepspeed_config",
    "deepspeed_plugin", "deepspeed_problems", "fill_deepspeed_config", "finish_deepspeed_config", "fsdp_enabled",
    "fsdp_plugin", "fsdp_plugin_kwargs", "full_tensor", "gather_full_model", "is_deepspeed", "is_sharded",
    "is_zero_checkpoint", "launcher_world_size", "load_json_config", "load_shards", "load_zero3_weights",
    "load_zero_partitions", "parameters_finite", "runtime_problems", "save_shards", "save_zero_partition",
    "wants_cpu", "zero_stage",
]
