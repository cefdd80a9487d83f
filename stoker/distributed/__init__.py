"""How a run is distributed. Every distributed mechanic is Accelerate's (and through it torch.distributed's, FSDP's
and DeepSpeed's); this package decides what to ask Accelerate for, refuses combinations that Accelerate would
silently run as something else, and keeps sharded and partitioned state in stoker's checkpoint format
(safetensors + JSON, never a pickle).

    launch      the launcher's world: world size, accelerator availability, one process group, leaving it at exit
    parsing     distributed settings as transformers reads them (dicts or JSON files, booleans)
    fsdp        `fsdp` / `fsdp_config` -> Accelerate's FSDP plugin; FSDP shard I/O, the gathered full model,
                `consolidate`
    deepspeed   `deepspeed` config loading, "auto" filling, validation; ZeRO partition I/O, ZeRO-3 gathers
    accelerator the arguments' problems, what this machine cannot run, the Accelerator options for a run
    parallelism parallelism_config and models transformers sharded at load (tensor parallelism, FSDP2 by the
                model's own plans): refusals, the sharding, clipping over several meshes
    context_parallel  cp_size > 1 (torch's ring attention under FSDP2): its refusals, each micro-batch's split
    backends    one object per backend (plain/DDP, FSDP1, FSDP2, plan-sharded, DeepSpeed) that the Trainer calls:
                prepare, the state dict for saving, its checkpoint parts, its refusals

Import from the submodules; the package itself re-exports nothing, so importing one submodule loads no other.

Cheap to import: torch, accelerate, transformers and deepspeed are imported where they are used.
"""
