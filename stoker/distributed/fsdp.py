"""FSDP: transformers' `fsdp` / `fsdp_config` translated into Accelerate's FullyShardedDataParallelPlugin, and the
checkpoint state that every rank of a sharded run writes and reads (shards of the model and optimizer state, the
gathered full model, `consolidate`).

Cheap to import: torch, accelerate and transformers are imported where they are used.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

from .. import checkpoint_format as ckpt
from ..errors import CheckpointError, ConfigError, suggest
from .parsing import as_bool, load_json_config

# ---------------------------------------------------------------------------------------------------
# FSDP: transformers' `fsdp` / `fsdp_config` -> accelerate.FullyShardedDataParallelPlugin

FSDP_OPTIONS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload",
                "auto_wrap")
FSDP1_ONLY_STRATEGIES = ("no_shard", "hybrid_shard", "hybrid_shard_zero2")
FSDP_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
FSDP_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
# fsdp_config keys, as transformers reads them (a leading "fsdp_" is dropped, as transformers does)
FSDP_CONFIG_KEYS = ("version", "min_num_params", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "cpu_offload",
                    "reshard_after_forward", "cpu_ram_efficient_loading", "activation_checkpointing",
                    "state_dict_type", "backward_prefetch", "forward_prefetch", "use_orig_params",
                    "sync_module_states", "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
                    "xla_fsdp_settings", "mixed_precision_policy")
_FSDP1_ONLY_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
                    "limit_all_gathers")


def fsdp_enabled(fsdp) -> bool:
    """`fsdp` as transformers reads it: True, a non-empty option string or list; False, None, '' are off."""
    if isinstance(fsdp, str):
        return fsdp.strip().lower() not in ("", "false", "no", "0")
    return bool(fsdp)


FSDP_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}


def fsdp_plugin_kwargs(fsdp, fsdp_config, gradient_checkpointing: bool = False,
                       model=None, mixed_precision: str = "no") -> tuple[dict, list[str]]:
    """FullyShardedDataParallelPlugin keyword arguments for transformers' `fsdp` and `fsdp_config`, with the
    meanings transformers 5 gives them (FSDP2 by default), and every problem found. `mixed_precision` is the
    run's ("bf16", "fp16" or "no"): under half precision gradients are reduced in float32 (see
    `_mixed_precision_policy`), unless fsdp_config['mixed_precision_policy'] says otherwise.

    `fsdp`: True, or options 'full_shard' / 'shard_grad_op' (FSDP2: reshard_after_forward True / False),
    'no_shard' / 'hybrid_shard' / 'hybrid_shard_zero2' (FSDP1 only), 'offload' (cpu_offload), 'auto_wrap' (the
    default wrapping). With a model, transformer_layer_cls_to_wrap defaults to its `_no_split_modules` and every
    class named must exist in it.
    """
    problems: list[str] = []
    if not fsdp_enabled(fsdp):
        if fsdp_config not in (None, {}, ""):
            problems.append(f"fsdp_config={fsdp_config!r}: is set but fsdp is not; set fsdp (e.g. 'full_shard') "
                            "or remove fsdp_config")
        return {}, problems
    config, problems = load_json_config(fsdp_config, "fsdp_config")
    if config is None:
        config = {}
    config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in config.items()}
    for key in config:
        if key not in FSDP_CONFIG_KEYS:
            problems.append(f"fsdp_config[{key!r}]: unknown key{suggest(key, FSDP_CONFIG_KEYS)}; accepted: "
                            f"{', '.join(FSDP_CONFIG_KEYS)}")
    if any(as_bool(config.get(k, False), f"fsdp_config[{k!r}]", problems) for k in ("xla", "xla_fsdp_v2")):
        problems.append("fsdp_config['xla']: PyTorch/XLA FSDP is not supported by stoker; leave it false")

    try:
        version = int(config.get("version", 2))
    except (TypeError, ValueError):
        version = None
    if version not in (1, 2):
        problems.append(f"fsdp_config['version']={config.get('version')!r}: accepted: 1, 2 (default 2)")
        version = 2
    kwargs: dict = {"fsdp_version": version}

    options = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    options = [o for o in options if str(o).lower() not in ("true", "1", "yes")]
    for option in options:
        if option not in FSDP_OPTIONS:
            problems.append(f"fsdp={fsdp!r}: unknown option {option!r}{suggest(option, FSDP_OPTIONS)}; accepted: "
                            f"{', '.join(FSDP_OPTIONS)} (or true)")
        elif option == "offload":
            config.setdefault("cpu_offload", True)
        elif option in ("full_shard", "shard_grad_op") and version == 2:
            config.setdefault("reshard_after_forward", option == "full_shard")
        elif option in FSDP1_ONLY_STRATEGIES and version == 2:
            problems.append(f"fsdp={fsdp!r}: {option!r} exists only in FSDP1; set fsdp_config['version']=1 or use "
                            "full_shard / shard_grad_op")
        elif option != "auto_wrap":
            config.setdefault("reshard_after_forward", option)
    strategies = [o for o in options if o in FSDP_OPTIONS and o not in ("offload", "auto_wrap")]
    if len(strategies) > 1:
        problems.append(f"fsdp={fsdp!r}: choose one sharding strategy, not {' and '.join(strategies)}")

    # wrapping: transformer layers by default; min_num_params alone means size-based wrapping (as transformers 4)
    layers = config.get("transformer_layer_cls_to_wrap")
    if isinstance(layers, str):
        layers = [c.strip() for c in layers.split(",") if c.strip()]
    min_params = config.get("min_num_params", 0)
    if not isinstance(min_params, int) or isinstance(min_params, bool) or min_params < 0:
        problems.append(f"fsdp_config['min_num_params']={min_params!r}: must be an integer >= 0")
        min_params = 0
    policy = str(config.get("auto_wrap_policy", "SIZE_BASED_WRAP" if min_params > 0 and not layers
                            else "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in FSDP_WRAP_POLICIES:
        problems.append(f"fsdp_config['auto_wrap_policy']={config['auto_wrap_policy']!r}: accepted: "
                        f"{', '.join(FSDP_WRAP_POLICIES)}")
    if layers and min_params > 0:
        problems.append(f"fsdp_config['transformer_layer_cls_to_wrap']={layers!r} and fsdp_config['min_num_params']="
                        f"{min_params}: wrap by layer class or by size, not both")
    elif layers and policy != "TRANSFORMER_BASED_WRAP":
        problems.append(f"fsdp_config['transformer_layer_cls_to_wrap']={layers!r}: needs auto_wrap_policy "
                        f"TRANSFORMER_BASED_WRAP, not {policy}")
    elif min_params > 0 and policy != "SIZE_BASED_WRAP":
        problems.append(f"fsdp_config['min_num_params']={min_params}: needs auto_wrap_policy SIZE_BASED_WRAP, "
                        f"not {policy}")
    kwargs["auto_wrap_policy"] = policy
    if policy == "SIZE_BASED_WRAP":
        kwargs["min_num_params"] = min_params
    if policy == "TRANSFORMER_BASED_WRAP":
        if model is not None:
            layers, more = _layers_to_wrap(model, layers)
            problems += more
        if layers:
            kwargs["transformer_cls_names_to_wrap"] = list(layers)

    if as_bool(config.get("cpu_offload", False), "fsdp_config['cpu_offload']", problems):
        kwargs["cpu_offload"] = True
    kwargs["cpu_ram_efficient_loading"] = as_bool(config.get("cpu_ram_efficient_loading", False),
                                                   "fsdp_config['cpu_ram_efficient_loading']", problems)
    if "activation_checkpointing" in config:
        kwargs["activation_checkpointing"] = as_bool(config["activation_checkpointing"],
                                                      "fsdp_config['activation_checkpointing']", problems)
        if kwargs["activation_checkpointing"] and gradient_checkpointing:
            problems.append("fsdp_config['activation_checkpointing']=True and gradient_checkpointing=True: use one "
                            "(with FSDP, activation_checkpointing avoids a redundant all-gather in the backward pass)")
    state_dict_type = str(config.get("state_dict_type", "FULL_STATE_DICT")).upper()
    if state_dict_type not in FSDP_STATE_DICT_TYPES or (version == 2 and state_dict_type == "LOCAL_STATE_DICT"):
        accepted = FSDP_STATE_DICT_TYPES[:2] if version == 2 else FSDP_STATE_DICT_TYPES
        problems.append(f"fsdp_config['state_dict_type']={config['state_dict_type']!r}: accepted with FSDP{version}: "
                        f"{', '.join(accepted)}")
    kwargs["state_dict_type"] = state_dict_type

    reshard = config.get("reshard_after_forward")
    if version == 2:
        kwargs["reshard_after_forward"] = True if reshard is None else as_bool(
            reshard, "fsdp_config['reshard_after_forward']", problems)
        for key in _FSDP1_ONLY_KEYS:
            if key in config:
                problems.append(f"fsdp_config[{key!r}]={config[key]!r}: exists only in FSDP1 (fsdp_config['version']"
                                "=1); FSDP2 has no such setting")
    else:
        strategy = str(reshard if reshard is not None else "full_shard").upper()
        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            problems.append(f"fsdp_config['reshard_after_forward']={reshard!r}: with FSDP1 a sharding strategy: "
                            "full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2")
        kwargs["reshard_after_forward"] = strategy.lower()
        prefetch = str(config.get("backward_prefetch", "NO_PREFETCH")).upper()
        if prefetch not in FSDP_BACKWARD_PREFETCH:
            problems.append(f"fsdp_config['backward_prefetch']={config['backward_prefetch']!r}: accepted: "
                            f"{', '.join(FSDP_BACKWARD_PREFETCH)}")
        kwargs["backward_prefetch"] = prefetch
        for key, default in (("forward_prefetch", False), ("use_orig_params", True), ("sync_module_states", True)):
            kwargs[key] = as_bool(config.get(key, default), f"fsdp_config[{key!r}]", problems)
        if "limit_all_gathers" in config:
            kwargs["limit_all_gathers"] = as_bool(config["limit_all_gathers"], "fsdp_config['limit_all_gathers']",
                                                   problems)
    policy = _mixed_precision_policy(config.get("mixed_precision_policy"), mixed_precision, version, problems)
    if policy is not None:
        kwargs["mixed_precision_policy"] = policy
    return kwargs, problems


def _mixed_precision_policy(given, mixed_precision: str, version: int, problems: list[str]):
    """The FSDP mixed precision policy of a half-precision run, as torch's policy object (FSDP2's
    `MixedPrecisionPolicy`, FSDP1's `MixedPrecision`): parameters in the run's half dtype, gradients reduced in
    float32 (FSDP1 also keeps buffers in the half dtype, as Accelerate does). None in full precision.

    An object rather than a dict of dtypes: Accelerate 1.15 (setup.cfg's floor) checks a dict for every key the
    FSDP2 policy has (param_dtype, reduce_dtype, output_dtype) and rejects one without output_dtype, while an
    object is taken as it is by every version since.

    Accelerate's default for bf16 reduces in bf16, and FSDP2 then also accumulates the unsharded gradients of a
    window's no-sync micro-batches in bf16: the sums lose bits against DDP's float32 gradients, and accumulation
    is no longer exact. float32 costs twice the reduce-scatter traffic of bf16 and twice the memory of the
    unsharded gradients held through a window; the sharded gradients stay float32 as the parameters are.
    fsdp_config['mixed_precision_policy'] ({"param_dtype", "reduce_dtype", "buffer_dtype" (FSDP1)}: "bfloat16",
    "float16" or "float32") overrides any of them, e.g. {"reduce_dtype": "bfloat16"} for half the traffic."""
    import torch

    keys = ("param_dtype", "reduce_dtype") + (("buffer_dtype",) if version == 1 else ())
    half = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision)
    if given is not None and half is None:
        problems.append(f"fsdp_config['mixed_precision_policy']={given!r}: needs bf16=True or fp16=True (FSDP's "
                        "mixed precision is the run's), or remove it")
        return None
    if half is None:
        return None
    names = {"param_dtype": half, "reduce_dtype": "float32", "buffer_dtype": half}
    if given is not None and not isinstance(given, dict):
        problems.append(f"fsdp_config['mixed_precision_policy']={given!r}: must be a dict of {', '.join(keys)}")
        given = {}
    for key, value in (given or {}).items():
        if key not in keys:
            problems.append(f"fsdp_config['mixed_precision_policy'][{key!r}]: unknown key{suggest(key, keys)}; "
                            f"accepted with FSDP{version}: {', '.join(keys)}")
        elif str(value).lower() not in FSDP_DTYPES:
            problems.append(f"fsdp_config['mixed_precision_policy'][{key!r}]={value!r}: accepted: bfloat16, "
                            "float16, float32")
        else:
            names[key] = FSDP_DTYPES[str(value).lower()]
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    return (MixedPrecisionPolicy if version == 2 else MixedPrecision)(**{k: getattr(torch, names[k]) for k in keys})


def reduce_in_float32(plugin, mixed_precision: str) -> None:
    """Give a plugin that Accelerate built itself (from `accelerate launch`'s FSDP config, which has no mixed
    precision policy: bf16 reduces then) the policy of `_mixed_precision_policy`. Accelerate reads it when it
    prepares the model, after this."""
    policy = _mixed_precision_policy(None, mixed_precision, plugin.fsdp_version, [])
    if policy is not None:
        plugin.mixed_precision_policy = policy


def _layers_to_wrap(model, names) -> tuple[list[str], list[str]]:
    """The layer classes FSDP wraps one by one: the ones named, else the model's _no_split_modules (its
    transformer blocks, as transformers and Accelerate default to); each must occur in the model."""
    present = {type(m).__name__ for m in model.modules()}
    if not names:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        names = list(getattr(base, "_no_split_modules", None) or [])
        if not names:
            return [], [f"fsdp: {type(model).__name__} has no _no_split_modules to wrap by layer; set "
                        "fsdp_config['transformer_layer_cls_to_wrap'] to its block class, or 'min_num_params' to wrap "
                        "by size"]
        names = [n for n in names if n in present] or names
    missing = [n for n in names if n not in present]
    if missing:
        return list(names), [f"fsdp_config['transformer_layer_cls_to_wrap']={list(names)!r}: {missing} not in "
                             f"{type(model).__name__}; its module classes are {sorted(present)}"]
    return list(names), []


def fsdp_plugin(kwargs: dict):
    """The Accelerate plugin for `fsdp_plugin_kwargs`' result."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**kwargs)


