"""What the arguments ask of Accelerate for distribution: the problems visible from the arguments alone
(TrainingArguments' validation), what keeps this machine from running them, and the Accelerator options (FSDP or
DeepSpeed plugin, CPU flag, process-group backend) for a run. Accelerate would rather run something else than fail;
these checks refuse before any work.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch
from accelerate import Accelerator

from ..compilation import dynamic_shapes, resolved_scope
from ..data import pins_memory
from ..errors import ConfigError
from ..log import logger
from .deepspeed import deepspeed_config, deepspeed_plugin, deepspeed_trainer_problems
from .fsdp import fsdp_enabled, fsdp_plugin, fsdp_plugin_kwargs, reduce_in_float32
from .launch import (
    LAUNCHER_PRECISIONS,
    LAUNCHER_VARIABLES,
    accelerate_launch_problems,
    accelerator_available,
    check_save_on_each_node,
    check_world_size,
    launcher_precision,
    launcher_world_size,
    leave_process_group_at_exit,
    wants_cpu,
)
from .parallelism import (
    clip_across_meshes,
    is_layout_sharded,
    parallelism_problems,
    read_parallelism_config,
    run_parallelism,
    spans_meshes,
)
from .sequence_parallel import SequenceShards, splits_sequences


def argument_problems(args) -> list[str]:
    """Problems of fsdp / fsdp_config / deepspeed / parallelism_config visible from the arguments alone
    (TrainingArguments)."""
    p = []
    fsdp_on = fsdp_enabled(args.fsdp)
    if fsdp_on and args.deepspeed not in (None, "", {}):
        p.append(f"fsdp={args.fsdp!r} and deepspeed={args.deepspeed!r}: both shard the model; choose one")
    p += fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, args.gradient_checkpointing,
                            mixed_precision=args.mixed_precision)[1]
    p += parallelism_problems(args, launcher_world_size(), accelerator_available() and not args.use_cpu)
    launched = launcher_precision(args.deepspeed)
    if launched is not None and launched[0] not in LAUNCHER_PRECISIONS:  # stoker would replace it without a word
        p.append(f"{launched[1]}: stoker takes {', '.join(map(repr, LAUNCHER_PRECISIONS))} from the launcher; "
                 "float8 is its fp8 field (fp8='tensorwise' or 'rowwise', with bf16): launch with --mixed_precision "
                 "bf16 and set fp8")
    if args.deepspeed not in (None, "", {}):
        p += deepspeed_config(args, data_parallel_processes(args))[1]
        if args.async_save:
            p.append(async_save_refusal(f"deepspeed={args.deepspeed!r}"))
        if args.spike_rollback:
            p.append(f"spike_rollback=True and deepspeed={args.deepspeed!r}: a rollback restores the weights and "
                     "optimizer state in place, and DeepSpeed's engine keeps its own (ZeRO partitions, fp32 master "
                     "copies) out of reach; accepted with DeepSpeed: spike_rollback=False (spike_rollback runs with "
                     "one process, DDP and FSDP)")
    return p


def data_parallel_processes(args) -> int:
    """The launcher's processes that read different rows: all of them, but the ranks of a sequence-parallel group
    share theirs (DeepSpeed's global batch counts them once)."""
    config, _ = read_parallelism_config(args.parallelism_config)
    return launcher_world_size() // (config.sp_size if splits_sequences(config) else 1)


def async_save_refusal(what: str) -> str:
    """Why async_save is refused with DeepSpeed (`what`: how the run asks for it)."""
    return (f"async_save=True and {what}: DeepSpeed's engine writes its ZeRO partitions from its own state, which "
            "moves on while training goes on, so it cannot be saved in the background; accepted with DeepSpeed: "
            "async_save=False (async_save=True runs with one process, DDP and FSDP)")


def runtime_problems(args) -> list[str]:
    """What keeps this machine from running the requested FSDP or DeepSpeed: Accelerate would run without
    them (DDP, or one process) rather than fail, so stoker refuses before any work. Also a ddp_backend in a
    process no launcher started, where Accelerate (and transformers.Trainer) fail in torch's words."""
    p = accelerate_launch_problems(args.deepspeed not in (None, "", {}))
    if args.ddp_backend is not None and args.deepspeed in (None, "", {}) and "LOCAL_RANK" not in os.environ and (
            launcher_world_size() == 1):
        # Accelerate takes a backend for a process group to join and asks torch for its size, which fails with
        # "Default process group has not been initialized" when no launcher started the processes
        p.append(f"ddp_backend={args.ddp_backend!r}: a process-group backend joins the processes of a launch, and "
                 "this process was started alone (LOCAL_RANK and WORLD_SIZE unset); launch the script with "
                 "several processes (torchrun --nproc_per_node N, accelerate launch --num_processes N, or srun "
                 "setting RANK, LOCAL_RANK and WORLD_SIZE), or leave ddp_backend unset for one process")
    on_accelerator = accelerator_available() and not args.use_cpu
    if fsdp_enabled(args.fsdp) and not on_accelerator:
        p.append(f"fsdp={args.fsdp!r}: FSDP needs GPUs (or another accelerator); "
                 + ("use_cpu=True" if args.use_cpu else "this machine has none")
                 + ", and Accelerate would silently train with DDP instead")
    if args.deepspeed not in (None, "", {}):
        if importlib.util.find_spec("deepspeed") is None:
            p.append(f"deepspeed={args.deepspeed!r}: the deepspeed package is not installed (pip install deepspeed)")
        if args.use_cpu:
            p.append(f"deepspeed={args.deepspeed!r} and use_cpu=True: Accelerate turns DeepSpeed off with use_cpu "
                     "(DeepSpeed runs on the CPU by itself where there is no GPU); remove use_cpu")
        missing = [v for v in LAUNCHER_VARIABLES if v not in os.environ]
        if missing:  # DeepSpeed would look for MPI instead
            p.append(f"deepspeed={args.deepspeed!r}: DeepSpeed runs under a launcher, which sets "
                     f"{', '.join(LAUNCHER_VARIABLES)} (missing: {', '.join(missing)}); start the script with "
                     "torchrun --nproc_per_node N (1 for one device), accelerate launch or deepspeed")
    return p


class AcceleratorOptions(NamedTuple):
    """What the Accelerator is built with for the distribution the arguments ask for."""

    cpu: bool  # Accelerator(cpu=...)
    process_group_backend: str | None  # InitProcessGroupKwargs(backend=...); None: Accelerate's choice
    plugins: dict  # {} (DDP or one process), {"fsdp_plugin": ...} or {"deepspeed_plugin": ...}


def accelerator_options(args, model, optimizers=(None, None)) -> AcceleratorOptions:
    """The Accelerator options for the sharding the arguments ask for. Raises ConfigError, before any work, for
    what cannot run here or is not supported."""
    problems = runtime_problems(args)
    plugins = {}
    if args.deepspeed not in (None, "", {}):
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        config, more = deepspeed_config(args, data_parallel_processes(args), hidden_size=hidden)
        problems += more + (deepspeed_trainer_problems(config, args, optimizers) if config else [])
        if not problems:
            plugins["deepspeed_plugin"] = deepspeed_plugin(config)
    if fsdp_enabled(args.fsdp):
        plugin_kwargs, more = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, args.gradient_checkpointing, model,
                                                 args.mixed_precision)
        problems += more
        if not problems:
            plugins["fsdp_plugin"] = fsdp_plugin(plugin_kwargs)
    if problems:
        raise ConfigError(problems, "distributed configuration")
    deepspeed = "deepspeed_plugin" in plugins
    # under torchrun without a GPU: gloo, not N lone processes (Accelerate's cpu flag, which would also turn
    # DeepSpeed off: DeepSpeed gets the gloo backend asked for instead)
    cpu = wants_cpu(args.use_cpu)
    return AcceleratorOptions(cpu=cpu and not deepspeed,
                              process_group_backend=args.ddp_backend or ("gloo" if deepspeed and cpu else None),
                              plugins=plugins)


