"""DeepSpeed: transformers' `deepspeed` config loaded, checked and its "auto" values filled from the arguments
for Accelerate's DeepSpeedPlugin; ZeRO partitions of the optimizer state written and read in stoker's checkpoint
format; ZeRO-3 gathers.

Cheap to import: accelerate and the deepspeed package are imported where they are used.
"""

from __future__ import annotations

import copy
import os
import re

from .. import checkpoint_format as ckpt
from ..errors import CheckpointError, ConfigError
from .launch import launcher_world_size
from .parallelism import describe, read_parallelism_config
from .parsing import load_json_config
from .sequence_parallel import splits_sequences

# ---------------------------------------------------------------------------------------------------
# DeepSpeed: transformers' `deepspeed` -> accelerate.DeepSpeedPlugin, "auto" values filled from the arguments

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# config keys whose "auto" needs the model's hidden size (filled from model.config, by stoker or else by
# Accelerate) or the number of training steps (filled when training starts)
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")
_STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


def _node(config: dict, path: str):
    """(the dict holding the last key of a dotted path, that key); (None, key) if a parent is missing."""
    *parents, key = path.split(".")
    for p in parents:
        config = config.get(p)
        if not isinstance(config, dict):
            return None, key
    return config, key


def _get(config: dict, path: str, default=None):
    node, key = _node(config, path)
    return default if node is None else node.get(key, default)


def fill_deepspeed_config(config: dict, args, world_size: int, num_training_steps: int | None = None,
                          hidden_size: int | None = None) -> tuple[dict, list[str]]:
    """A copy of a DeepSpeed config with every "auto" that transformers fills filled from the arguments, and
    a problem for every value that disagrees with them (each naming both) or cannot be filled.

    As transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig: micro-batch, accumulation, global batch
    (world_size x micro-batch x accumulation), gradient clipping, optimizer lr / betas / eps / weight_decay,
    scheduler warmup_min_lr (0) / warmup_max_lr, fp16 / bf16 enabled; with the model's hidden size the ZeRO
    bucket sizes; with the number of training steps the scheduler's total and warm-up steps.
    """
    config, problems = copy.deepcopy(config), []

    def fill(path: str, value, field: str, must_match: bool = True):
        node, key = _node(config, path)
        if node is None or key not in node:
            return
        if node[key] == "auto":
            node[key] = value
        elif must_match and node[key] != value:
            problems.append(f"deepspeed[{path!r}]={node[key]!r} disagrees with {field}={value!r}; set it to \"auto\" "
                            "or make the two equal")

    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    exact = not args.auto_find_batch_size  # the micro-batch may be halved at run time
    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", exact)
    fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    fill("train_batch_size", world_size * micro * accumulation,
         f"world_size x per_device_train_batch_size x gradient_accumulation_steps ({world_size} x {micro} x "
         f"{accumulation})", exact)
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, "warmup_min_lr", must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("fp16.enabled", bool(args.fp16), "fp16")
    fill("bf16.enabled", bool(args.bf16), "bf16")
    if hidden_size is not None:
        fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, "hidden_size^2", must_match=False)
        if _get(config, "zero_optimization.stage") == 3:
            fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size),
                 "0.9 x hidden_size^2", must_match=False)
            fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, "10 x hidden_size",
                 must_match=False)
    if num_training_steps is not None:
        fill("scheduler.params.total_num_steps", num_training_steps, "max_steps (planned)")
        # deepspeed rejects warmup_num_steps <= 0 (transformers keeps it positive too)
        fill("scheduler.params.warmup_num_steps", max(1, args.warmup_for(num_training_steps)), "warmup_steps")
    problems += [f"deepspeed[{path!r}]=\"auto\": stoker cannot fill it; give a value" for path in _autos(config)
                 if path not in _HIDDEN_SIZE_KEYS and (path not in _STEP_KEYS or num_training_steps is not None)]
    return config, problems