def full_tensor(value):
    """A sharded model's (FSDP2) tensors are DTensors; their full value, as a plain tensor (a collective:
    every rank must call it). Anything else passes through."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


# ---------------------------------------------------------------------------------------------------
# checkpoints of a sharded model (FSDP): every rank writes its own shards of the model and optimizer state.
# torch.distributed.checkpoint plans and reshards them; its HuggingFace storage writer and reader keep them in
# safetensors files whose headers hold each shard's offsets as JSON (its default writer stores a pickled
# `.metadata` and its reader unpickles it, so it is never used).

MODEL_SHARDS, OPTIMIZER_SHARDS = "model_shards", "optimizer_shards"


def is_sharded(accelerator) -> bool:
    """Whether Accelerate set up FSDP (version 1 or 2) for this run."""
    return str(accelerator.distributed_type).rsplit(".", 1)[-1] == "FSDP"


def gathers_full_model(accelerator) -> bool:
    """Whether checkpoints also hold the full model (fsdp_config state_dict_type FULL_STATE_DICT, the default,
    as in transformers): gathered on the main process and saved as save_pretrained saves it."""
    return str(accelerator.state.fsdp_plugin.state_dict_type).rsplit(".", 1)[-1] == "FULL_STATE_DICT"


def gather_full_model(model, trainable_only: bool = False) -> dict:
    """The full state dict of a sharded model (FSDP1 or 2) on the main process, in CPU memory ({} on the others;
    a collective), or only its trainable parameters. torch's API for both versions.

    torch's cpu_offload=True gathers one tensor at a time and keeps it, in CPU memory, on rank 0 only; without it
    every rank keeps the whole model on its device, which a model sharded because it does not fit one GPU (or
    offloaded because its shards do not) cannot afford. So it is always used, whether or not the run offloads
    its parameters (which live in CPU memory then: where they are says nothing about where the run computes),
    except by FSDP1 computing on the CPU, whose offload_to_cpu crashes on a model already there (Accelerate's
    FSDP1 gather too) and is not needed there."""
    from torch.distributed.checkpoint import state_dict as dcp_state
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel.fsdp_modules(model, root_only=True)
    to_cpu = not fsdp1 or fsdp1[0].compute_device.type != "cpu"
    return dcp_state.get_model_state_dict(model, options=dcp_state.StateDictOptions(
        full_state_dict=True, cpu_offload=to_cpu, ignore_frozen_params=trainable_only))


def model_class_name(model) -> str:
    """The model's own class name (FSDP2 replaces a sharded module's class by a subclass, FSDP<name>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _optimizer_tensors(model, optimizer):
    """The optimizer state keyed by parameter name, split into its JSON structure and its (sharded) tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tree, tensors = ckpt.flatten(get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer)))
    return tree, ckpt.unshared(tensors)


def _model_state(model, trainable_only: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))


def plan_shards(folder: str, model, optimizer, is_main: bool, trainable_only: bool = False,
                copy=None) -> Callable[[], None]:
    """Every rank, now: plan its shards of the model (or of its trainable parameters: a peft adapter) and of the
    optimizer state with every other rank (a collective), and take what it will write (`copy`: host copies of the
    tensors, for a write in the background). Returns the write of those shards into `folder`, with the optimizer
    state's structure (optimizer.json) from the main process; the write holds no collective."""
    tree, tensors = _optimizer_tensors(model, optimizer)
    writes = [_planned_write(os.path.join(folder, name), state, copy)
              for name, state in ((MODEL_SHARDS, ckpt.unshared(_model_state(model, trainable_only))),
                                  (OPTIMIZER_SHARDS, tensors))]

    def write() -> None:
        for one in writes:
            one()
        if is_main:
            ckpt.write_json(folder, "optimizer.json", tree)

    return write


