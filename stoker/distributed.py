"""How a run is distributed: the launcher's world, the Accelerate options stoker derives from the arguments,
and the checkpoint state that every rank of a sharded run writes and reads.

Every distributed mechanic is Accelerate's (and through it torch.distributed's, FSDP's and DeepSpeed's); this
module decides what to ask Accelerate for, refuses combinations that Accelerate would silently run as something
else, and keeps sharded and partitioned state in stoker's checkpoint format (safetensors + JSON, never a pickle).
It must stay cheap to import: torch, accelerate and deepspeed are imported where they are used.
"""

from __future__ import annotations

import os
import warnings

# Environment variables in which launchers state the number of processes: torchrun and `accelerate launch`
# set WORLD_SIZE, MPI launchers the others (the same list Accelerate reads).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# what torchrun, `accelerate launch` and the deepspeed launcher set for every process
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_world_size() -> int:
    """Processes the launcher started for this job (1 when the script runs without a launcher)."""
    for name in _WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...)."""
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def wants_cpu(use_cpu: bool) -> bool:
    """The `cpu` flag for Accelerator. Under a multi-process launcher on a machine without an accelerator,
    Accelerate needs cpu=True to set up a gloo process group: without it, every process trains alone."""
    return use_cpu or (launcher_world_size() > 1 and not accelerator_available())


def check_world_size(num_processes: int) -> None:
    """Refuse a run in which the launcher's processes did not join one process group (each would train its own
    model and write the same output_dir)."""
    launched = launcher_world_size()
    if launched > 1 and num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate set up "
            f"{num_processes}: they would train separately and overwrite each other's output. Accelerate "
            "supports multi-process runs on CUDA, XPU and other accelerators, and on the CPU (gloo, "
            "use_cpu=True); run with a supported device, or without a launcher")


# ---------------------------------------------------------------------------------------------------
# configuration files and dicts


def load_json_config(value, name: str) -> tuple[dict | None, list[str]]:
    """A dict field given as a dict, or as the path of a JSON file (TrainingArguments has already parsed a JSON
    string). Returns (config, problems)."""
    import json

    if value is None or isinstance(value, dict):
        return (dict(value) if value is not None else None), []
    if not isinstance(value, str):
        return None, [f"{name}={value!r}: must be a dict, a JSON object string or the path of a JSON file"]
    if not os.path.isfile(value):
        return None, [f"{name}={value!r}: no such file (give a JSON file, a JSON object string or a dict)"]
    try:
        with open(value) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return None, [f"{name}={value!r}: not a readable JSON file ({e})"]
    if not isinstance(config, dict):
        return None, [f"{name}={value!r}: the file must hold a JSON object, not {type(config).__name__}"]
    return config, []


def _as_bool(value, name: str, problems: list[str]) -> bool | None:
    """transformers reads these settings with str_to_bool: true/false, yes/no, 1/0, on/off."""
    text = str(value).lower()
    if text in ("true", "yes", "y", "t", "on", "1"):
        return True
    if text in ("false", "no", "n", "f", "off", "0"):
        return False
    problems.append(f"{name}={value!r}: must be true or false")
    return None


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
                    "xla_fsdp_settings")
_FSDP1_ONLY_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
                    "limit_all_gathers")


def fsdp_enabled(fsdp) -> bool:
    """`fsdp` as transformers reads it: True, a non-empty option string or list; False, None, '' are off."""
    if isinstance(fsdp, str):
        return fsdp.strip().lower() not in ("", "false", "no", "0")
    return bool(fsdp)


def fsdp_plugin_kwargs(fsdp, fsdp_config, gradient_checkpointing: bool = False,
                       model=None) -> tuple[dict, list[str]]:
    """FullyShardedDataParallelPlugin keyword arguments for transformers' `fsdp` and `fsdp_config`, with the
    meanings transformers 5 gives them (FSDP2 by default), and every problem found.

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
            from .arguments import suggest

            problems.append(f"fsdp_config[{key!r}]: unknown key{suggest(key, FSDP_CONFIG_KEYS)}; accepted: "
                            f"{', '.join(FSDP_CONFIG_KEYS)}")
    if any(_as_bool(config.get(k, False), f"fsdp_config[{k!r}]", problems) for k in ("xla", "xla_fsdp_v2")):
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
            from .arguments import suggest

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

    if _as_bool(config.get("cpu_offload", False), "fsdp_config['cpu_offload']", problems):
        kwargs["cpu_offload"] = True
    kwargs["cpu_ram_efficient_loading"] = _as_bool(config.get("cpu_ram_efficient_loading", False),
                                                   "fsdp_config['cpu_ram_efficient_loading']", problems)
    if "activation_checkpointing" in config:
        kwargs["activation_checkpointing"] = _as_bool(config["activation_checkpointing"],
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
        kwargs["reshard_after_forward"] = True if reshard is None else _as_bool(
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
            kwargs[key] = _as_bool(config.get(key, default), f"fsdp_config[{key!r}]", problems)
        if "limit_all_gathers" in config:
            kwargs["limit_all_gathers"] = _as_bool(config["limit_all_gathers"], "fsdp_config['limit_all_gathers']",
                                                   problems)
    return kwargs, problems


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
    import copy

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


def _deepspeed_trainer_problems(config: dict, args, optimizers=(None, None)) -> list[str]:
    """What the Trainer cannot do with this DeepSpeed config (and the optimizer and scheduler given to it). Sets
    ZeRO-3's gathering of the full model on save when the config leaves it out (save_model and checkpoints
    write the full model)."""
    p, zero = [], config["zero_optimization"]
    for given, section in zip(optimizers, ("optimizer", "scheduler"), strict=True):
        if given is not None and section in config:
            p.append(f"deepspeed[{section!r}]={config[section]!r} and the {section} given to the Trainer "
                     f"({type(given).__name__}): DeepSpeed builds the config's; remove one of the two")
    stage = zero.get("stage", 0)
    if stage == 0:
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
    if args.auto_find_batch_size:
        p.append("auto_find_batch_size=True with deepspeed: DeepSpeed fixes the micro-batch "
                 "(train_micro_batch_size_per_gpu) when it starts; set per_device_train_batch_size instead")
    return p


def finish_deepspeed_config(accelerator, args, num_training_steps: int) -> None:
    """Fill the "auto" values known only when training starts (the schedule's steps) into the DeepSpeed
    config of the Accelerator's plugin, before the model is prepared."""
    from .arguments import ConfigError

    plugin = accelerator.state.deepspeed_plugin
    filled, problems = fill_deepspeed_config(plugin.deepspeed_config, args, accelerator.num_processes,
                                             num_training_steps)
    if problems:
        raise ConfigError(problems, "distributed configuration")
    plugin.deepspeed_config.clear()
    plugin.deepspeed_config.update(filled)


def deepspeed_plugin(config: dict):
    """The Accelerate plugin for a filled DeepSpeed config (built without the deepspeed package)."""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=config)


# ---------------------------------------------------------------------------------------------------
# what TrainingArguments and the Trainer check


def argument_problems(args) -> list[str]:
    """Problems of fsdp / fsdp_config / deepspeed visible from the arguments alone (TrainingArguments)."""
    p = []
    fsdp_on = fsdp_enabled(args.fsdp)
    if fsdp_on and args.deepspeed not in (None, "", {}):
        p.append(f"fsdp={args.fsdp!r} and deepspeed={args.deepspeed!r}: both shard the model; choose one")
    p += fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, args.gradient_checkpointing)[1]
    if args.deepspeed not in (None, "", {}):
        p += deepspeed_config(args)[1]
    return p