def _autos(config, prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _autos(value, f"{path}.")
        elif value == "auto":
            out.append(path)
    return out


def deepspeed_problems(config: dict) -> list[str]:
    """Problems with a DeepSpeed config itself (ZeRO stage, offload devices, precision)."""
    p = []
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return [f"deepspeed: needs a 'zero_optimization' section (e.g. {{\"stage\": 2}}); found keys {sorted(config)}"]
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        p.append(f"deepspeed['zero_optimization.stage']={stage!r}: accepted: {', '.join(map(str, ZERO_STAGES))}")
    for what in ("offload_optimizer", "offload_param"):
        section = zero.get(what)
        if section is None:
            continue
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device not in OFFLOAD_DEVICES:
            p.append(f"deepspeed['zero_optimization.{what}.device']={device!r}: accepted: {', '.join(OFFLOAD_DEVICES)}")
            continue
        if device == "none":
            continue
        if what == "offload_param" and stage != 3:
            p.append(f"deepspeed['zero_optimization.offload_param.device']={device!r}: parameter offload needs ZeRO "
                     f"stage 3, the config has stage {stage}")
        if what == "offload_optimizer" and stage == 0:
            p.append(f"deepspeed['zero_optimization.offload_optimizer.device']={device!r}: needs ZeRO stage 1, 2 or 3")
        if device == "nvme":
            if stage != 3:
                p.append(f"deepspeed['zero_optimization.{what}.device']='nvme': NVMe offload needs ZeRO stage 3")
            if not section.get("nvme_path"):
                p.append(f"deepspeed['zero_optimization.{what}.nvme_path']: NVMe offload needs a path")
    if _get(config, "fp16.enabled") is True and _get(config, "bf16.enabled") is True:
        p.append("deepspeed['fp16.enabled'] and deepspeed['bf16.enabled'] are both true: choose one")
    return p


def deepspeed_config(args, world_size: int | None = None, num_training_steps: int | None = None,
                     hidden_size: int | None = None) -> tuple[dict | None, list[str]]:
    """args.deepspeed loaded, checked and filled: (config, problems)."""
    config, problems = load_json_config(args.deepspeed, "deepspeed")
    if config is None:
        return None, problems
    problems += deepspeed_problems(config)
    config, more = fill_deepspeed_config(config, args, world_size or launcher_world_size(), num_training_steps,
                                         hidden_size)
    return config, problems + more


def deepspeed_trainer_problems(config: dict, args, optimizers=(None, None)) -> list[str]:
    """What the Trainer cannot do with this DeepSpeed config (and the optimizer and scheduler given to it). Sets
    ZeRO-3's gathering of the full model on save when the config leaves it out (save_model and checkpoints
    write the full model)."""
    p, zero = [], config["zero_optimization"]
    for given, section in zip(optimizers, ("optimizer", "scheduler"), strict=True):
        if given is not None and section in config:
            p.append(f"deepspeed[{section!r}]={config[section]!r} and the {section} given to the Trainer "
                     f"({type(given).__name__}): DeepSpeed builds the config's; remove one of the two")
    stage = zero.get("stage", 0)
    if stage == 0 and splits_sequences(read_parallelism_config(args.parallelism_config)[0]):
        p.append("deepspeed['zero_optimization.stage']=0 with sequence parallelism is not yet run by stoker: "
                 "DeepSpeed's stage-0 engine reports no gradient norm, which the step's check and log read; "
                 "accepted: stage 1, 2 or 3")
    elif stage == 0:
        p.append("deepspeed['zero_optimization.stage']=0: that is plain data parallelism, which stoker does without "
                 "DeepSpeed; leave deepspeed unset, or use stage 1, 2 or 3")
    if stage == 3:
        key = "stage3_gather_16bit_weights_on_model_save"
        if zero.setdefault(key, True) is not True:
            p.append(f"deepspeed['zero_optimization.{key}']={zero[key]!r}: save_model and checkpoints write the full "
                     "model, which ZeRO-3 gathers only with it; set it to true")
        if args.chunked_loss:
            p.append("chunked_loss=True with ZeRO-3: the chunked loss reads the output layer's weight outside the "
                     "forward pass, where ZeRO-3 holds only this process's partition of it; turn one off")
    p += _sequence_parallel_zero3_problems(zero, args)
    if args.auto_find_batch_size:
        p.append("auto_find_batch_size=True with deepspeed: DeepSpeed fixes the micro-batch "
                 "(train_micro_batch_size_per_gpu) when it starts; set per_device_train_batch_size instead")
    return p


def averages_sequence_groups(stage: int) -> bool:
    """Whether DeepSpeed averages the gradients of a sequence-parallel group rather than summing them: ZeRO-3's
    reduce-scatter before deepspeed 0.20.2 divides by every rank of the group (stages 1 and 2 divide by the
    data-parallel ranks only, as 0.20.2's ZeRO-3 does)."""
    from importlib.metadata import version

    from packaging.version import Version

    return stage == 3 and Version(version("deepspeed")) < Version("0.20.2")


def _sequence_parallel_zero3_problems(zero: dict, args) -> list[str]:
    """ZeRO-3 with sequence parallelism before deepspeed 0.20.2: with reduce_scatter false and contiguous_gradients,
    the parameters of one bucket are summed over the group and those of a larger one averaged, which no single
    scale of the loss makes right (transformers refuses it too)."""
    sequence, _ = read_parallelism_config(args.parallelism_config)
    if not (splits_sequences(sequence) and averages_sequence_groups(zero.get("stage", 0))):
        return []
    if zero.get("reduce_scatter", True) is False and zero.get("contiguous_gradients", True) is not False:
        return [f"deepspeed['zero_optimization.reduce_scatter']=False with contiguous_gradients and "
                f"{describe(sequence)}: DeepSpeed before 0.20.2 sums some gradients of the sequence-parallel group "
                "and averages others; accepted: reduce_scatter true (the default), or deepspeed>=0.20.2"]
    return []


def finish_deepspeed_config(accelerator, args, num_training_steps: int) -> None:
    """Fill the "auto" values known only when training starts (the schedule's steps) into the DeepSpeed
    config of the Accelerator's plugin, before the model is prepared."""
    plugin = accelerator.state.deepspeed_plugin
    # the processes that read different rows (the ranks of a sequence-parallel group share theirs)
    processes = getattr(accelerator, "data_parallel_size", accelerator.num_processes)
    filled, problems = fill_deepspeed_config(plugin.deepspeed_config, args, processes, num_training_steps)
    if problems:
        raise ConfigError(problems, "distributed configuration")
    plugin.deepspeed_config.clear()
    plugin.deepspeed_config.update(filled)


def deepspeed_plugin(config: dict):
    """The Accelerate plugin for a filled DeepSpeed config (built without the deepspeed package)."""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=config)