def check_sharding_active(args, distributed_type) -> None:
    """Refuse a run with `fsdp` set in which Accelerate did not set up FSDP: it turns FSDP on only in
    multi-process runs on accelerators and otherwise trains without it."""
    if fsdp_enabled(args.fsdp) and str(distributed_type).rsplit(".", 1)[-1] != "FSDP":
        raise ConfigError([f"fsdp={args.fsdp!r}: Accelerate set up {distributed_type}, not FSDP: it shards only "
                           "in runs started by a launcher (torchrun or accelerate launch, also with one process) "
                           "on GPUs; refusing to train unsharded"], "distributed configuration")


def sharded_by_launcher() -> bool:
    """Whether accelerate launch's configuration turns FSDP or DeepSpeed on (its environment variables), which the
    Accelerator then sets up without a plugin from the arguments."""
    return any(os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() in ("1", "true", "yes")
               for name in ("FSDP", "DEEPSPEED"))


def dynamo_plugin(args, model, sharded: bool):
    """Accelerate's TorchDynamoPlugin for the run, or None where Accelerate compiles nothing. The whole model
    (compile_scope "model") is Accelerate's torch.compile, as in transformers. Blocks are compiled by the
    plain backend in place (stoker.compilation) where the run is not sharded; FSDP and DeepSpeed runs use
    Accelerate's regional compilation instead, which compiles each block in place where their preparation needs
    it (after activation checkpointing, before sharding)."""
    from accelerate.utils import TorchDynamoPlugin

    scope = resolved_scope(args, model)
    if scope is None or scope == "blocks" and not (sharded or sharded_by_launcher()):
        return None
    return TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode,
                             dynamic=dynamic_shapes(args), use_regional_compilation=scope == "blocks")