def runtime_problems(args) -> list[str]:
    """What keeps this machine from running the requested FSDP or DeepSpeed: Accelerate would run without
    them (DDP, or one process) rather than fail, so stoker refuses before any work."""
    import importlib.util

    p = []
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
        missing = [v for v in _LAUNCHER_VARIABLES if v not in os.environ]
        if missing:  # DeepSpeed would look for MPI instead
            p.append(f"deepspeed={args.deepspeed!r}: DeepSpeed runs under a launcher, which sets "
                     f"{', '.join(_LAUNCHER_VARIABLES)} (missing: {', '.join(missing)}); start the script with "
                     "torchrun --nproc_per_node N (1 for one device), accelerate launch or deepspeed")
    return p


def sharding_plugins(args, model, optimizers=(None, None)) -> dict:
    """Accelerator keyword arguments for the sharding the arguments ask for ({} for none, i.e. DDP or one
    process). Raises ConfigError, before any work, for what cannot run here or is not supported."""
    from .arguments import ConfigError

    problems = runtime_problems(args)
    kwargs = {}
    if args.deepspeed not in (None, "", {}):
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        config, more = deepspeed_config(args, hidden_size=hidden)
        problems += more + (_deepspeed_trainer_problems(config, args, optimizers) if config else [])
        if not problems:
            kwargs["deepspeed_plugin"] = deepspeed_plugin(config)
    if fsdp_enabled(args.fsdp):
        plugin_kwargs, more = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, args.gradient_checkpointing, model)
        problems += more
        if not problems:
            kwargs["fsdp_plugin"] = fsdp_plugin(plugin_kwargs)
    if problems:
        raise ConfigError(problems, "distributed configuration")
    return kwargs