# ---------------------------------------------------------------------------------------------------
# checkpoints of a DeepSpeed run: every rank writes its ZeRO partition of the optimizer state. DeepSpeed's
# own checkpoints are torch.save pickles; its optimizer state is plain tensors and values but for two Python
# objects, which are left out: the loss scaler (kept as its plain attributes) and the map from parameters to
# partition fragments (rebuilt by DeepSpeed when it loads).


def is_deepspeed(accelerator) -> bool:
    """Whether Accelerate set up DeepSpeed for this run."""
    return str(accelerator.distributed_type).rsplit(".", 1)[-1] == "DEEPSPEED"


def zero_stage(accelerator) -> int:
    """The ZeRO stage (0-3) of a DeepSpeed run's config."""
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def non_embedding_parameters(model) -> int:
    """The model's parameters but its embeddings' (transformers' num_parameters(exclude_embeddings=True)), whole
    under ZeRO-3 too, which leaves each rank only its partition of every parameter (ds_numel is the whole)."""
    import torch

    if not any(hasattr(p, "ds_numel") for p in model.parameters()):
        return model.num_parameters(exclude_embeddings=True)
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.ds_numel for n, p in model.named_parameters() if n not in embeddings)


def gather_trainable_zero3(model) -> dict:
    """The trainable parameters (a peft adapter) of a ZeRO-3 model, gathered whole on every rank (a collective):
    ZeRO-3 leaves each rank only its partition of a parameter."""
    import deepspeed

    named = [(n, p) for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().clone() for n, p in named}