def _planned_write(path: str, state: dict, copy) -> Callable[[], None]:
    """torch.distributed.checkpoint's save, split where its collectives end: the plan is made now with every rank
    (each rank's shards, replicated tensors written once, one safetensors file per rank whose header holds each
    shard's offsets), and the returned write stores this rank's planned items (HuggingFaceStorageWriter's files,
    fsynced) without communicating. Any rank's planning failure is raised on every rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    rank, writer, planner = dist.get_rank(), HuggingFaceStorageWriter(path, save_distributed=True), _planner()
    plan = failure = None
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        plan = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # torch's save gathers every rank's failure too
        failure = e
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)  # plain dataclasses; torch's own planning sends them pickled too
    if failure is not None or any(p is None for p in plans):
        raise OSError(f"planning {os.path.basename(path)}/ failed: {failure or 'on another process'}") from failure
    # every rank makes the global plan that torch's coordinator makes and scatters: the same on every rank
    plans, _ = planner.create_global_plan(plans)
    final = planner.finish_plan(writer.prepare_global_plan(plans)[rank])
    planner.take(final, copy)

    def write() -> None:
        try:
            writer.write_data(final, planner).wait()
        except Exception as e:
            raise OSError(f"writing {os.path.basename(path)}/ failed: {e}") from e

    return write


def _planner():
    """torch's default save planner, resolving the planned items from what `take` kept of them when the plan was
    made (the tensors of that moment, or their host copies) instead of from the live state at write time."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class SnapshotPlanner(DefaultSavePlanner):
        taken: dict = {}

        def take(self, plan, copy) -> None:
            items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            tensors = {n: super(SnapshotPlanner, self).resolve_data(i) for n, i in enumerate(items)}
            tensors = copy(tensors) if copy is not None else tensors
            self.taken = {i.index: tensors[n] for n, i in enumerate(items)}

        def resolve_data(self, write_item):
            taken = self.taken.get(write_item.index)
            return taken if taken is not None else super().resolve_data(write_item)

    return SnapshotPlanner()


