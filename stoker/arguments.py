"""TrainingArguments: every knob of a run, grouped, validated at once, and serialisable as JSON.

Field names and defaults follow `transformers.TrainingArguments` wherever the two overlap, so a script or a
YAML written for the Hugging Face Trainer carries over. Each field's `help` is what `--help` prints.

This module must stay cheap to import: it imports neither transformers nor any other heavy library. The
lists of valid names below are kept in step with transformers by a test.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .compilation import COMPILE_SCOPES
from .distributed.accelerator import argument_problems
from .distributed.launch import LAUNCHER_PRECISIONS, launcher_precision, launcher_world_size, wants_cpu
from .distributed.parallelism import parallelism_sizes
from .errors import ConfigError, suggest
from .float8 import float8_problems
from .muon import muon_problems
from .optim import OPTIMIZERS, optimizer_problems
from .requirements import installed_version_problems
from .tracking import report_to_problems, resolve_report_to

# Names that `transformers.get_scheduler` accepts ("reduce_lr_on_plateau" and "greedy" step on an evaluation metric).
SCHEDULER_NAMES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
    "warmup_stable_decay", "greedy",
)
INTERVAL_STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
TOKEN_COUNTS = ("no", "all", "non_padding")
ACCELERATOR_CONFIG_KEYS = (
    "split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking",
    "gradient_accumulation_kwargs", "use_configured_state",
)
# Fields that are parsed and validated but whose feature is not built yet: setting them is an error rather
# than a silent no-op. Each maps to the value that means "off".
NOT_YET_SUPPORTED: dict[str, Any] = {}
NONFINITE_POLICIES = ("skip", "stop")
# transformers' trainer_log_levels; 'passive' leaves the loggers' levels alone
LOG_LEVELS = ("detail", "debug", "info", "warning", "error", "critical", "passive")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
METRIC_INPUTS = ("inputs", "loss")
DEBUG_OPTIONS = ("underflow_overflow",)
RESUME_MISMATCH = ("error", "warn")
MOE_AUX_LOSS_SCOPES = ("micro_batch", "global_batch")
# the settings moe_aux_loss_scope='global_batch' cannot go with, and why
GLOBAL_BALANCE_CONFLICTS = {
    "chunked_loss": "computes the loss from hidden states, without the router's load-balancing term",
    "label_smoothing_factor": "replaces the model's loss, which carries the load-balancing term",
    "shared_prefix": "runs the prefix tokens through the routers once, outside the micro-batch's routing"}
# Dict-valued fields that may arrive as a JSON string from the command line.
JSON_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "accelerator_config", "fsdp_config",
               "deepspeed", "activation_checkpointing_kwargs", "liger_kernel_config", "parallelism_config")


# the settings shared_prefix cannot go with, and why
SHARED_PREFIX_CONFLICTS = {
    "packing": "packed rows start with different sequences",
    "padding_free": "a flattened micro-batch is a single row",
    "gradient_checkpointing": "recomputing activations drops the KV cache that carries the prefix",
    "fsdp": "the prefix runs through the model's body outside FSDP's wrapper",
    "deepspeed": "the prefix runs through the model's body outside DeepSpeed's engine"}
# as transformers declares its `bool | None` switches, so that a bare `--gradient_checkpointing` means True
BARE_FLAG = {"nargs": "?", "const": True}


def _help(text: str) -> dict:
    # only what argparse accepts: transformers' HfArgumentParser hands the metadata to add_argument as is.
    # The --help group of each field is FIELD_GROUPS, below the class.
    return {"help": text}


# GradientAccumulationPlugin's options, each with the value that is stoker's loop (None: any bool is honoured)
GRADIENT_ACCUMULATION_OPTIONS = {"sync_each_batch": None, "adjust_scheduler": True, "sync_with_dataloader": True}


def gradient_accumulation_problems(kwargs) -> list[str]:
    """Problems of accelerator_config's gradient_accumulation_kwargs (Accelerate's GradientAccumulationPlugin
    options, as transformers passes them on). The loop accumulates itself, token-exact: sync_each_batch is
    honoured; adjust_scheduler and sync_with_dataloader are accepted at True, which is what the loop does (one
    schedule step per optimizer step; the epoch's last window may be short and still steps); num_steps is
    gradient_accumulation_steps."""
    name = "accelerator_config.gradient_accumulation_kwargs"
    if kwargs is None:
        return []
    if not isinstance(kwargs, dict):
        return [f"{name}={kwargs!r}: must be a dict of {', '.join(GRADIENT_ACCUMULATION_OPTIONS)}"]
    p = []
    for key, value in kwargs.items():
        if key == "num_steps":
            p.append(f"{name}: num_steps={value!r}: set gradient_accumulation_steps instead (the loop accumulates "
                     "itself, token-exact)")
        elif key not in GRADIENT_ACCUMULATION_OPTIONS:
            p.append(f"{name}: unknown key {key!r}{suggest(key, GRADIENT_ACCUMULATION_OPTIONS)}; accepted: "
                     f"{', '.join(GRADIENT_ACCUMULATION_OPTIONS)}")
        elif not isinstance(value, bool):
            p.append(f"{name}: {key}={value!r}: must be True or False")
        elif GRADIENT_ACCUMULATION_OPTIONS[key] is not None and value != GRADIENT_ACCUMULATION_OPTIONS[key]:
            p.append(f"{name}: {key}={value!r}: stoker's loop always behaves as {key}=True (one schedule step per "
                     "optimizer step, a short last window at the end of an epoch); leave it True")
    return p


@dataclass
class AcceleratorConfig:
    """accelerator_config once read, with the attributes and defaults of transformers' AcceleratorConfig: the
    options of Accelerate's DataLoaderConfiguration that every prepared loader follows."""

    split_batches: bool = False  # True: per_device_*_batch_size is the global batch, split across processes
    dispatch_batches: bool | None = None  # None: stoker's choice, each process reads its share (see build)
    even_batches: bool = True  # the last global batch padded with the first rows so every process has one
    use_seedable_sampler: bool = True  # the shuffle follows data_seed and the epoch: resumable
    non_blocking: bool = False  # host-to-device copies without waiting (with dataloader_pin_memory)
    # Accelerate's GradientAccumulationPlugin options that fit the loop's own exact accumulation: sync_each_batch
    gradient_accumulation_kwargs: dict | None = None
    use_configured_state: bool = False  # refused when True: each Trainer configures Accelerate itself

    @classmethod
    def from_json_file(cls, json_file: str) -> AcceleratorConfig:
        """The configuration in a JSON file; ValueError names unknown keys."""
        with open(json_file, encoding="utf-8") as f:
            values = json.load(f)
        unknown = sorted(k for k in values if k not in ACCELERATOR_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"accelerator_config file {json_file}: unknown keys {unknown}; accepted: "
                             f"{', '.join(ACCELERATOR_CONFIG_KEYS)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Every attribute, as a new dict."""
        return copy.deepcopy(self.__dict__)

    def pop(self, key: str, default=None):
        """Remove an attribute and return its value, as transformers' object allows."""
        return self.__dict__.pop(key, default)

    def dataloader_options(self) -> dict[str, Any]:
        """The keyword arguments of Accelerate's DataLoaderConfiguration, dispatch_batches as given: None stays None
        on the Accelerator, as transformers leaves it, and stoker's Accelerator prepares its loaders then as with
        False (stoker.distributed.accelerator.ShareReadingAccelerator)."""
        return {"split_batches": self.split_batches, "even_batches": self.even_batches,
                "dispatch_batches": self.dispatch_batches, "use_seedable_sampler": self.use_seedable_sampler,
                "non_blocking": self.non_blocking}

    def syncs_each_batch(self) -> bool:
        """gradient_accumulation_kwargs' sync_each_batch: gradients all-reduced after every micro-batch's backward
        rather than once per window (less memory under FSDP, which then holds no unsharded gradients between
        micro-batches; more communication)."""
        return bool((self.gradient_accumulation_kwargs or {}).get("sync_each_batch", False))


@dataclass
class TrainingArguments:
    """Every setting of a run, with the fields, defaults and meaning of transformers' TrainingArguments (5.x)
    plus stoker's own (packing, chunked_loss, nonfinite_policy, resume_mismatch, save_on_signal, ...).

    Validated as a whole when made: every problem is reported at once in one ConfigError that names the field,
    the value and what is accepted ("did you mean" for misspelt choices), and a setting whose optional package
    is missing gives the pip command. Loads from YAML/JSON config files and command lines (`stoker train`,
    HfArgumentParser) with the same checks; `to_dict()` / `to_json_string()` round-trip it.
    """

    default_optim = "adamw_torch_fused"  # as transformers' class attribute (not a field)
    # --- where the run writes -------------------------------------------------------------------
    output_dir: str | None = field(default=None, metadata=_help(
        "Folder for checkpoints, logs and the final model (default: 'trainer_output')."))
    overwrite_output_dir: bool = field(default=False, metadata=_help(
        "A new run removes the checkpoints an earlier run left in output_dir, once it has committed one of its "
        "own (without it they stay, as in transformers 5)."))
    run_name: str | None = field(default=None, metadata=_help(
        "A name for the run in logs (default: the output_dir)."))
    do_train: bool = field(default=False, metadata=_help(
        "Run training. Read by scripts (the recipes, transformers' examples), not by the Trainer."))
    do_eval: bool = field(default=False, metadata=_help(
        "Run evaluation on the dev set; set to True when eval_strategy is not 'no'. Read by scripts."))
    do_predict: bool = field(default=False, metadata=_help(
        "Run predictions on the test set. Read by scripts, not by the Trainer."))

    # --- duration -------------------------------------------------------------------------------
    num_train_epochs: float = field(default=3.0, metadata=_help(
        "Passes over the training data; fractional values stop part-way through the last epoch."))
    max_steps: int = field(default=-1, metadata=_help(
        "Optimizer steps to run; overrides num_train_epochs when > 0."))

    # --- batch ----------------------------------------------------------------------------------
    per_device_train_batch_size: int = field(default=8, metadata=_help(
        "Samples per micro-batch on each process."))
    per_device_eval_batch_size: int = field(default=8, metadata=_help(
        "Samples per evaluation batch on each process."))
    gradient_accumulation_steps: int = field(default=1, metadata=_help(
        "Micro-batches per optimizer step. The loss is normalised over every target token of the window, so "
        "B x A equals one batch of B*A exactly."))
    auto_find_batch_size: bool = field(default=False, metadata=_help(
        "On out-of-memory, halve the micro-batch and double gradient_accumulation_steps (the update stays the "
        "same), retry the step, and keep the new size in checkpoints."))
    average_tokens_across_devices: bool = field(default=True, metadata=_help(
        "Normalise the loss over the target tokens of every process (an exact global mean). False normalises "
        "over each process's own tokens, and the processes' gradients are averaged (transformers' False)."))
    moe_aux_loss_scope: str = field(default="micro_batch", metadata=_help(
        "What a Mixture-of-Experts model's load-balancing loss (router_aux_loss_coef, output_router_logits) "
        "balances: 'micro_batch', each micro-batch's own, weighed by its share of the window's items; "
        "'global_batch', the expert loads of the whole window on every process (Qiu et al., ACL 2025), counted "
        "by a forward-only routing pass before the first backward, so B x A x N equals one batch of B*A*N."))

    # --- optimizer and schedule -----------------------------------------------------------------
    learning_rate: float = field(default=5e-5, metadata=_help("Peak learning rate."))
    weight_decay: float = field(default=0.0, metadata=_help(
        "Decoupled weight decay; never applied to biases and normalisation weights."))
    adam_beta1: float = field(default=0.9, metadata=_help("Adam beta1."))
    adam_beta2: float = field(default=0.999, metadata=_help("Adam beta2."))
    adam_epsilon: float = field(default=1e-8, metadata=_help("Adam epsilon."))
    max_grad_norm: float = field(default=1.0, metadata=_help(
        "Clip the global gradient norm to this value (0 disables clipping; the norm is still measured and logged "
        "as grad_norm)."))
    optim: str = field(default="adamw_torch_fused", metadata=_help(
        f"Optimizer: one of {', '.join(OPTIMIZERS)}."))
    optim_args: str | None = field(default=None, metadata=_help(
        "Extra optimizer keyword arguments as 'key=value,key=value'."))
    lr_scheduler_type: str = field(default="linear", metadata=_help(
        f"Learning-rate schedule (transformers' get_scheduler): one of {', '.join(SCHEDULER_NAMES)}."))
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata=_help(
        "Extra scheduler arguments, as a dict or a JSON string, e.g. '{\"num_cycles\": 2}'."))
    warmup_steps: float = field(default=0, metadata=_help(
        "Linear warm-up: optimizer steps if >= 1, else a fraction of max_steps."))
    warmup_ratio: float = field(default=0.0, metadata=_help(
        "Warm-up as a fraction of max_steps (used when warmup_steps is 0)."))
    optim_target_modules: None | str | list[str] = field(default=None, metadata=_help(
        "GaLore / APOLLO optimizers: the modules whose linear weights they project (names, a regular expression "
        "or 'all-linear'); unset for every other optimizer."))
    label_smoothing_factor: float = field(default=0.0, metadata=_help(
        "Label smoothing epsilon: the loss mixes (1 - eps) x cross-entropy with eps x the mean negative "
        "log-likelihood over the vocabulary, summed over target tokens and normalised over the window."))
    neftune_noise_alpha: float | None = field(default=None, metadata=_help(
        "NEFTune: add uniform noise of scale alpha / sqrt(seq_len * hidden) to the input embeddings in training."))

    # --- precision ------------------------------------------------------------------------------
    bf16: bool | None = field(default=None, metadata=_help(
        "bfloat16 mixed precision (autocast). Not given (None): True on a CUDA GPU with bf16 (compute capability "
        "8.0 or more) unless fp16, gpu_defaults=False, a DeepSpeed config (an enabled bf16 / fp16 section decides) or "
        "accelerate launch's mixed_precision say otherwise, else False; False given keeps float32.") | BARE_FLAG)
    fp16: bool = field(default=False, metadata=_help(
        "float16 mixed precision with loss scaling (needs a GPU)."))
    tf32: bool | None = field(default=None, metadata=_help(
        "Allow TF32 matmuls (and cuDNN convolutions) on NVIDIA Ampere or newer. Not given (None): True there "
        "(gpu_defaults), else torch's setting is left alone; False given keeps full float32."))
    gpu_defaults: bool = field(default=True, metadata=_help(
        "On a CUDA GPU of compute capability 8.0 or more, a bf16 or tf32 not given becomes True (one notice line "
        "says so). False: transformers' defaults (float32 matmuls unless bf16 / tf32 are given)."))
    fp8: str | None = field(default=None, metadata=_help(
        "float8 training through torchao on GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell): 'tensorwise' "
        "(fastest) or 'rowwise' (more accurate), torchao's recipes; the output layer and layers with a dimension "
        "not a multiple of 16 stay in bfloat16. Needs bf16=True; fast with torch_compile=True (stoker.float8)."))
    bf16_full_eval: bool = field(default=False, metadata=_help(
        "Evaluate outside training with the model cast to bfloat16 (faster, less memory, less exact)."))
    fp16_full_eval: bool = field(default=False, metadata=_help(
        "Evaluate outside training with the model cast to float16."))

    # --- memory ---------------------------------------------------------------------------------
    gradient_checkpointing: bool | None = field(default=None, metadata=_help(
        "Recompute activations in the backward pass (non-reentrant) to save memory (alias of "
        "activation_checkpointing; resolves to False).") | BARE_FLAG)
    gradient_checkpointing_kwargs: dict | str | None = field(default=None, metadata=_help(
        "Passed to model.gradient_checkpointing_enable, as a dict or a JSON string."))
    torch_compile: bool = field(default=False, metadata=_help(
        "Compile the model with torch.compile: its repeated blocks (decoder layers) or the whole model, as "
        "compile_scope says."))
    torch_compile_backend: str | None = field(default=None, metadata=_help(
        "torch.compile backend (default 'inductor'); setting it implies torch_compile."))
    torch_compile_mode: str | None = field(default=None, metadata=_help(
        "torch.compile mode, e.g. 'reduce-overhead' or 'max-autotune'; setting it implies torch_compile."))
    compile_scope: str = field(default="auto", metadata=_help(
        "What torch_compile compiles: 'blocks' (each repeated block, e.g. every decoder layer, in place; the "
        "attention mask and rotary tables stay outside the graph, so sdpa keeps its causal kernel), 'model' (the "
        "whole model, as transformers.Trainer does) or 'auto' (blocks where the model has repeated blocks, else the "
        "whole model); 'blocks' or 'model' implies torch_compile."))
    chunked_loss: bool = field(default=False, metadata=_help(
        "Compute a causal LM's loss from its final hidden states a chunk of tokens at a time, never holding the "
        "[batch, seq, vocab] logits (same loss and gradients; stoker.loss.chunked). Evaluation still computes "
        "logits when compute_metrics needs predictions."))
    shared_prefix: bool = field(default=False, metadata=_help(
        "Run the leading tokens that every row of a training micro-batch shares (a system prompt, a fixed "
        "instruction) once, for one row, and give the rest of each row their keys and values as a KV cache (same "
        "loss and gradients; stoker.loss.prefix). For causal LMs with a KV cache; the prefix holds no target."))
    activation_checkpointing: bool | None = field(default=None, metadata=_help(
        "Recompute activations in the backward pass (transformers 5's name for gradient_checkpointing).") | BARE_FLAG)
    activation_checkpointing_kwargs: dict | str | None = field(default=None, metadata=_help(
        "Passed to model.gradient_checkpointing_enable (as gradient_checkpointing_kwargs), a dict or JSON."))
    use_liger_kernel: bool = field(default=False, metadata=_help(
        "Patch the model with Liger kernels when training starts (needs the liger-kernel package then); a "
        "loss-only evaluation asks the model to skip its logits. With chunked_loss on a GPU, Liger's fused "
        "kernel computes that loss (two host reads a micro-batch; stoker.loss.chunked)."))
    liger_kernel_config: dict | str | None = field(default=None, metadata=_help(
        "Keyword arguments for liger_kernel's _apply_liger_kernel_to_instance, a dict or JSON."))
    use_cache: bool = field(default=False, metadata=_help(
        "Let the model keep a KV cache in training forwards (off: a cache is wasted memory there, and it makes "
        "transformers ignore the position_ids of packed rows)."))
    torch_empty_cache_steps: int | None = field(default=None, metadata=_help(
        "Empty the accelerator's cache every this many optimizer steps (lower peak memory, slower)."))

    # --- data -----------------------------------------------------------------------------------
    dataloader_num_workers: int = field(default=0, metadata=_help(
        "Worker processes per dataloader (0 loads in the main process)."))
    dataloader_pin_memory: bool = field(default=True, metadata=_help(
        "Pin host memory for faster copies to the GPU."))
    dataloader_persistent_workers: bool = field(default=False, metadata=_help(
        "Keep dataloader workers alive between epochs (needs dataloader_num_workers > 0)."))
    dataloader_prefetch_factor: int | None = field(default=None, metadata=_help(
        "Batches each worker loads ahead (needs dataloader_num_workers > 0)."))
    dataloader_drop_last: bool = field(default=False, metadata=_help(
        "Drop the last incomplete micro-batch of each epoch."))
    remove_unused_columns: bool = field(default=True, metadata=_help(
        "Drop dataset columns that the model's forward does not accept (transformers and peft models)."))
    label_names: list[str] | None = field(default=None, metadata=_help(
        "Batch keys that hold the labels (default: ['labels'])."))
    group_by_length: bool = field(default=False, metadata=_help(
        "Batch samples of similar length together to reduce padding."))
    length_column_name: str = field(default="length", metadata=_help(
        "Dataset column with precomputed lengths for group_by_length."))
    seed: int = field(default=42, metadata=_help("Seed for model initialisation, dropout and shuffling."))
    data_seed: int | None = field(default=None, metadata=_help(
        "Seed for the data order only (default: seed)."))
    dataloader_multiprocessing_context: str | None = field(default=None, metadata=_help(
        "Start method of dataloader workers: 'fork', 'spawn' or 'forkserver' (default: the platform's)."))
    dataloader_in_order: bool = field(default=True, metadata=_help(
        "Yield batches in the order workers were dispatched; False yields them as they are ready (the order, and "
        "so an exact resume, then depends on timing)."))
    train_sampling_strategy: str = field(default="random", metadata=_help(
        "Training sampler: 'random', 'sequential' or 'group_by_length' (similar lengths batched together)."))
    ignore_data_skip: bool = field(default=False, metadata=_help(
        "On resume, start the saved epoch from its first batch instead of skipping the batches already seen "
        "(faster to start; the run is no longer the same as one never stopped)."))
    full_determinism: bool = field(default=False, metadata=_help(
        "Deterministic algorithms everywhere (torch.use_deterministic_algorithms, cuDNN, cuBLAS workspace); slower."))
    # sequence packing (stoker.packing), named as TRL's SFTConfig names it (its max_length is packing_length here,
    # since the recipes' max_length already truncates rows)
    packing: bool = field(default=False, metadata=_help(
        "Pack the train set once, before training, best-fit-decreasing into rows of packing_length tokens whose "
        "sequences never attend to each other (position_ids restart, no attention_mask); same loss per "
        "sequence, far less padding. Needs a model whose attention reads position_ids (checked)."))
    packing_length: int | None = field(default=None, metadata=_help(
        "Tokens per packed row (TRL's max_length; the recipes feed their max_length). Default: the longest row "
        "of the train set. A longer row is an error."))
    padding_free: bool = field(default=False, metadata=_help(
        "Flatten each micro-batch into one row of its sequences, in order, with no padding at all (TRL's "
        "padding_free; with packing, the packed rows of a micro-batch). Same model requirement as packing."))

    # --- logging --------------------------------------------------------------------------------
    logging_dir: str | None = field(default=None, metadata=_help(
        "TensorBoard folder unless TENSORBOARD_LOGGING_DIR is set, as transformers 5 reads it (default: "
        "output_dir/runs/<date>_<host>)."))
    logging_strategy: str = field(default="steps", metadata=_help(
        "When to log: 'no', 'steps' (every logging_steps) or 'epoch'."))
    logging_steps: float = field(default=500, metadata=_help(
        "Optimizer steps between logs; a value < 1 is a fraction of max_steps."))
    logging_first_step: bool = field(default=False, metadata=_help("Also log after the first step."))
    report_to: None | str | list[str] = field(default="none", metadata=_help(
        "Trackers the logs go to besides the console and metrics.jsonl, as transformers names them: 'mlflow', "
        "'wandb', 'trackio', 'tensorboard', 'comet_ml', 'clearml', ... (stoker.tracking), 'all' (every one "
        "installed) or 'none'."))
    disable_tqdm: bool | None = field(default=None, metadata=_help(
        "Turn off the progress display: each log is printed as a dict on stdout instead (PrinterCallback, as "
        "transformers)."))
    include_num_input_tokens_seen: str = field(default="no", metadata=_help(
        "Count input tokens into state.num_input_tokens_seen: 'no', 'all' (padding included) or 'non_padding'; "
        "True means 'all' (as transformers)."))
    peak_tflops: float | None = field(default=None, metadata=_help(
        "Peak dense TFLOPS of one device at the training precision, for the 'mfu' log on GPUs (default: looked up "
        "by GPU name and precision in stoker.diagnostics.PEAK_TFLOPS; no MFU for an unknown device)."))
    training_report: bool = field(default=False, metadata=_help(
        "At the end of train(), write output_dir/report.html: loss, evaluation metrics, learning rate, gradient norm "
        "and throughput curves, and the configuration (needs matplotlib)."))
    log_level: str = field(default="passive", metadata={**_help(
        "Logging level of the main process for the 'stoker' and 'transformers' loggers: 'detail', 'debug', "
        "'info', 'warning', 'error', 'critical', or 'passive' (leave the levels as they are)."),
        "choices": LOG_LEVELS})
    log_level_replica: str = field(default="warning", metadata={**_help(
        "Logging level of the other processes (as log_level)."), "choices": LOG_LEVELS})
    log_on_each_node: bool = field(default=True, metadata=_help(
        "With several nodes, log at log_level on each node's main process, not only on the first node's."))
    logging_nan_inf_filter: bool = field(default=True, metadata=_help(
        "Leave the losses of non-finite steps out of the logged loss (False logs them, so the log shows nan). "
        "A window whose every step was non-finite logs nan either way."))
    skip_memory_metrics: bool = field(default=True, metadata=_help(
        "False adds transformers' memory deltas (*_mem_cpu_alloc_delta, ...) to the train/eval/test metrics."))
    debug: str | list[str] = field(default="", metadata=_help(
        "Debug features: 'underflow_overflow' (report the first module whose activations or weights hold inf or "
        "nan); 'tpu_metrics_debug' needs a TPU and is refused."))
    project: str = field(default="huggingface", metadata=_help(
        "Project name for Trackio (report_to='trackio')."))
    trackio_space_id: str | None = field(default=None, metadata=_help(
        "Trackio: the Hugging Face Space to send the logs to (default: stored locally)."))
    trackio_bucket_id: str | None = field(default=None, metadata=_help(
        "Trackio: the bucket that stores the logs of trackio_space_id."))
    trackio_static_space_id: str | None = field(default=None, metadata=_help(
        "Trackio: the static Space a trackio_space_id run is frozen into when training ends."))

    # --- evaluation -----------------------------------------------------------------------------
    eval_strategy: str = field(default="no", metadata=_help(
        "When to evaluate: 'no', 'steps' (every eval_steps) or 'epoch'."))
    eval_steps: float | None = field(default=None, metadata=_help(
        "Optimizer steps between evaluations (default: logging_steps); < 1 is a fraction of max_steps."))
    eval_on_start: bool = field(default=False, metadata=_help(
        "Evaluate once before the first step (a sanity check and a baseline)."))
    eval_accumulation_steps: int | None = field(default=None, metadata=_help(
        "Move gathered predictions to the CPU every this many eval batches (saves accelerator memory)."))
    metric_for_best_model: str | None = field(default=None, metadata=_help(
        "Metric that picks the best checkpoint, with or without the 'eval_' prefix (default: 'loss')."))
    greater_is_better: bool | None = field(default=None, metadata=_help(
        "Whether a larger metric_for_best_model is better (default: False for names ending in 'loss')."))
    eval_delay: float = field(default=0, metadata=_help(
        "Steps (eval_strategy='steps') or epochs ('epoch') to wait before the first evaluation."))
    prediction_loss_only: bool = field(default=False, metadata=_help(
        "Evaluation and predict return the loss only: no predictions are gathered and no compute_metrics runs."))
    eval_do_concat_batches: bool = field(default=True, metadata=_help(
        "Concatenate the evaluation batches' predictions into one array; False keeps a list, one per batch."))
    eval_use_gather_object: bool = field(default=False, metadata=_help(
        "Gather predictions across processes as Python objects (for outputs that are not tensors)."))
    include_for_metrics: list[str] = field(default_factory=list, metadata=_help(
        "Also pass to compute_metrics: 'inputs' (the input_ids) and/or 'loss' (one loss per batch)."))
    batch_eval_metrics: bool = field(default=False, metadata=_help(
        "Call compute_metrics after every evaluation batch with compute_result=False, and with True on the last, "
        "instead of once over all predictions (no predictions are kept in memory)."))

    # --- saving ---------------------------------------------------------------------------------
    save_strategy: str = field(default="steps", metadata=_help(
        "When to checkpoint: 'no', 'steps', 'epoch' or 'best' (whenever the best metric improves)."))
    save_steps: float = field(default=500, metadata=_help(
        "Optimizer steps between checkpoints; < 1 is a fraction of max_steps."))
    save_total_limit: int | None = field(default=None, metadata=_help(
        "Keep at most this many checkpoints (never deleting the best or the newest)."))
    load_best_model_at_end: bool = field(default=False, metadata=_help(
        "Load the best checkpoint's weights when training ends (needs matching eval and save strategies)."))
    resume_from_checkpoint: str | None = field(default=None, metadata=_help(
        "Checkpoint folder to resume from, 'true' for the newest complete checkpoint in output_dir (refused where "
        "there is none), or 'last' for that checkpoint or a new run where there is none (a requeued job); used by "
        "the recipes and `stoker train`."))
    save_only_model: bool = field(default=False, metadata=_help(
        "Checkpoints hold the model only (no optimizer, scheduler or RNG state): smaller, but they cannot be "
        "resumed from."))
    async_save: bool = field(default=False, metadata=_help(
        "Write checkpoints in the background: the loop waits only for a copy of the state in host memory (pinned "
        "on a GPU) and trains on; the checkpoint is committed as a synchronous one is, and a failed write is "
        "raised at a later step. Costs host memory for one checkpoint in flight; not with DeepSpeed."))
    save_on_each_node: bool = field(default=False, metadata=_help(
        "Write checkpoints from every node (for nodes without a shared disk); refused with several nodes, as "
        "stoker commits each checkpoint once."))
    restore_callback_states_from_checkpoint: bool = field(default=False, metadata=_help(
        "On resume, restore the state of stateful callbacks (early stopping's counter, ...) from the checkpoint."))

    # --- faults -----------------------------------------------------------------------------------
    nonfinite_policy: str = field(default="skip", metadata=_help(
        "On a non-finite loss or gradient norm (checked every step, before the optimizer step): 'skip' the "
        "update (parameters and optimizer state unchanged, counted in the logs) or 'stop' with an error."))
    max_nonfinite_steps: int = field(default=3, metadata=_help(
        "Stop with an error after this many consecutive non-finite steps, whatever nonfinite_policy says."))
    spike_rollback: bool = field(default=False, metadata=_help(
        "Heal loss spikes in the run: a window whose loss is above spike_factor x the running median of the last "
        "spike_window windows (after spike_window steps), or is not finite, rolls the run back to its last "
        "in-memory snapshot, quarantines the window's rows (output_dir/quarantine.jsonl, and every later "
        "checkpoint) and trains on without them."))
    spike_factor: float = field(default=3.0, metadata=_help(
        "spike_rollback: a window's loss above this many times the running median of the last spike_window "
        "windows is a spike (> 1)."))
    spike_window: int = field(default=20, metadata=_help(
        "spike_rollback: the windows the running median is taken over, and the steps before spikes are looked "
        "for (>= 2)."))
    spike_snapshot_steps: int = field(default=20, metadata=_help(
        "spike_rollback: steps between two in-memory snapshots of the run (host memory for one copy of the "
        "trainable weights and the optimizer state); a rollback recomputes at most this many steps."))
    max_rollbacks: int = field(default=3, metadata=_help(
        "spike_rollback: after this many rollbacks, the next spike stops the run with SpikeError, its last good "
        "state checkpointed and the spike's rows quarantined."))
    save_on_signal: bool = field(default=True, metadata=_help(
        "On SIGTERM or SIGUSR1 (preemption, SLURM time limits), finish the optimizer step, write a checkpoint "
        "and exit with code 75 (stoker.errors.PREEMPTED_EXIT_CODE); resume with resume_from_checkpoint=True."))
    resume_mismatch: str = field(default="error", metadata=_help(
        "When a checkpoint was written with another global batch (processes x per-device batch x "
        "accumulation), dataset length or seeds: 'error' refuses to resume, naming the layouts that keep the "
        "global batch; 'warn' continues from the same sample with the new settings (no longer exact). Another "
        "layout of the same global batch is the same run and resumes either way."))
    enable_jit_checkpoint: bool = field(default=False, metadata=_help(
        "transformers' checkpoint on SIGTERM, which stoker does with save_on_signal (on by default); True needs "
        "save_on_signal=True."))

    # --- devices and distribution ---------------------------------------------------------------
    use_cpu: bool = field(default=False, metadata=_help("Train on the CPU even when an accelerator exists."))
    accelerator_config: dict | str | None = field(default=None, metadata=_help(
        "Accelerate's dataloader options, as transformers' AcceleratorConfig, a dict (missing keys take the "
        f"defaults), a JSON string or the path of a JSON file: {', '.join(ACCELERATOR_CONFIG_KEYS)}; read back "
        "as an AcceleratorConfig."))
    fsdp: str | None = field(default=None, metadata=_help(
        "FSDP through Accelerate: true, or transformers' options 'full_shard' / 'shard_grad_op' (FSDP2: reshard "
        "parameters after forward or not), 'offload' (parameters and gradients on the CPU), 'auto_wrap'. Needs GPUs "
        "and a launcher (torchrun, accelerate launch)."))
    fsdp_config: dict | str | None = field(default=None, metadata=_help(
        "FSDP settings as a dict, a JSON string or a JSON file, with transformers' keys: version (2, or 1), "
        "transformer_layer_cls_to_wrap (default: the model's _no_split_modules), min_num_params (wrap by size), "
        "auto_wrap_policy, reshard_after_forward, cpu_offload, cpu_ram_efficient_loading, activation_checkpointing, "
        "state_dict_type (checkpoints always hold every process's shards; FULL_STATE_DICT, the default, adds the "
        "full model)."))
    deepspeed: dict | str | None = field(default=None, metadata=_help(
        "DeepSpeed config as a dict, a JSON string or a JSON file (ZeRO stage 1-3, offload), for a run under a "
        "launcher; \"auto\" values are filled from these arguments as transformers fills them, and values that "
        "disagree with them are errors."))
    ddp_backend: str | None = field(default=None, metadata=_help(
        "torch.distributed backend: 'nccl', 'gloo', ... (default: chosen by torch)."))
    ddp_find_unused_parameters: bool | None = field(default=None, metadata=_help(
        "DDP find_unused_parameters (default: False with gradient checkpointing, else True)."))
    ddp_bucket_cap_mb: int | None = field(default=None, metadata=_help("DDP gradient bucket size in MiB."))
    ddp_broadcast_buffers: bool | None = field(default=None, metadata=_help(
        "DDP broadcast_buffers (default: torch's)."))
    ddp_timeout: int = field(default=1800, metadata=_help("Process-group timeout in seconds."))
    ddp_static_graph: bool | None = field(default=None, metadata=_help(
        "DDP static_graph (the set of used parameters is the same every step; default: torch's)."))
    parallelism_config: dict | str | None = field(default=None, metadata=_help(
        "Accelerate's ParallelismConfig, a dict or a JSON string of its sizes, multiplying to the number of "
        "processes: tp_size (the model's tp_plan), dp_shard_size (FSDP2 by its fsdp_plan), dp_replicate_size "
        "(HSDP) and their combinations; cp_size (context parallelism, CUDA, with fsdp='full_shard', alone or "
        "with dp_shard_size); sp_size alone (Ulysses, with deepspeed)."))
    local_rank: int = field(default=-1, metadata=_help(
        "Set by launchers; stoker reads the process's rank from the environment (LOCAL_RANK) instead."))

    # --- the Hugging Face Hub -------------------------------------------------------------------------
    push_to_hub: bool = field(default=False, metadata=_help(
        "Upload to the Hub: refused, stoker does not use the network (upload output_dir with `hf upload`)."))
    hub_token: str | None = field(default=None, metadata=_help("Hub token (recorded as '<HUB_TOKEN>' only)."))
    hub_private_repo: bool | None = field(default=None, metadata=_help("Hub: make the repository private."))
    hub_model_id: str | None = field(default=None, metadata=_help("Hub: the repository name."))
    hub_strategy: str = field(default="every_save", metadata=_help(
        "Hub: what to push when: 'end', 'every_save', 'checkpoint' or 'all_checkpoints'."))
    hub_always_push: bool = field(default=False, metadata=_help("Hub: push even if the previous push is pending."))
    hub_revision: str | None = field(default=None, metadata=_help("Hub: the branch to push to."))

    def __setattr__(self, name: str, value) -> None:
        # a data_seed not given follows seed, as transformers reads "data_seed, else seed" where it shuffles: a
        # script that sets args.seed after construction (transformers' own model_init test does) shuffles by it
        if name == "seed" and self.__dict__.get("_data_seed_is_seed"):
            self.__dict__["data_seed"] = value
        elif name == "data_seed":
            self.__dict__["_data_seed_is_seed"] = False
        super().__setattr__(name, value)

    def __post_init__(self):
        outdated = installed_version_problems()
        if outdated:  # first: a library outside its range fails in ways that do not name it
            raise ConfigError(list(outdated), "installation")
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(self.output_dir)  # as transformers: "~/runs/x" is a home folder
        if self.use_cpu:  # as transformers: nothing to pin for on the CPU
            self.dataloader_pin_memory = False
        if self.run_name is None:
            self.run_name = self.output_dir
        if self.logging_dir is None:
            stamp = datetime.now().strftime("%b%d_%H-%M-%S")
            self.logging_dir = os.path.join(self.output_dir, "runs", f"{stamp}_{socket.gethostname()}")
        self.report_to = resolve_report_to(self.report_to)
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None or \
                self.compile_scope in ("blocks", "model"):
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        counting = str(self.include_num_input_tokens_seen).lower()
        if counting in ("true", "false"):  # transformers maps booleans so
            self.include_num_input_tokens_seen = "all" if counting == "true" else "no"
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        if self.eval_strategy != "no":  # as transformers: scripts read do_eval
            self.do_eval = True
        # activation_checkpointing is transformers 5's name; gradient_checkpointing, its alias, is what stoker reads
        if self.activation_checkpointing is None:
            self.activation_checkpointing = bool(self.gradient_checkpointing)
        self.gradient_checkpointing = self.activation_checkpointing
        if self.gradient_checkpointing_kwargs is None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        if self.train_sampling_strategy == "group_by_length":  # one switch under its two names
            self.group_by_length = True
        elif self.group_by_length and self.train_sampling_strategy == "random":
            self.train_sampling_strategy = "group_by_length"
        if isinstance(self.include_for_metrics, str):
            self.include_for_metrics = [self.include_for_metrics]
        if isinstance(self.debug, str) or self.debug is None:  # transformers' parser leaves None when not given
            self.debug = (self.debug or "").split()
        if self.data_seed is None:
            self.data_seed = self.seed
            self._data_seed_is_seed = True  # until data_seed is set: see __setattr__
        self._gpu_default_notice = self._apply_gpu_defaults()
        problems = []
        for name in JSON_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as e:
                    problems.append(f"{name}={value!r}: not valid JSON ({e.msg})")
        problems += self._read_accelerator_config()
        if self.metric_for_best_model is None and self.load_best_model_at_end:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        problems += self.problems()
        if problems:
            raise ConfigError(problems, "TrainingArguments")

    # ------------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with these arguments, each naming the field, the value and what is accepted."""
        p = []

        def bad(name, accepted):
            p.append(f"{name}={getattr(self, name)!r}: {accepted}")

        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        if self.max_steps == 0 or (self.max_steps < 0 and self.max_steps != -1):
            bad("max_steps", "must be > 0, or -1 to train for num_train_epochs")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            bad("num_train_epochs", "must be > 0 when max_steps is not set")
        if self.learning_rate < 0:
            bad("learning_rate", "must be >= 0")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            bad("max_grad_norm", "must be >= 0 (0 disables clipping)")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0 (steps, or a fraction of max_steps if < 1)")
        if not 0 <= self.warmup_ratio < 1:
            bad("warmup_ratio", "must be in [0, 1)")
        if self.warmup_ratio and self.warmup_steps:
            p.append(f"warmup_steps={self.warmup_steps!r} and warmup_ratio={self.warmup_ratio!r}: set only one")
        if self.compile_scope not in COMPILE_SCOPES:
            bad("compile_scope", f"accepted: {', '.join(map(repr, COMPILE_SCOPES))}")
        if self.optim not in OPTIMIZERS:
            bad("optim", f"unknown optimizer{suggest(self.optim, OPTIMIZERS)}; "
                         f"accepted: {', '.join(OPTIMIZERS)}")
        p += optimizer_problems(self, launcher_world_size(), self._on_cuda())
        if self.lr_scheduler_type not in SCHEDULER_NAMES:
            bad("lr_scheduler_type", f"unknown scheduler{suggest(self.lr_scheduler_type, SCHEDULER_NAMES)}; "
                                     f"accepted: {', '.join(SCHEDULER_NAMES)}")
        try:
            self.optimizer_kwargs()
        except ValueError as e:
            bad("optim_args", f"{e}; write e.g. 'betas=(0.9,0.95),eps=1e-6'")
        if self.optim == "muon":
            p += muon_problems(self)  # its optim_args, and the sharding that would split its matrices
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs"):
            if isinstance(getattr(self, name), str) and getattr(self, name).lstrip().startswith("{"):
                continue  # invalid JSON, reported by __post_init__
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                bad(name, "must be a dict or a JSON object string")
        checkpointing = self.gradient_checkpointing_kwargs
        checkpointing = checkpointing if isinstance(checkpointing, dict) else {}
        every = checkpointing.get("every_n_layers", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            p.append(f"gradient_checkpointing_kwargs every_n_layers={every!r}: accepted: an integer >= 1 (1 "
                     f"checkpoints every layer)")
        if not isinstance(checkpointing.get("offload", False), bool):
            p.append(f"gradient_checkpointing_kwargs offload={checkpointing['offload']!r}: accepted: True or False")
        accelerate = self.accelerator_config
        if isinstance(accelerate, AcceleratorConfig):
            p += gradient_accumulation_problems(accelerate.gradient_accumulation_kwargs)
            if accelerate.use_configured_state:
                p.append("accelerator_config.use_configured_state=True: stoker builds the Accelerator of each Trainer "
                         "from these arguments; leave it False")

        # precision
        # the phrases transformers raises in, so that a script matching its ValueError's text still matches
        if self.bf16 and self.fp16:
            p.append("bf16=True and fp16=True: choose one mixed-precision mode (At most one of fp16 and bf16 can be "
                     "True, but not both)")
        if self.bf16_full_eval and self.fp16_full_eval:
            p.append("bf16_full_eval=True and fp16_full_eval=True: choose one (At most one of fp16 and bf16 can be "
                     "True for full eval, but not both)")
        p += self._hardware_problems()

        # data loading
        if self.dataloader_num_workers < 0:
            bad("dataloader_num_workers", "must be >= 0")
        if self.dataloader_num_workers == 0:
            if self.dataloader_persistent_workers:
                bad("dataloader_persistent_workers", "needs dataloader_num_workers > 0")
            if self.dataloader_prefetch_factor is not None:
                bad("dataloader_prefetch_factor", "needs dataloader_num_workers > 0")

        # strategies and intervals
        for name, choices in (("logging_strategy", INTERVAL_STRATEGIES), ("eval_strategy", INTERVAL_STRATEGIES),
                              ("save_strategy", SAVE_STRATEGIES)):
            if getattr(self, name) not in choices:
                bad(name, f"accepted: {', '.join(choices)}{suggest(getattr(self, name), choices)}")
        for name, strategy in (("logging_steps", self.logging_strategy), ("eval_steps", self.eval_strategy),
                               ("save_steps", self.save_strategy)):
            value = getattr(self, name)
            if strategy == "steps" and not (value > 0 and (value < 1 or float(value).is_integer())):
                bad(name, f"with {name.split('_')[0]}_strategy='steps' it must be a whole number >= 1 "
                          "or a fraction in (0, 1) of max_steps")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            bad("save_total_limit", "must be >= 1, or None to keep every checkpoint")
        if self.eval_accumulation_steps is not None and self.eval_accumulation_steps < 1:
            bad("eval_accumulation_steps", "must be >= 1")
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            p.append("save_strategy='best' needs metric_for_best_model, e.g. 'eval_loss' (`args.metric_for_best_model` "
                     "must be provided when using 'best' save_strategy)")
        if self.lr_scheduler_type == "reduce_lr_on_plateau" and self.eval_strategy == "no":
            p.append("lr_scheduler_type='reduce_lr_on_plateau' steps on an evaluation metric: set eval_strategy "
                     "'steps' or 'epoch' (lr_scheduler_type reduce_lr_on_plateau requires an eval strategy)")
        if self.lr_scheduler_type == "greedy" and self.eval_strategy == "no":
            p.append("lr_scheduler_type='greedy' steps on an evaluation metric: set eval_strategy 'steps' or 'epoch' "
                     "(lr_scheduler_type greedy requires an eval strategy)")
        if self.save_strategy == "best" and self.eval_strategy == "no":
            p.append("save_strategy='best' needs eval_strategy 'steps' or 'epoch'")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                p.append("load_best_model_at_end=True needs eval_strategy 'steps' or 'epoch' (it is 'no')")
            elif self.save_strategy not in (self.eval_strategy, "best"):
                p.append(f"load_best_model_at_end=True needs save_strategy == eval_strategy; got "
                         f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}")
            elif (self.save_strategy == "steps" and self.save_steps >= 1 and self.eval_steps >= 1
                  and self.save_steps % self.eval_steps):
                p.append(f"load_best_model_at_end=True needs save_steps to be a multiple of eval_steps; got "
                         f"save_steps={self.save_steps!r}, eval_steps={self.eval_steps!r}")
        if self.nonfinite_policy not in NONFINITE_POLICIES:
            bad("nonfinite_policy", f"accepted: {', '.join(NONFINITE_POLICIES)}")
        if self.max_nonfinite_steps < 1:
            bad("max_nonfinite_steps", "must be >= 1")
        if not (isinstance(self.spike_factor, (int, float)) and self.spike_factor > 1):
            bad("spike_factor", "must be a number > 1 (a spike is a loss above spike_factor x the running median)")
        for name, least in (("spike_window", 2), ("spike_snapshot_steps", 1), ("max_rollbacks", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < least:
                bad(name, f"must be a whole number >= {least}")
        if self.resume_mismatch not in RESUME_MISMATCH:
            bad("resume_mismatch", f"accepted: {', '.join(RESUME_MISMATCH)}")
        if self.moe_aux_loss_scope not in MOE_AUX_LOSS_SCOPES:
            bad("moe_aux_loss_scope", f"accepted: {', '.join(MOE_AUX_LOSS_SCOPES)}")
        elif self.moe_aux_loss_scope == "global_batch":
            p += [f"moe_aux_loss_scope='global_batch' with {name}={getattr(self, name)!r}: {reason}; use one or "
                  "the other" for name, reason in GLOBAL_BALANCE_CONFLICTS.items() if getattr(self, name)]
            if self.auto_find_batch_size and launcher_world_size() > 1:
                p.append(f"moe_aux_loss_scope='global_batch' with auto_find_batch_size=True on "
                         f"{launcher_world_size()} processes: the processes agree on an out-of-memory error at a "
                         "collective that the window's routing all-reduce would meet instead; use one or the other")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            bad("peak_tflops", "must be a positive number of TFLOPS, or None to look it up")
        if self.include_num_input_tokens_seen not in TOKEN_COUNTS:
            bad("include_num_input_tokens_seen", f"accepted: {', '.join(TOKEN_COUNTS)} (or a bool)")
        p += report_to_problems(self.report_to)
        if self.ddp_timeout <= 0:
            bad("ddp_timeout", "must be a positive number of seconds")
        p += self._surface_problems()
        for name, off in NOT_YET_SUPPORTED.items():
            if getattr(self, name) not in (off, "", [], {}):
                bad(name, "not yet supported by stoker; leave it unset")
        p += argument_problems(self)  # fsdp, fsdp_config, deepspeed
        p += self._package_problems()
        p += self._packing_problems()
        return p

    def _read_accelerator_config(self) -> list[str]:
        """accelerator_config as transformers reads it: None, a dict (its missing keys take the defaults), a JSON
        file's path (a str or a pathlib.Path) or transformers' AcceleratorConfig all become an AcceleratorConfig.
        Returns the problems."""
        value = self.accelerator_config
        if isinstance(value, AcceleratorConfig):
            return []
        if isinstance(value, os.PathLike):  # transformers opens any path it is given, a pathlib.Path as well
            value = os.fspath(value)
        if value is None:
            value = {}
        elif hasattr(value, "to_dict") and type(value).__name__ == "AcceleratorConfig":  # transformers' own
            value = value.to_dict()
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            return []  # not valid JSON: reported with the other JSON fields
        elif isinstance(value, str):
            try:
                with open(value, encoding="utf-8") as f:
                    value = json.load(f)
            except OSError as e:
                return [f"accelerator_config={value!r}: cannot read the JSON file ({e.strerror}); accepted: a dict, "
                        "a JSON string, a JSON file's path or an AcceleratorConfig"]
            except json.JSONDecodeError as e:
                return [f"accelerator_config={value!r}: the file is not valid JSON ({e.msg})"]
        if not isinstance(value, dict):
            return [f"accelerator_config={self.accelerator_config!r}: accepted: a dict, a JSON string, a JSON "
                    "file's path or an AcceleratorConfig"]
        unknown = [k for k in value if k not in ACCELERATOR_CONFIG_KEYS]
        if unknown:
            return [f"accelerator_config[{k!r}]: unknown key{suggest(k, ACCELERATOR_CONFIG_KEYS)}; accepted: "
                    f"{', '.join(ACCELERATOR_CONFIG_KEYS)}" for k in unknown]
        self.accelerator_config = AcceleratorConfig(**value)
        return []

    def _on_cuda(self) -> bool:
        import torch

        return torch.cuda.is_available() and not self.use_cpu

    def _packing_problems(self) -> list[str]:
        p = []
        if self.packing_length is not None and (not isinstance(self.packing_length, int) or self.packing_length < 2):
            p.append(f"packing_length={self.packing_length!r}: must be an integer >= 2, or unset")
        elif self.packing_length is not None and not self.packing:
            p.append(f"packing_length={self.packing_length!r}: is the length of packed rows; set packing=True too")
        if (self.packing or self.padding_free) and self.group_by_length:
            p.append(f"group_by_length=True with {'packing' if self.packing else 'padding_free'}=True: packed or "
                     "flattened rows leave nothing to group; use one or the other")
        if self.shared_prefix:
            p += [f"shared_prefix=True with {name}={getattr(self, name)!r}: {reason}; turn one off"
                  for name, reason in SHARED_PREFIX_CONFLICTS.items() if getattr(self, name)]
        if self.padding_free and self.auto_find_batch_size:
            p.append("padding_free=True with auto_find_batch_size=True: a flattened micro-batch is one row, which "
                     "cannot be halved; turn one off")
        return p

    def _package_problems(self) -> list[str]:
        """Settings whose optional package is not installed: said now, with the pip command, rather than as an
        ImportError when the feature is first used (after training, for the report)."""
        from importlib.util import find_spec

        wanted = []
        if self.training_report:
            wanted.append(("training_report", "matplotlib", "matplotlib"))
        if self.optim in OPTIMIZERS and OPTIMIZERS[self.optim].package:
            wanted.append(("optim", OPTIMIZERS[self.optim].package, OPTIMIZERS[self.optim].distribution))
        return [f"{name}={getattr(self, name)!r}: needs the {package} package, which is not installed "
                f"(pip install {pip})" for name, package, pip in wanted if find_spec(package) is None]

    def _surface_problems(self) -> list[str]:
        """Fields that transformers has and that ask for a value stoker cannot honour here."""
        p = []

        def bad(name, accepted):
            p.append(f"{name}={getattr(self, name)!r}: {accepted}")

        for name, choices in (("log_level", LOG_LEVELS), ("log_level_replica", LOG_LEVELS),
                              ("train_sampling_strategy", SAMPLING_STRATEGIES), ("hub_strategy", HUB_STRATEGIES)):
            if getattr(self, name) not in choices:
                bad(name, f"accepted: {', '.join(choices)}{suggest(getattr(self, name), choices)}")
        if self.group_by_length and self.train_sampling_strategy != "group_by_length":
            p.append(f"group_by_length=True and train_sampling_strategy={self.train_sampling_strategy!r}: "
                     "choose one sampler")
        if not 0 <= self.label_smoothing_factor < 1:
            bad("label_smoothing_factor", "must be in [0, 1)")
        if self.neftune_noise_alpha is not None and not self.neftune_noise_alpha > 0:
            bad("neftune_noise_alpha", "must be > 0, or None to add no noise")
        if self.torch_empty_cache_steps is not None and not (
                isinstance(self.torch_empty_cache_steps, int) and self.torch_empty_cache_steps >= 1):
            bad("torch_empty_cache_steps", "must be a positive integer, or None")
        if self.eval_delay < 0:
            bad("eval_delay", "must be >= 0")
        unknown = [x for x in self.include_for_metrics if x not in METRIC_INPUTS]
        if unknown:
            bad("include_for_metrics", f"unknown {unknown}; accepted: {', '.join(METRIC_INPUTS)}")
        for option in self.debug:
            if option not in DEBUG_OPTIONS:
                bad("debug", f"{option!r} is not offered (tpu_metrics_debug needs a TPU); accepted: "
                             f"{', '.join(DEBUG_OPTIONS)}")
        if self.enable_jit_checkpoint and not self.save_on_signal:
            p.append("enable_jit_checkpoint=True and save_on_signal=False: the checkpoint on SIGTERM is "
                     "save_on_signal; set it to True")
        if self.push_to_hub:
            bad("push_to_hub", "stoker does not push to the Hugging Face Hub (it never uses the network); "
                               "set it to False and upload output_dir yourself, e.g. with `hf upload`")
        if not self.use_liger_kernel and self.liger_kernel_config is not None:
            bad("liger_kernel_config", "needs use_liger_kernel=True")
        return p

    def _hardware_problems(self) -> list[str]:
        import torch

        p = []
        on_cuda = torch.cuda.is_available() and not self.use_cpu
        if self.fp16 and not on_cuda:
            p.append("fp16=True: float16 mixed precision needs a CUDA GPU (Accelerate would silently run float32 "
                     "on the CPU); use bf16=True on the CPU")
        # including_emulation=False: by default torch counts a GPU that emulates bfloat16 (V100, T4: no bf16
        # tensor cores, several times slower than fp16) as supporting it
        if self.bf16 and on_cuda and not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability()
            p.append(f"bf16=True: this GPU ({torch.cuda.get_device_name()}, compute capability {major}.{minor}) "
                     "has no bfloat16 support (torch would only emulate it, slowly); accepted: fp16=True on this "
                     "GPU, or bf16=True on an Ampere or newer GPU (compute capability 8.0 or more)")
        if self.tf32 and not (on_cuda and torch.cuda.get_device_capability()[0] >= 8):
            p.append("tf32=True: TF32 needs an NVIDIA Ampere or newer GPU; leave tf32 unset")
        p += float8_problems(self.fp8, self.bf16, torch.cuda.get_device_capability() if on_cuda else None)
        return p

    def _apply_gpu_defaults(self) -> str | None:
        """bf16 and tf32 where they were not given (None): on a CUDA GPU of compute capability 8.0 or more, with
        gpu_defaults, bf16 autocast (10-15x the matmul rate of float32 there; unless fp16 is given, or deepspeed,
        whose config decides its precision) and TF32; elsewhere bf16 False and tf32 left alone. Where bf16 and fp16
        are not given, a precision that a DeepSpeed config or accelerate launch sets (launch.launcher_precision)
        wins over the default, on any device, as transformers takes it. A bf16 or tf32 given, False included, is
        kept. Returns the notice the Trainer logs once, or None when nothing was decided here."""
        import torch

        asked_bf16, asked_tf32 = self.bf16 is not None, self.tf32 is not None
        # this process's GPU (torchrun's LOCAL_RANK), read before Accelerate sets the device
        ampere = (self.gpu_defaults and not self.use_cpu and torch.cuda.is_available()
                  and torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0"))
                                                       % torch.cuda.device_count())[0] >= 8)
        # what a DeepSpeed config or accelerate launch sets wins where the script set nothing: bf16 over a
        # DeepSpeed config's fp16 makes Accelerate raise, and Accelerator(mixed_precision=...) replaces the
        # launcher's; one it cannot run is refused by validation (distributed.accelerator.argument_problems)
        launcher = None if asked_bf16 or self.fp16 else launcher_precision(self.deepspeed)
        if launcher is not None and launcher[0] in LAUNCHER_PRECISIONS:
            self.bf16, self.fp16 = launcher[0] == "bf16", launcher[0] == "fp16"
        elif not asked_bf16:
            # True only where the GPU has bf16 in hardware (compute capability 8.0: A100, RTX 30xx and newer);
            # is_bf16_supported(including_emulation=False) says the same, from the same capability
            self.bf16 = bool(ampere and not self.fp16 and self.deepspeed in (None, "", {})
                             and torch.cuda.is_bf16_supported(including_emulation=False))
        if not asked_tf32 and ampere:
            self.tf32 = True
        if launcher is not None and launcher[0] in LAUNCHER_PRECISIONS:
            return (f"precision: {LAUNCHER_PRECISIONS[launcher[0]]}, as {launcher[1]} sets it and bf16 / fp16 were not "
                    f"given (it wins over stoker's GPU default)"
                    + (", with TF32 matmuls on this GPU as tf32 was not given" if not asked_tf32 and self.tf32 else ""))
        decided = [what for what, on in (("bf16 autocast", not asked_bf16 and self.bf16),
                                         ("TF32 matmuls", not asked_tf32 and self.tf32)) if on]
        if not decided:
            return None
        return (f"precision: {' and '.join(decided)} on this GPU, as bf16 / tf32 were not given (transformers would "
                "train in float32 here); gpu_defaults=False, or bf16=False / tf32=False, keeps float32")

    @property
    def gpu_default_notice(self) -> str | None:
        """The line the Trainer logs when gpu_defaults turned bf16 or tf32 on (None: nothing was decided)."""
        return self.__dict__.get("_gpu_default_notice")

    # ------------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        """Accelerate's name for the precision of the run: "bf16", "fp16" or "no"."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def warmup_for(self, max_steps: int) -> int:
        """Warm-up optimizer steps for a run of max_steps (warmup_steps < 1 and warmup_ratio are fractions)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        import math

        return math.ceil((self.warmup_steps or self.warmup_ratio) * max_steps)

    def optimizer_kwargs(self) -> dict[str, Any]:
        """optim_args 'key=value,...' as a dict of Python literals (non-literals stay strings)."""
        import ast

        out = {}
        if not self.optim_args:
            return out
        # split on commas outside parentheses, so that 'betas=(0.9,0.95)' stays one item
        for item in re.split(r",(?![^()]*\))", self.optim_args or ""):
            if "=" not in item:
                raise ValueError(f"{item!r} is not 'key=value'")
            key, value = (x.strip() for x in item.split("=", 1))
            try:
                out[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[key] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every field, with secrets masked as transformers masks them (checkpoints and logs never hold a token)
        and torch dtypes, also inside dicts, written as their names ("float32") as transformers writes them."""
        out = {f.name: _named_dtypes(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if isinstance(self.accelerator_config, AcceleratorConfig):
            out["accelerator_config"] = self.accelerator_config.to_dict()
        if self.parallelism_config is not None and not isinstance(self.parallelism_config, (dict, str)):
            out["parallelism_config"] = parallelism_sizes(self.parallelism_config)  # Accelerate's, as plain JSON
        for name in out:
            if name.endswith("_token") and out[name] is not None:
                out[name] = f"<{name.upper()}>"
        return out

    def to_json_string(self) -> str:
        """to_dict() as indented JSON with sorted keys (tokens masked)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """The fields as TensorBoard's hparams take them: bool, int, float, str (anything else as str)."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}

    # ------------------------------------------------------------------------------------------
    # the process view transformers' scripts read (rank, device, logging); Accelerate's PartialState knows it

    def _process(self):
        """Accelerate's process state, set up as the Trainer's Accelerator sets it up (it is made once per
        process: whichever comes first decides)."""
        from accelerate import PartialState

        return PartialState(cpu=wants_cpu(self.use_cpu) and not self.deepspeed)

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: stoker runs one device per process (no DataParallel), so 1, or 0 on the CPU."""
        import torch

        return int(torch.cuda.is_available() and not self.use_cpu)

    @property
    def train_batch_size(self) -> int:
        """Training rows per micro-batch on one process: per_device_train_batch_size (x n_gpu, which is 1 or 0
        here), as transformers computes it."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """Evaluation rows per batch on one process: per_device_eval_batch_size (x n_gpu, which is 1 or 0 here)."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def device(self):
        """The torch.device this process runs on, as Accelerate assigns it (the CPU with use_cpu)."""
        return self._process().device

    @property
    def world_size(self) -> int:
        """Processes in the run (1 without a launcher)."""
        return self._process().num_processes

    @property
    def process_index(self) -> int:
        """This process's global rank, 0 to world_size - 1."""
        return self._process().process_index

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine (0 on the machine's first process)."""
        return self._process().local_process_index

    @property
    def should_log(self) -> bool:
        """Whether this process logs at log_level (the others use log_level_replica)."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes the files only one process writes: the run's main process, or each
        machine's with save_on_each_node."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    @property
    def parallel_mode(self):
        """transformers' ParallelMode: DISTRIBUTED with more than one process, else NOT_PARALLEL."""
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    def get_process_log_level(self) -> int:
        """The logging level of this process: log_level on the process that logs, log_level_replica elsewhere;
        'passive' keeps the current level of transformers' logger."""
        import logging

        level = self.log_level if self.should_log else self.log_level_replica
        if level == "passive":
            from transformers.utils import logging as hf_logging

            return hf_logging.get_verbosity()
        return {"detail": 5}.get(level) or logging.getLevelName(level.upper())

    @property
    def ddp_timeout_delta(self):
        """ddp_timeout (seconds) as a datetime.timedelta, the process group's timeout."""
        from datetime import timedelta

        return timedelta(seconds=self.ddp_timeout)

    @property
    def place_model_on_device(self) -> bool | None:
        """None, as in transformers 5: Accelerate places the model (a subclass may override it for scripts that
        read it)."""
        return None

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up optimizer steps for a run of num_training_steps, as warmup_for (warmup_steps < 1 and
        warmup_ratio are fractions of it, rounded up)."""
        return self.warmup_for(num_training_steps)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Run the block on the main process (of the node, with local=True) first, the others after it: for
        dataset preprocessing that writes a cache the others then read."""
        state = self._process()
        with state.local_main_process_first() if local else state.main_process_first():
            yield

    # ------------------------------------------------------------------------------------------
    # transformers' grouped setters: each sets its fields, validates the result and returns the arguments

    def _update(self, **values) -> TrainingArguments:
        updated = replaced(self, **values)  # runs __post_init__: every problem reported at once
        self.__dict__.update(updated.__dict__)
        return self

    def set_training(self, learning_rate: float = 5e-5, batch_size: int = 8, weight_decay: float = 0,
                     num_epochs: float = 3, max_steps: int = -1, gradient_accumulation_steps: int = 1, seed: int = 42,
                     activation_checkpointing: bool = False, gradient_checkpointing: bool | None = None):
        """Set do_train and the training fields (batch_size is per_device_train_batch_size; gradient_checkpointing,
        when given, wins over activation_checkpointing and sets both), as transformers.
        Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        checkpointing = activation_checkpointing if gradient_checkpointing is None else gradient_checkpointing
        return self._update(do_train=True, learning_rate=learning_rate, per_device_train_batch_size=batch_size,
                            weight_decay=weight_decay, num_train_epochs=num_epochs, max_steps=max_steps,
                            gradient_accumulation_steps=gradient_accumulation_steps, seed=seed,
                            activation_checkpointing=checkpointing, gradient_checkpointing=checkpointing)

    def set_evaluate(self, strategy: str = "no", steps: int = 500, batch_size: int = 8,
                     accumulation_steps: int | None = None, delay: float | None = None, loss_only: bool = False):
        """Set the evaluation fields (eval_strategy, and do_eval unless it is "no"), as transformers.
        Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(eval_strategy=str(strategy), do_eval=str(strategy) != "no", eval_steps=steps,
                            per_device_eval_batch_size=batch_size, eval_accumulation_steps=accumulation_steps,
                            eval_delay=delay or 0, prediction_loss_only=loss_only)

    def set_testing(self, batch_size: int = 8, loss_only: bool = False):
        """Set do_predict, per_device_eval_batch_size and prediction_loss_only, as transformers.
        Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only)

    def set_save(self, strategy: str = "steps", steps: int = 500, total_limit: int | None = None,
                 on_each_node: bool = False):
        """Set the checkpoint fields (save_strategy, save_steps, save_total_limit, save_on_each_node), as
        transformers. Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(save_strategy=str(strategy), save_steps=steps, save_total_limit=total_limit,
                            save_on_each_node=on_each_node)

    def set_logging(self, strategy: str = "steps", steps: int = 500, report_to: str | list[str] = "none",
                    level: str = "passive", first_step: bool = False, nan_inf_filter: bool = False,
                    on_each_node: bool = False, replica_level: str = "passive"):
        """Set the logging fields (strategy, steps, report_to, log levels, first step, nan/inf filter), as
        transformers. Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(logging_strategy=str(strategy), logging_steps=steps, report_to=report_to, log_level=level,
                            logging_first_step=first_step, logging_nan_inf_filter=nan_inf_filter,
                            log_on_each_node=on_each_node, log_level_replica=replica_level)

    def set_push_to_hub(self, model_id: str, strategy: str = "every_save", token: str | None = None,
                        private_repo: bool | None = None, always_push: bool = False, revision: str | None = None):
        """transformers' setter for the Hub fields. It sets push_to_hub=True, which stoker refuses (it never uses
        the network), so it always raises ConfigError and leaves the arguments unchanged."""
        return self._update(push_to_hub=True, hub_model_id=model_id, hub_strategy=str(strategy), hub_token=token,
                            hub_private_repo=private_repo, hub_always_push=always_push, hub_revision=revision)

    def set_optimizer(self, name: str = "adamw_torch", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, args: str | None = None):
        """Set the optimizer fields (optim, learning_rate, weight_decay, Adam's betas and epsilon, optim_args), as
        transformers. Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(optim=str(name), learning_rate=learning_rate, weight_decay=weight_decay,
                            adam_beta1=beta1, adam_beta2=beta2, adam_epsilon=epsilon, optim_args=args)

    def set_lr_scheduler(self, name: str = "linear", num_epochs: float = 3.0, max_steps: int = -1,
                         warmup_steps: float = 0):
        """Set lr_scheduler_type, num_train_epochs, max_steps and warmup_steps (< 1: a fraction of the steps), as
        transformers. Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(lr_scheduler_type=str(name), num_train_epochs=num_epochs, max_steps=max_steps,
                            warmup_steps=warmup_steps)

    def set_dataloader(self, train_batch_size: int = 8, eval_batch_size: int = 8, drop_last: bool = False,
                       num_workers: int = 0, pin_memory: bool = True, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, multiprocessing_context: str | None = None,
                       in_order: bool = True, auto_find_batch_size: bool = False, ignore_data_skip: bool = False,
                       sampler_seed: int | None = None):
        """Set the batch sizes, the dataloader_* fields, auto_find_batch_size, ignore_data_skip and data_seed
        (sampler_seed, default seed), as transformers.
        Returns these arguments, validated as a whole (ConfigError leaves them unchanged)."""
        return self._update(
            per_device_train_batch_size=train_batch_size, per_device_eval_batch_size=eval_batch_size,
            dataloader_drop_last=drop_last, dataloader_num_workers=num_workers, dataloader_pin_memory=pin_memory,
            dataloader_persistent_workers=persistent_workers, dataloader_prefetch_factor=prefetch_factor,
            dataloader_multiprocessing_context=multiprocessing_context, dataloader_in_order=in_order,
            auto_find_batch_size=auto_find_batch_size, ignore_data_skip=ignore_data_skip,
            data_seed=self.seed if sampler_seed is None else sampler_seed)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingArguments:
        """Build from a dict (a YAML/JSON config); unknown keys are rejected with a suggestion."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ConfigError([f"{k}: unknown field{suggest(k, names)}" for k in unknown], "TrainingArguments")
        return cls(**values)


# The group each field's --help line appears under, for TrainingArguments and its subclasses (argparse metadata
# cannot carry it; tests check that every field has exactly one, and that the class's `# --- ... ---` banners are
# these groups in this order).
FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "output": ("output_dir", "overwrite_output_dir", "run_name", "do_train", "do_eval", "do_predict"),
    "duration": ("num_train_epochs", "max_steps"),
    "batch": ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
        "auto_find_batch_size", "average_tokens_across_devices", "moe_aux_loss_scope"),
    "optimizer": ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
        "optim", "optim_args", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
        "optim_target_modules", "label_smoothing_factor", "neftune_noise_alpha"),
    "precision": ("bf16", "fp16", "tf32", "gpu_defaults", "fp8", "bf16_full_eval", "fp16_full_eval"),
    "memory": ("gradient_checkpointing", "gradient_checkpointing_kwargs", "torch_compile",
        "torch_compile_backend", "torch_compile_mode", "compile_scope", "chunked_loss", "shared_prefix",
        "activation_checkpointing", "activation_checkpointing_kwargs", "use_liger_kernel", "liger_kernel_config",
        "use_cache", "torch_empty_cache_steps"),
    "data": ("dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_drop_last", "remove_unused_columns", "label_names",
        "group_by_length", "length_column_name", "seed", "data_seed", "dataloader_multiprocessing_context",
        "dataloader_in_order", "train_sampling_strategy", "ignore_data_skip", "full_determinism", "packing",
        "packing_length", "padding_free"),
    "logging": ("logging_dir", "logging_strategy", "logging_steps", "logging_first_step", "report_to",
        "disable_tqdm", "include_num_input_tokens_seen", "peak_tflops", "training_report", "log_level",
        "log_level_replica", "log_on_each_node", "logging_nan_inf_filter", "skip_memory_metrics", "debug",
        "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
    "evaluation": ("eval_strategy", "eval_steps", "eval_on_start", "eval_accumulation_steps",
        "metric_for_best_model", "greater_is_better", "eval_delay", "prediction_loss_only",
        "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics", "batch_eval_metrics"),
    "saving": ("save_strategy", "save_steps", "save_total_limit", "load_best_model_at_end",
        "resume_from_checkpoint", "save_only_model", "async_save", "save_on_each_node",
        "restore_callback_states_from_checkpoint"),
    "faults": ("nonfinite_policy", "max_nonfinite_steps", "spike_rollback", "spike_factor", "spike_window",
        "spike_snapshot_steps", "max_rollbacks", "save_on_signal", "resume_mismatch", "enable_jit_checkpoint"),
    "distributed": ("use_cpu", "accelerator_config", "fsdp", "fsdp_config", "deepspeed", "ddp_backend",
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_timeout",
        "ddp_static_graph", "parallelism_config", "local_rank"),
    "hub": ("push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
        "hub_revision"),
    # Seq2SeqTrainingArguments (stoker.seq2seq)
    "generation": ("sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams",
        "generation_config"),
}
GROUP_OF = {name: group for group, names in FIELD_GROUPS.items() for name in names}


# ---------------------------------------------------------------------------------------------------
# parsing: CLI flags, a YAML/JSON file, and the file overridden by flags

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def load_config_file(path: str) -> dict[str, Any]:
    """The mapping in a YAML or JSON file; a ConfigError names the file (and the line of a syntax error)."""
    shown = f"config file {path!r}"
    if not os.path.isfile(path):
        raise ConfigError([f"{shown}: {'is a folder' if os.path.isdir(path) else 'no such file'}; accepted: a "
                           f"{'/'.join(CONFIG_SUFFIXES)} file of field: value lines"], "configuration")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except OSError as e:
        raise ConfigError([f"{shown}: cannot be read ({e.strerror})"], "configuration") from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{shown}: not UTF-8 text ({e.reason} at byte {e.start})"], "configuration") from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"{shown} line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})"],
                          "configuration") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = " ".join(filter(None, (getattr(e, "problem", None), getattr(e, "context", None)))) or str(e)
        raise ConfigError([f"{shown}{where}: not valid YAML ({why})"], "configuration") from None
    if values is None:  # an empty file
        return {}
    if not isinstance(values, dict):
        raise ConfigError([f"{shown}: must hold a mapping of field: value, got {type(values).__name__}"],
                          "configuration")
    return values


def _named_dtypes(value):
    """`value` with every torch.dtype in it (itself, or in a dict or list) replaced by its name."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # torch is not imported here
        return str(value).removeprefix("torch.")
    if isinstance(value, dict):
        return {k: _named_dtypes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_named_dtypes(v) for v in value)
    return value


def _to_flags(values: dict[str, Any]) -> list[str]:
    """A config mapping as command-line flags, so that argparse converts and checks types the same way for a
    file and for flags (YAML reads '1e-4' as a string), and flags given later override the file."""
    flags = []
    for key, value in values.items():
        if value is None:
            continue
        flags.append(f"--{key}")
        if isinstance(value, dict):
            flags.append(json.dumps(value))
        elif isinstance(value, (list, tuple)):
            flags += [str(v) for v in value]
        else:
            flags.append(str(value))
    return flags


_BAD = object()  # stands for a value argparse could not convert


class CollectingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError where argparse would print and exit, and that records every
    value it cannot convert in `bad_values` (field, value, what is accepted) where argparse stops at the first,
    so that they are reported together with every other problem."""

    def __init__(self, *args, **kwargs):
        self.bad_values = []
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError([re.sub(r"^argument (--\w+)(/--[\w-]+)*: ", r"\1: ", message)], "command line")

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError:
            self.bad_values.append((action.dest, arg_string, _accepted_values(action)))
            return _BAD

    def _check_value(self, action, value):
        if value is _BAD:
            return
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            choices = [str(c) for c in action.choices]
            self.bad_values.append((action.dest, value, f"accepted: {', '.join(choices)}{suggest(value, choices)}"))

    def flag_problems(self) -> list[str]:
        return [f"--{dest}={value!r}: {accepted}" for dest, value, accepted in self.bad_values]


def _accepted_values(action) -> str:
    if action.choices is not None:
        return f"accepted: {', '.join(map(str, action.choices))}"
    if hasattr(action.type, "accepted"):  # a type function that says what it takes
        return action.type.accepted
    kind = getattr(action.type, "__name__", "")
    return {"int": "must be a whole number", "float": "must be a number (e.g. 3e-4)",
            "string_to_bool": "must be true or false (also yes/no, 1/0)"}.get(kind, f"must be a {kind or 'value'}")


def _parser_class():
    """transformers' HfArgumentParser, taught to put each field under its group (FIELD_GROUPS) in --help."""
    import copy
    import typing

    from transformers import HfArgumentParser

    class Parser(CollectingParser, HfArgumentParser):
        def _add_dataclass_arguments(self, dtype):
            hints = typing.get_type_hints(dtype)
            groups = {}
            default_group = getattr(dtype, "_argument_group_name", dtype.__name__)
            for f in dataclasses.fields(dtype):
                if not f.init:
                    continue
                name = GROUP_OF.get(f.name, default_group) if issubclass(dtype, TrainingArguments) else default_group
                if name not in groups:
                    groups[name] = self.add_argument_group(name)
                plain = copy.copy(f)
                plain.type = hints[f.name]
                self._parse_dataclass_field(groups[name], plain)

    return Parser


def _shape_problems(types: tuple[type, ...], values: dict[str, Any], source: str) -> list[str]:
    """A list or a mapping in a config file for a field that takes one value (argparse would read a list as
    several values, and a mapping as a string)."""
    import types as pytypes
    import typing

    hints = {name: hint for t in types for name, hint in typing.get_type_hints(t).items()}
    p = []
    for key, value in values.items():
        hint = hints[key]
        union = typing.get_origin(hint) in (typing.Union, pytypes.UnionType)
        kinds = {typing.get_origin(h) or h for h in (typing.get_args(hint) if union else (hint,))}
        if isinstance(value, dict) and dict not in kinds:
            p.append(f"{source}: {key}={value!r}: must be a single value, not a mapping")
        elif isinstance(value, (list, tuple)) and list not in kinds:
            p.append(f"{source}: {key}={value!r}: must be a single value, not a list")
    return p


def parse_config(types: tuple[type, ...], argv: list[str] | None = None, defaults: dict[str, Any] | None = None,
                 prog: str | None = None, check=None):
    """Parse `[CONFIG.yaml|json] [--field value ...]` into one instance of each dataclass in `types`.

    Precedence: flags > config file > `defaults` > the dataclasses' own defaults. Unknown keys and flags are
    rejected with the closest valid name. `check`, if given, is called with {type: instance} of the dataclasses
    that could be built and returns more problems (e.g. files that do not exist). Every problem (the file's
    syntax, values of the wrong type, unknown names, each dataclass's validation, `check`'s) is reported in
    one ConfigError, each naming where it comes from: the config file or the flag.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    names = [f.name for t in types for f in dataclasses.fields(t) if f.init]
    problems, file_values, source = [], {}, None
    if argv and argv[0].endswith(CONFIG_SUFFIXES):
        source = argv.pop(0)
        try:
            file_values = load_config_file(source)
        except ConfigError as e:
            problems += e.problems
    problems += [f"{source}: {k}: unknown field{suggest(k, names)}" for k in file_values if k not in names]
    file_values = {k: v for k, v in file_values.items() if k in names}
    shapes = _shape_problems(types, file_values, source)
    problems += shapes
    file_values = {k: v for k, v in file_values.items() if not any(p.startswith(f"{source}: {k}=") for p in shapes)}
    # allow_abbrev=False: '--learning_rat' must be an error (as the same key in a file is), not a prefix
    parser = _parser_class()(types, prog=prog, allow_abbrev=False)
    # the layers are parsed in turn into one namespace, each overriding the one before, so that a problem
    # names the layer it comes from: the config file, or the flags
    namespace, bad_fields, origin = argparse.Namespace(), set(), dict.fromkeys(file_values, source)
    for where, flags in ((None, _to_flags(defaults or {})), (source, _to_flags(file_values)), (_FLAGS, argv)):
        parser.bad_values = []
        try:
            namespace, rest = parser.parse_known_args(flags, namespace)
        except ConfigError as e:  # argparse's own errors name the flag already
            problems += [p if where == _FLAGS else _located(where, p) for p in e.problems]
            rest = []
        bad_fields.update(dest for dest, _, _ in parser.bad_values)
        problems += [_located(where, f"{dest}={value!r}: {accepted}") for dest, value, accepted in parser.bad_values]
    actions = parser._option_string_actions
    origin.update({actions[f.split("=")[0]].dest: _FLAGS for f in argv if f.split("=")[0] in actions})
    problems += _unknown_flags(rest, names)
    for dest in bad_fields:  # the dataclass default stands in, so that the other fields are still checked
        if hasattr(namespace, dest):
            delattr(namespace, dest)

    def attributed(found: list[str]) -> list[str]:
        """`found` less problems about fields already reported as unconvertible, each naming its origin."""
        out = []
        for p in found:
            if not any(re.search(rf"\b{re.escape(f)}\b", p) for f in bad_fields):
                m = re.match(r"(\w+)=", p)
                out.append(_located(origin.get(m.group(1)) if m else None, p))
        return out

    built = {}
    for t in types:
        keys = {f.name for f in dataclasses.fields(t) if f.init}
        try:
            built[t] = t(**{k: v for k, v in vars(namespace).items() if k in keys})
        except ConfigError as e:
            problems += attributed(e.problems)
    if check is not None:
        problems += attributed(check(built))
    if problems:
        raise ConfigError(problems, "configuration")
    return tuple(built[t] for t in types)


_FLAGS = "--"


def _located(where: str | None, problem: str) -> str:
    """`problem` ('field=value: ...') as coming from `where`: the flags, a config file, or unsaid (a default)."""
    if where == _FLAGS:
        return f"--{problem}"
    return f"{where}: {problem}" if where else problem


def _unknown_flags(rest: list[str], names: list[str]) -> list[str]:
    problems, after_flag = [], False
    for item in rest:
        if item.startswith("--"):
            flag = item[2:].split("=")[0].replace("-", "_")
            problems.append(f"--{flag}: unknown flag{suggest(flag, names)}")
            after_flag = True
        elif not after_flag:  # a value right after an unknown flag belongs to it
            problems.append(f"{item!r}: unexpected value (config files must come first and end in "
                            f"{', '.join(CONFIG_SUFFIXES)})")
    return problems


def replaced(args: TrainingArguments, **values) -> TrainingArguments:
    """dataclasses.replace, with a data_seed that followed seed following the new one (not kept as it was)."""
    if args.__dict__.get("_data_seed_is_seed") and "data_seed" not in values:
        values["data_seed"] = None
    return dataclasses.replace(args, **values)