def load_zero3_weights(model, folder: str, is_main: bool) -> None:
    """Load a checkpoint's weights into a ZeRO-3 model one module at a time (gathered, written by the main
    process, partitioned again), so that no rank ever holds the whole model; a peft adapter is small and loaded
    by peft while gathered whole. Every rank must call it."""
    import deepspeed
    from safetensors import safe_open

    module = getattr(model, "module", model)
    if ckpt.is_peft_model(module):
        with deepspeed.zero.GatheredParameters([p for p in module.parameters() if p.requires_grad], modifier_rank=0):
            if is_main:
                ckpt.load_weights(module, folder)
        return
    handles = [safe_open(f, "pt") for f in ckpt._weight_files(folder, ("model.safetensors",))]
    source = {key: h for h in handles for key in h.keys()}
    # checked by every rank alike, before any gathering
    problems = [f"{k} is not in the model" for k in sorted(set(source) - set(module.state_dict()))]
    names: dict[int, list[str]] = {}  # a tied parameter is saved under one of its names
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        if name in source and tuple(source[name].get_slice(name).get_shape()) != tuple(p.ds_shape):
            problems.append(f"{name} has shape {source[name].get_slice(name).get_shape()} in the checkpoint, "
                            f"{list(p.ds_shape)} in the model")
    problems += [f"{aliases[0]} is missing from the checkpoint" for aliases in names.values()
                 if not any(n in source for n in aliases)]
    if problems:
        raise CheckpointError(f"{folder} does not fit this model: " + "; ".join(problems[:5]))
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        params = [(dot + n, p) for n, p in sub.named_parameters(recurse=False) if dot + n in source]
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if is_main:
                for name, p in params:
                    p.data.copy_(source[name].get_tensor(name))
        for name, buffer in sub.named_buffers(recurse=False):  # not partitioned: every rank loads its own
            if dot + name in source:
                buffer.copy_(source[dot + name].get_tensor(dot + name))


def _zero_partition(rank: int) -> str:
    return f"optimizer_{rank}"


def is_zero_checkpoint(folder: str) -> bool:
    """Whether a checkpoint folder holds ZeRO partitions (was written by a DeepSpeed run)."""
    return os.path.exists(os.path.join(folder, f"{_zero_partition(0)}.json"))


def save_zero_partition(folder: str, optimizer, rank: int) -> None:
    """This rank's partition of the ZeRO optimizer's state, as tensors and plain values."""
    zero = getattr(optimizer, "optimizer", optimizer)
    state = dict(zero.state_dict())
    scaler = state.pop("loss_scaler", None)
    state.pop("param_slice_mappings", None)
    state["loss_scaler"] = None if scaler is None else {
        k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    ckpt.save_state(folder, _zero_partition(rank), state)


def zero_partitions_written(folder: str) -> int:
    """How many processes' ZeRO partitions a checkpoint holds."""
    return len([f for f in os.listdir(folder) if re.fullmatch(r"optimizer_\d+\.json", f)])


def load_zero_partitions(folder: str, optimizer, world_size: int, rank: int) -> None:
    """Load this rank's partition, and the parameters with it (the backend's check_checkpoint has made sure there
    are `world_size` of them). DeepSpeed takes a list of every rank's, in rank order, but reads the others only
    for an elastic checkpoint (stage 1-2 `elastic_checkpoint`)."""
    zero = getattr(optimizer, "optimizer", optimizer)
    every = getattr(zero, "elastic_checkpoint", False)
    states = [ckpt.load_state(folder, _zero_partition(r)) if every or r == rank else None for r in range(world_size)]
    scaler = getattr(zero, "loss_scaler", None)
    saved_scaler = states[rank].get("loss_scaler")
    for state in filter(None, states):
        state["loss_scaler"] = scaler
    zero.load_state_dict(states, load_from_fp32_weights=True)
    for name, value in (saved_scaler or {}).items():
        setattr(scaler, name, value)