def load_shards(folder: str, model, optimizer=None, trainable_only: bool = False) -> None:
    """Every rank reads its shards of the model (or of its trainable parameters), and of the optimizer state,
    from `folder` (a collective). The shards are matched by name and offsets, so they load under any number of
    ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def read(name: str, targets: dict) -> None:
        try:
            with warnings.catch_warnings():
                # torch warns that one process without a process group reads every shard itself (a plain run
                # resuming a sharded checkpoint), which is the point
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(targets, storage_reader=HuggingFaceStorageReader(os.path.join(folder, name)))
        except Exception as e:  # torch raises CheckpointException and others, naming the keys
            raise CheckpointError(f"{folder}/{name} does not fit this model: {e}") from e

    state = _model_state(model, trainable_only)
    read(MODEL_SHARDS, state)
    set_model_state_dict(model, state, options=StateDictOptions(strict=not trainable_only))
    if optimizer is None:
        return
    saved_tree = ckpt.read_json(folder, "optimizer.json")
    tensors = _optimizer_tensors(model, optimizer)[1]
    differ = sorted(set(tensors) ^ _tensor_keys(saved_tree))
    if differ:
        raise CheckpointError(f"{folder}/optimizer.json does not fit this optimizer: state tensors {differ[:5]} are "
                              "in only one of the two")
    read(OPTIMIZER_SHARDS, tensors)
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), ckpt.unflatten(saved_tree, tensors))


def load_whole(folder: str, model, optimizer=None) -> None:
    """Every rank: a whole checkpoint (a plain run's model files, and its optimizer state as torch's state_dict()
    writes it) into a model sharded by its plans, each rank keeping its slices of every tensor (a DTensor's by its
    placements) through torch's full-state-dict loading (a collective). The whole state is read on every rank,
    the size of the model and its optimizer state in host memory for the time of the load.

    torch's optimizer state keys the parameters by their position in the groups, and the sharded run's optimizer
    is built by the same groups in the same order (stoker.optim.parameter_groups), so position i is the i-th
    parameter of this optimizer's groups, named for torch by the model's names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    weights = ckpt.read_weights(folder)
    try:
        set_model_state_dict(model, weights, options=options)
    except (KeyError, RuntimeError, ValueError) as e:  # torch names the missing, unexpected or misshapen keys
        raise CheckpointError(f"{folder}/model.safetensors does not fit this model: {e}") from e
    if optimizer is None:
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    name_of = {p: n for n, p in model.named_parameters()}
    names = [name_of[p] for group in inner.param_groups for p in group["params"]]
    saved = ckpt.load_state(folder, "optimizer")
    positions = [i for group in saved["param_groups"] for i in group["params"]]
    if sorted(positions) != list(range(len(names))):
        raise CheckpointError(f"{folder}/optimizer.json does not fit this optimizer: it holds the state of "
                              f"{len(positions)} parameters and this optimizer has {len(names)}")
    by_name = {"state": {names[i]: state for i, state in saved["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in saved["param_groups"]]}
    set_optimizer_state_dict(model, inner, by_name, options=options)


def _tensor_keys(tree) -> set[str]:
    if isinstance(tree, list):
        return set().union(*map(_tensor_keys, tree)) if tree else set()
    if not isinstance(tree, dict):
        return set()
    if "__tensor__" in tree:
        return {tree["__tensor__"]}
    return set().union(*map(_tensor_keys, tree.values())) if tree else set()


def consolidate(checkpoint: str, out: str) -> str:
    """Save the full model of a sharded checkpoint in `out` with save_pretrained, for transformers: one process
    reads every rank's shards (no process group, no GPU). The model class comes from the checkpoint's
    config.json (`architectures`)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    shards = os.path.join(checkpoint, MODEL_SHARDS)
    if not os.path.isdir(shards):
        raise ConfigError([f"checkpoint={checkpoint!r}: no {MODEL_SHARDS}/ folder; give the checkpoint-<step> folder "
                           "of a run with fsdp"], "consolidate")
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ConfigError([f"checkpoint={checkpoint!r}: no config.json: the model class is unknown"], "consolidate")
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    name = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, name or "", None)
    if model_class is None:
        raise ConfigError([f"{checkpoint}/config.json: architectures={config.architectures!r}: not a transformers "
                           "model class"], "consolidate")
    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    state = get_model_state_dict(model)
    with warnings.catch_warnings():  # that it reads in one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(shards), no_dist=True)
    set_model_state_dict(model, state)
    model.save_pretrained(out)
    return out