def check_sharding_active(args, distributed_type) -> None:
    """Accelerate turns FSDP on only in multi-process runs on accelerators and otherwise trains without it."""
    from .arguments import ConfigError

    if fsdp_enabled(args.fsdp) and str(distributed_type).rsplit(".", 1)[-1] != "FSDP":
        raise ConfigError([f"fsdp={args.fsdp!r}: Accelerate set up {distributed_type}, not FSDP: it shards only "
                           "in runs started by a launcher (torchrun or accelerate launch, also with one process) "
                           "on GPUs; refusing to train unsharded"], "distributed configuration")


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
    return str(accelerator.distributed_type).rsplit(".", 1)[-1] == "FSDP"


def gathers_full_model(accelerator) -> bool:
    """Whether checkpoints also hold the full model (fsdp_config state_dict_type FULL_STATE_DICT, the default,
    as in transformers): gathered on the main process and saved as save_pretrained saves it."""
    return str(accelerator.state.fsdp_plugin.state_dict_type).rsplit(".", 1)[-1] == "FULL_STATE_DICT"


def gather_full_model(model, trainable_only: bool = False) -> dict:
    """The full state dict of a sharded model (FSDP1 or 2) on the main process, in CPU memory ({} on the others;
    a collective), or only its trainable parameters. torch's API for both versions (Accelerate's FSDP1 gather,
    like an offload to the CPU of a model already there, crashes FSDP1 on the CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    on_cpu = next(model.parameters()).device.type == "cpu"
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu,
                                                                ignore_frozen_params=trainable_only))


def model_class_name(model) -> str:
    """The model's own class name (FSDP2 replaces a sharded module's class by a subclass, FSDP<name>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def parameters_finite(accelerator, model) -> bool:
    """Whether every parameter is finite, decided together by all ranks (each checks its own shards: an FSDP2
    DTensor's local part, a ZeRO-3 parameter's partition)."""
    import torch

    def own(p):
        return p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p

    local = all(bool(torch.isfinite(own(p)).all()) for p in model.parameters())
    if accelerator.num_processes == 1:
        return local
    flag = torch.tensor(0.0 if local else 1.0, device=accelerator.device)
    return accelerator.reduce(flag, reduction="sum").item() == 0