class ShareReadingAccelerator(Accelerator):
    """Accelerate's Accelerator, but with accelerator_config's dispatch_batches left None (as transformers leaves
    it, and as `dispatch_batches` then reads back, as on transformers' Accelerator) its loaders are prepared as
    with False: every process reads an IterableDataset itself and keeps its share of each global batch.
    Accelerate's None would have the main process read every batch and concatenate whole batches for the others,
    which fails on rows of different lengths (README's differences table); map-style datasets are read so either
    way. An explicit True or False is Accelerate's. Also how the run's processes share its work, which under
    tensor, context and sequence parallelism is not one batch each: how many read different rows
    (data_parallel_size), and how many share a batch, a loss, a count or a gradient average (ranks_per_batch,
    ranks_per_loss, ranks_per_count, averaged_ranks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # attributes, not properties: read in every step, where a call would be one more function in it.
        # data_parallel_size: the processes that read different rows (every process, but the ranks of one
        # tensor-parallel group share theirs: Accelerate's data loader follows the device mesh), over which tokens
        # are counted and the loss normalised; ranks_per_batch: the processes that read the same rows, so that a
        # sum over every process counts each batch this many times (1 under DDP and FSDP)
        config = self.parallelism_config
        self.data_parallel_size = config.data_parallel_size if config is not None else self.num_processes
        self.ranks_per_batch = self.num_processes // self.data_parallel_size
        # context and sequence parallelism: the ranks of a group each hold a slice of the batch's sequence, so each has
        # its own share of the loss (ranks_per_loss: the processes that compute the very same loss), and FSDP2 averages
        # the gradients over the data-parallel and the context-parallel ranks (averaged_ranks), which the loss,
        # normalised over the window's tokens, is multiplied back by (DeepSpeed sums a sequence-parallel group's, and
        # its backend scales the loss where it averages them)
        cp_size = config.cp_size if config is not None else 1
        self.sequence_parallel_size = config.sp_size if splits_sequences(config) else 1
        self.ranks_per_loss = self.ranks_per_batch // cp_size // self.sequence_parallel_size
        self.averaged_ranks = self.data_parallel_size * cp_size
        # the processes whose counts of a batch (tokens, target items, FLOPs, evaluation rows) are the same: the ranks
        # that read the same rows, but a sequence-parallel rank counts only its slice (SequenceShards), and evaluates
        # whole rows of its own
        self.ranks_per_count = self.ranks_per_batch // self.sequence_parallel_size

    def training_collator(self, collator, label_name: str):
        """The collator of the training loader: `collator`, or under sequence parallelism this rank's slice of
        the sequence of its batches (SequenceShards; DeepSpeed's groups are consecutive ranks)."""
        size = self.sequence_parallel_size
        return collator if size == 1 else SequenceShards(collator, self.process_index % size, size, label_name)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's, with dispatch_batches=None prepared as False (the configuration keeps its None)."""
        if isinstance(data_loader.collate_fn, SequenceShards):
            return self._prepare_for_groups(data_loader, device_placement)
        config = self.dataloader_config
        if config.dispatch_batches is not None:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        config.dispatch_batches = False
        try:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        finally:
            config.dispatch_batches = None


    def _prepare_for_groups(self, data_loader, device_placement=None):
        """A loader of sequence slices, sharded over the data-parallel groups rather than the processes: the
        ranks of a sequence-parallel group (consecutive ranks) read the same rows, each taking its slice, so step j
        trains the rows one process would. Accelerate shards over every process where no device mesh tells it
        otherwise, which DeepSpeed's sequence parallelism does not build."""
        from accelerate.data_loader import prepare_data_loader

        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.data_parallel_size,
            process_index=self.process_index // self.sequence_parallel_size, split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=False, even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared


class MeshClippingAccelerator(ShareReadingAccelerator):
    """The Accelerator of a model sharded by its plans (tensor parallelism, FSDP2), whose gradients may live on
    several meshes (a tensor-parallel model's DTensors beside its replicated norm weights): torch's
    clip_grad_norm_ cannot stack their norms."""

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's where the gradients share one mesh; else the whole norm, each mesh's made whole over its
        ranks (distributed.parallelism.clip_across_meshes)."""
        parameters = list(parameters)
        if not spans_meshes(parameters):
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        return clip_across_meshes(parameters, max_norm, norm_type)


def build_accelerator(args, model, optimizers=(None, None)):
    """The Accelerator of a run: mixed precision, DDP options, the FSDP or DeepSpeed plugin (refusing what
    cannot run here, before any work), data loading that is resumable (seedable samplers), and no gradient
    accumulation of its own (the loop's is token-exact). Also applies tf32."""
    from datetime import timedelta

    from accelerate import DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    a = args
    # AcceleratorState is a process-wide singleton that refuses a second configuration. A new Trainer
    # carries its own precision, so it resets the singleton (the process group in PartialState stays).
    AcceleratorState._reset_state()
    GradientState._reset_state()
    find_unused = a.ddp_find_unused_parameters
    if find_unused is None:  # as transformers: checkpointed models re-enter forward, which DDP dislikes
        find_unused = not a.gradient_checkpointing if hasattr(model, "config") else True
    ddp = {"find_unused_parameters": find_unused}
    if a.ddp_static_graph is not None:
        ddp["static_graph"] = a.ddp_static_graph
    if a.ddp_bucket_cap_mb is not None:
        ddp["bucket_cap_mb"] = a.ddp_bucket_cap_mb
    if a.ddp_broadcast_buffers is not None:
        ddp["broadcast_buffers"] = a.ddp_broadcast_buffers
    config = a.accelerator_config.dataloader_options()  # an AcceleratorConfig once the arguments are read
    # a copy from pinned memory need not make the host wait (torch's pinned allocator keeps the buffer until the
    # copy is done), so pinned batches are always copied without waiting; a blocking copy would stall every
    # micro-batch. As transformers, non_blocking asked for without pinned memory warns
    if config["non_blocking"] and not a.dataloader_pin_memory:
        logger.warning("accelerator_config non_blocking=True without dataloader_pin_memory: a copy from memory that "
                       "is not pinned waits anyway; set dataloader_pin_memory=True as well")
    config["non_blocking"] = config["non_blocking"] or pins_memory(a)
    # no plugin (DDP or one process), an FSDP or a DeepSpeed plugin; refuses what cannot run here
    distributed = accelerator_options(a, model, optimizers)
    # tensor parallelism / FSDP2 by the model's plans: the arguments', or a model's sharded at load
    parallelism = run_parallelism(a, model, launcher_world_size())
    accelerator_class = MeshClippingAccelerator if is_layout_sharded(parallelism) else ShareReadingAccelerator
    accelerator = accelerator_class(
        mixed_precision=a.mixed_precision,
        cpu=distributed.cpu,
        # accumulation is done by the loop (token-exact), so Accelerate must not rescale the loss
        gradient_accumulation_steps=1,
        dataloader_config=DataLoaderConfiguration(data_seed=a.data_seed, **config),
        kwargs_handlers=[DistributedDataParallelKwargs(**ddp),
                         InitProcessGroupKwargs(backend=distributed.process_group_backend,
                                                timeout=timedelta(seconds=a.ddp_timeout))],
        dynamo_plugin=dynamo_plugin(a, model, sharded=bool(distributed.plugins)),
        step_scheduler_with_optimizer=False,
        parallelism_config=parallelism,
        **distributed.plugins,
    )
    if getattr(accelerator.state, "fsdp_plugin", None) is not None and "fsdp_plugin" not in distributed.plugins:
        reduce_in_float32(accelerator.state.fsdp_plugin, a.mixed_precision)  # accelerate launch's FSDP config
    check_world_size(accelerator.num_processes)
    check_save_on_each_node(a.save_on_each_node, accelerator.num_processes)
    if accelerator.num_processes > 1:
        leave_process_group_at_exit()
    if a.tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = a.tf32
        torch.backends.cudnn.allow_tf32 = a.tf32
    return accelerator