def _optimizer_tensors(model, optimizer):
    """The optimizer state keyed by parameter name, split into its JSON structure and its (sharded) tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from .checkpoint import flatten, unshared

    tree, tensors = flatten(get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer)))
    return tree, unshared(tensors)


def _model_state(model, trainable_only: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))


def save_shards(folder: str, model, optimizer, is_main: bool, trainable_only: bool = False) -> None:
    """Every rank writes its shards of the model (or of its trainable parameters: a peft adapter) and of the
    optimizer state into `folder` (a collective); the main process writes the optimizer state's structure
    (optimizer.json)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from .checkpoint import write_json

    tree, tensors = _optimizer_tensors(model, optimizer)
    for name, state in ((MODEL_SHARDS, _model_state(model, trainable_only)), (OPTIMIZER_SHARDS, tensors)):
        try:  # torch gathers every rank's failure and raises it on all of them
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(os.path.join(folder, name),
                                                                    save_distributed=True))
        except dcp.CheckpointException as e:
            raise OSError(f"writing {name}/ failed: {e}") from e
    if is_main:
        write_json(folder, "optimizer.json", tree)


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

    from .checkpoint import CheckpointError, read_json, unflatten

    def read(name: str, targets: dict) -> None:
        try:
            dcp.load(targets, storage_reader=HuggingFaceStorageReader(os.path.join(folder, name)))
        except Exception as e:  # torch raises CheckpointException and others, naming the keys
            raise CheckpointError(f"{folder}/{name} does not fit this model: {e}") from e

    state = _model_state(model, trainable_only)
    read(MODEL_SHARDS, state)
    set_model_state_dict(model, state, options=StateDictOptions(strict=not trainable_only))
    if optimizer is None:
        return
    saved_tree = read_json(folder, "optimizer.json")
    tensors = _optimizer_tensors(model, optimizer)[1]
    differ = sorted(set(tensors) ^ _tensor_keys(saved_tree))
    if differ:
        raise CheckpointError(f"{folder}/optimizer.json does not fit this optimizer: state tensors {differ[:5]} are "
                              "in only one of the two")
    read(OPTIMIZER_SHARDS, tensors)
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), unflatten(saved_tree, tensors))


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

    from .arguments import ConfigError

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


# ---------------------------------------------------------------------------------------------------
# checkpoints of a DeepSpeed run: every rank writes its ZeRO partition of the optimizer state. DeepSpeed's
# own checkpoints are torch.save pickles; its optimizer state is plain tensors and values but for two Python
# objects, which are left out: the loss scaler (kept as its plain attributes) and the map from parameters to
# partition fragments (rebuilt by DeepSpeed when it loads).


def is_deepspeed(accelerator) -> bool:
    return str(accelerator.distributed_type).rsplit(".", 1)[-1] == "DEEPSPEED"


def zero_stage(accelerator) -> int:
    return int(accelerator.state.deepspeed_plugin.zero_stage)


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

    from .checkpoint import CheckpointError, _weight_files, is_peft_model, load_weights

    module = getattr(model, "module", model)
    if is_peft_model(module):
        with deepspeed.zero.GatheredParameters([p for p in module.parameters() if p.requires_grad], modifier_rank=0):
            if is_main:
                load_weights(module, folder)
        return
    handles = [safe_open(f, "pt") for f in _weight_files(folder, ("model.safetensors",))]
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
    return os.path.exists(os.path.join(folder, f"{_zero_partition(0)}.json"))


def save_zero_partition(folder: str, optimizer, rank: int) -> None:
    """This rank's partition of the ZeRO optimizer's state, as tensors and plain values."""
    from .checkpoint import save_state

    zero = getattr(optimizer, "optimizer", optimizer)
    state = dict(zero.state_dict())
    scaler = state.pop("loss_scaler", None)
    state.pop("param_slice_mappings", None)
    state["loss_scaler"] = None if scaler is None else {
        k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    save_state(folder, _zero_partition(rank), state)


def load_zero_partitions(folder: str, optimizer, world_size: int, rank: int) -> None:
    """Load this rank's partition, and the parameters with it. DeepSpeed takes a list of every rank's, in rank
    order, but reads the others only for an elastic checkpoint (stage 1-2 `elastic_checkpoint`)."""
    import re

    from .checkpoint import CheckpointError, load_state

    written = len([f for f in os.listdir(folder) if re.fullmatch(r"optimizer_\d+\.json", f)])
    if written != world_size:
        raise CheckpointError(f"{folder} holds the ZeRO partitions of {written} processes: DeepSpeed resumes them "
                              f"with as many, not {world_size}")
    zero = getattr(optimizer, "optimizer", optimizer)
    every = getattr(zero, "elastic_checkpoint", False)
    states = [load_state(folder, _zero_partition(r)) if every or r == rank else None for r in range(world_size)]
    scaler = getattr(zero, "loss_scaler", None)
    saved_scaler = states[rank].get("loss_scaler")
    for state in filter(None, states):
        state["loss_scaler"] = scaler
    zero.load_state_dict(states, load_from_fp32_weights=True)
    for name, value in (saved_scaler or {}).items():
        setattr(scaler, name, value)
