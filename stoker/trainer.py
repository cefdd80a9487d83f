"""The Trainer: one managed training loop over an accelerate.Accelerator, steered by callbacks.

The loop (`Trainer._train_loop`) reads top to bottom: fetch a window of micro-batches, count the window's
target tokens, forward/backward each micro-batch with the loss normalised over the whole window, clip,
step, log, evaluate, save, stop. Every distributed mechanic (device placement, DDP, mixed precision,
gradient sync) is Accelerate's; the Trainer only calls its API.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from . import diagnostics
from .arguments import TrainingArguments
from .callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    JsonlLoggerCallback,
    ProgressCallback,
    TensorBoardCallback,
    TrainerControl,
    TrainerState,
    callback_states,
    restore_callback_states,
)
from .data import (
    ColumnFilter,
    PaddingCollator,
    build_dataloader,
    count_input_tokens,
    count_targets,
    forward_columns,
)
from .diagnostics import DATA_WAIT_WARNING, Stopwatch, data_wait_advice
from .distributed import (
    MODEL_SHARDS,
    check_sharding_active,
    check_world_size,
    finish_deepspeed_config,
    full_tensor,
    gather_full_model,
    gather_trainable_zero3,
    gathers_full_model,
    is_deepspeed,
    is_sharded,
    is_zero_checkpoint,
    load_shards,
    load_zero3_weights,
    load_zero_partitions,
    model_class_name,
    parameters_finite,
    save_shards,
    save_zero_partition,
    sharding_plugins,
    wants_cpu,
    zero_stage,
)
from .errors import (
    ConfigError,
    NonFiniteError,
    TrainingPreempted,
    exit_with_code_after_preemption,
)
from .log import logger
from .lora import trainable_parameters
from .loss import chunked_causal_lm_loss, chunked_loss_problems, model_family, output_head, smoothed_label_loss
from .outputs import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainOutput, speed_metrics
from .plan import start_of_training_line
from .trainer_api import TrainerAPI


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well


def window_sizes(num_batches: int, accumulation: int) -> list[int]:
    """Micro-batches in each optimizer step of an epoch of num_batches: full windows, then a short one."""
    full, rest = divmod(num_batches, accumulation)
    return [accumulation] * full + ([rest] if rest else [])


def _accepts_num_items(model) -> bool:
    """Whether forward can be given num_items_in_batch at all (by name or through **kwargs); a model that says
    it does not (transformers' accepts_loss_kwargs=False) is believed."""
    if getattr(model, "accepts_loss_kwargs", None) is False:
        return False
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind == p.VAR_KEYWORD for p in params)


def _label_arguments(model) -> list[str]:
    from transformers.utils import find_labels

    return find_labels(type(model))


def _unwrap_peft(model):
    return model.get_base_model() if ckpt.is_peft_model(model) else model


class Trainer(TrainerAPI):
    def __init__(
        self,
        # transformers.Trainer's parameters in its order (a positional call means the same), then stoker's
        model: torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple[type, dict] | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config=None,
    ):
        self.args = args if args is not None else TrainingArguments()
        self._memory = None  # transformers' TrainerMemoryTracker, with skip_memory_metrics=False
        memory = self._memory_tracker()
        if memory is not None:  # its first stage, "init", is reported with the first train/eval/test metrics
            memory.start()
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise ConfigError(["model: pass a model, or model_init (a function returning a fresh model)"],
                                  "Trainer")
            set_seed(self.args.seed)  # as transformers: the model's initialisation follows the seed
            model = self.call_model_init()
        self._peft_config = peft_config
        if peft_config is not None and ckpt.is_peft_model(model):
            raise ConfigError(["peft_config: the model is already a PeftModel; pass one or the other"], "Trainer")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.compute_metrics = compute_metrics
        self.compute_loss_func = compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.processing_class = processing_class
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self._given_collator = data_collator
        model = self._set_up_model(model)
        if self.args.packing or self.args.padding_free:  # packs the train set once and picks the collator
            from .packing import packed_train_set

            self.train_dataset, self._given_collator = packed_train_set(
                self.args, model, self.train_dataset, data_collator, self._pad_token_id(), self._forward_kwargs)
            self._set_collator(_unwrap_peft(model))
        self._check_inputs(model, optimizers)

        self.accelerator = self._build_accelerator(model, optimizers)
        self._apply_precision_switches()
        self._set_log_levels()
        self._check_save_on_each_node()
        self._enable_gradient_checkpointing(model)
        self.model = model
        self.model_wrapped = model  # the prepared (DDP/compiled) model once training starts
        self.current_flos = 0  # FLOPs since the last store_flos (transformers' estimate)
        self.is_in_train = False
        self._ignore_keys_for_eval = None
        self._wrapped_in_place = False  # by a train() call that cannot be repeated (DeepSpeed, FSDP1)
        self.optimizer, self.lr_scheduler = optimizers
        self._given_optimizers = optimizers  # built anew by each train() call unless given here
        self._eval_batch_size = self.args.per_device_eval_batch_size  # halved on OOM (auto_find_batch_size)

        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        defaults = [DefaultFlowCallback(), ProgressCallback(), JsonlLoggerCallback()]
        if "tensorboard" in self.args.report_to:
            defaults.append(TensorBoardCallback())
        if self.args.training_report:
            from .report import ReportCallback

            defaults.append(ReportCallback())
        self.callback_handler = CallbackHandler(defaults + list(callbacks or []))
        self._fire("on_init_end")
        if memory is not None:
            memory.stop_and_update_metrics()

    # ------------------------------------------------------------------------------------------
    # set-up

    def _set_up_model(self, model):
        """What depends on the model (its loss convention, forward's columns, LoRA, debug hooks); run again for
        each fresh model from model_init. Returns the model to train (the peft model with peft_config)."""
        a = self.args
        if self._peft_config is not None:
            from .lora import wrap

            model = wrap(model, self._peft_config, a.gradient_checkpointing)
        base = _unwrap_peft(model)
        if a.use_liger_kernel:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=base, **(a.liger_kernel_config or {}))
        if "underflow_overflow" in a.debug:
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(base)
        self._is_transformers = hasattr(base, "config")
        self._family = model_family(model) if isinstance(model, torch.nn.Module) else "other"
        # a causal LM's loss skips each row's first label, which the item count must skip too. Known from
        # transformers' model mappings; for any other model with one label per token, None until a probe of the
        # first batch (_probe_shift) tells
        self._causal = (True if self._family == "causal_lm" else
                        None if self._family == "other" and self.compute_loss_func is None else False)
        # whether forward divides its summed loss by a `num_items_in_batch` it is given: decided by a probe on the
        # first batch (_probe_num_items), since many models accept the argument and ignore it
        self._honours_num_items = None if isinstance(model, torch.nn.Module) and _accepts_num_items(base) else False
        # as transformers: the forward arguments named like labels (start_positions and end_positions for
        # question answering)
        self.label_names = a.label_names or (_label_arguments(base) if self._is_transformers else None) or ["labels"]
        # a KV cache is wasted memory in a loss forward, and while one exists transformers ignores the
        # position_ids of packed rows (stoker.packing) and lets their sequences attend to each other
        self._forward_kwargs = {"use_cache": a.use_cache} if "use_cache" in forward_columns(base) else {}
        self._chunked_head = output_head(model) if a.chunked_loss else None
        self._logits_wanted = False  # set by evaluation: whether chunked_loss must still compute logits
        self._set_collator(base)
        return model

    def _set_collator(self, base) -> None:
        self.data_collator = self._given_collator or PaddingCollator(self._pad_token_id())
        if self.args.remove_unused_columns and hasattr(base, "config"):
            self.data_collator = ColumnFilter(self.data_collator, forward_columns(base) | set(self.label_names))

    def _set_log_levels(self) -> None:
        """log_level / log_level_replica, as transformers sets them: the 'stoker' and 'transformers' loggers."""
        a = self.args
        if (a.log_level if a.should_log else a.log_level_replica) == "passive":
            return
        from transformers.utils import logging as hf_logging

        level = a.get_process_log_level()
        logger.setLevel(level)
        hf_logging.set_verbosity(level)

    def _check_save_on_each_node(self) -> None:
        acc = self.accelerator
        nodes = acc.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        if self.args.save_on_each_node and nodes > 1:
            raise ConfigError([f"save_on_each_node=True: this run has {nodes} nodes, and stoker commits each "
                               "checkpoint once, from the main process, into an output_dir that every node must "
                               "see (a shared disk); set it to False"], "Trainer inputs")

    def _check_inputs(self, model, optimizers) -> None:
        """Problems that need the model and data as well as the arguments, reported together."""
        a, p = self.args, []
        needs_eval = a.eval_strategy != "no" or a.eval_on_start or a.load_best_model_at_end
        if needs_eval and self.eval_dataset is None:
            p.append(f"eval_strategy={a.eval_strategy!r}"
                     + (", eval_on_start=True" if a.eval_on_start else "")
                     + ": evaluation needs an eval_dataset (pass one, or set eval_strategy='no')")
        for name, ds in self._datasets():
            if hasattr(ds, "__len__") and len(ds) == 0:
                p.append(f"{name}: is empty (0 rows)")
        ds = self.train_dataset
        if ds is not None and not hasattr(ds, "__len__"):
            if a.max_steps <= 0:
                p.append("max_steps=-1: a train_dataset without a length (an IterableDataset) needs max_steps > 0")
            if a.group_by_length:
                p.append("group_by_length=True: needs a train_dataset with a length")
        if not isinstance(model, torch.nn.Module):
            p.append(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if a.gradient_checkpointing and isinstance(model, torch.nn.Module) and not hasattr(
                model, "gradient_checkpointing_enable"):
            p.append(f"gradient_checkpointing=True: {type(model).__name__} has no gradient_checkpointing_enable(); "
                     "implement it (e.g. with torch.utils.checkpoint) or turn gradient checkpointing off")
        if optimizers[1] is not None and optimizers[0] is None:
            p.append("optimizers: a scheduler was given without its optimizer")
        if a.chunked_loss and isinstance(model, torch.nn.Module):
            p += chunked_loss_problems(model)
            if self.compute_loss_func is not None:
                p.append("chunked_loss=True: replaces the model's own loss and cannot feed compute_loss_func, "
                         "which needs the logits; use one or the other")
        if getattr(model, "hf_quantizer", None) is not None and not ckpt.is_peft_model(model):
            p.append("model: it is loaded in 4 or 8 bits, whose weights cannot be trained; pass peft_config "
                     "(LoRA) to train an adapter on it (QLoRA)")
        if isinstance(model, torch.nn.Module):
            for name, ds in self._datasets():
                p += self._probe_rows(model, name, ds)
        if p:
            raise ConfigError(p, "Trainer inputs")

    def _datasets(self) -> list[tuple[str, Any]]:
        """(name, dataset) of the train dataset and every eval dataset (a dict of them as transformers takes)."""
        found = [("train_dataset", self.train_dataset)]
        if isinstance(self.eval_dataset, Mapping):
            found += [(f"eval_dataset[{k!r}]", ds) for k, ds in self.eval_dataset.items()]
        else:
            found.append(("eval_dataset", self.eval_dataset))
        return [(name, ds) for name, ds in found if ds is not None]

    def _probe_rows(self, model, name: str, ds) -> list[str]:
        """Collate the first rows of a dataset and check them against the model, so that a missing column,
        a wrong label dtype or a collator that returns non-tensors fails here rather than mid-run."""
        if isinstance(ds, torch.utils.data.IterableDataset):
            rows = list(itertools.islice(iter(ds), 2))
        elif hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
            rows = [ds[i] for i in range(min(len(ds), 2))]
        else:
            return []
        if not rows:
            return [] if hasattr(ds, "__len__") else [f"{name}: yields no rows"]  # an empty one: reported above
        try:
            batch = self.data_collator(rows)
        except Exception as e:
            return [f"{name}: the data collator failed on its first rows: {type(e).__name__}: {e}"]
        if not isinstance(batch, Mapping):
            return [f"{name}: the data collator returned {type(batch).__name__}; it must return a dict (a Mapping) "
                    "of tensors"]
        p = []
        loose = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor))
        if loose:
            p.append(f"{name}: the data collator returned non-tensor values for {loose}")
        columns = sorted(rows[0]) if isinstance(rows[0], Mapping) else []
        forward = inspect.signature(_unwrap_peft(model).forward).parameters.values()
        if self._is_transformers:
            accepted = {q.name for q in forward}
            if "input_ids" in accepted and "input_ids" not in batch and "inputs_embeds" not in batch:
                p.append(f"{name}: rows have columns {columns}; {type(model).__name__} needs 'input_ids'")
            if (name == "train_dataset" and set(self.label_names) <= accepted and self.compute_loss_func is None
                    and not any(k in batch for k in self.label_names)):
                p.append(f"{name}: rows have columns {columns}; {type(model).__name__} computes its loss from "
                         f"{self.label_names} (a 'label' or 'label_ids' column is renamed to 'labels'), which the "
                         "batches lack")
        elif self.compute_loss_func is None:
            required = [q.name for q in forward if q.default is q.empty and q.kind in (q.POSITIONAL_OR_KEYWORD,
                                                                                     q.KEYWORD_ONLY)]
            missing = [r for r in required if r not in batch]
            if missing:
                p.append(f"{name}: rows have columns {columns}; {type(model).__name__}.forward needs {missing}")
        labels = batch.get(self.label_names[0])
        if self._family in ("causal_lm", "token") and isinstance(labels, torch.Tensor):
            kind = type(_unwrap_peft(model)).__name__
            if labels.is_floating_point():
                p.append(f"{name}: {self.label_names[0]} has dtype {labels.dtype}; {kind} needs integer "
                         "token ids (-100 for ignored positions)")
            ids = batch.get("input_ids")
            if isinstance(ids, torch.Tensor) and labels.shape != ids.shape and "shift_labels" not in batch:
                p.append(f"{name}: {self.label_names[0]} has shape {list(labels.shape)} but input_ids has "
                         f"{list(ids.shape)}; {kind} needs one label per token")
        return p

    def _build_accelerator(self, model, optimizers=(None, None)):
        from datetime import timedelta

        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, TorchDynamoPlugin

        a = self.args
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
        # dispatch_batches=False: every process reads an IterableDataset itself and keeps its share of each global
        # batch (Accelerate's default for one has the main process read and concatenate whole batches, which
        # fails on rows of different lengths); map-style datasets are read so either way
        config = {"use_seedable_sampler": True, "dispatch_batches": False, **(a.accelerator_config or {})}
        sharding = sharding_plugins(a, model, optimizers)  # {}, an FSDP or a DeepSpeed plugin; refuses what
        # cannot run here
        deepspeed = "deepspeed_plugin" in sharding
        # under torchrun without a GPU: gloo, not N lone processes (Accelerate's cpu flag, which would also turn
        # DeepSpeed off: DeepSpeed gets the gloo backend asked for instead)
        cpu = wants_cpu(a.use_cpu)
        backend = a.ddp_backend or ("gloo" if deepspeed and cpu else None)
        accelerator = Accelerator(
            mixed_precision=a.mixed_precision,
            cpu=cpu and not deepspeed,
            # accumulation is done by the loop (token-exact), so Accelerate must not rescale the loss
            gradient_accumulation_steps=1,
            dataloader_config=DataLoaderConfiguration(data_seed=a.data_seed, **config),
            kwargs_handlers=[DistributedDataParallelKwargs(**ddp),
                             InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=a.ddp_timeout))],
            dynamo_plugin=TorchDynamoPlugin(backend=a.torch_compile_backend, mode=a.torch_compile_mode)
            if a.torch_compile else None,
            step_scheduler_with_optimizer=False,
            **sharding,
        )
        check_world_size(accelerator.num_processes)
        check_sharding_active(a, accelerator.distributed_type)
        return accelerator

    def _apply_precision_switches(self) -> None:
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = self.args.tf32
            torch.backends.cudnn.allow_tf32 = self.args.tf32

    def _enable_gradient_checkpointing(self, model) -> None:
        if not self.args.gradient_checkpointing:
            return
        kwargs = {"use_reentrant": False, **(self.args.gradient_checkpointing_kwargs or {})}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        config = getattr(_unwrap_peft(model), "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # a KV cache is useless in training and conflicts with recomputation

    def _pad_token_id(self) -> int:
        pad = getattr(self.processing_class, "pad_token_id", None)
        return pad if pad is not None else 0

    def add_callback(self, callback) -> None:
        self.callback_handler.add(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop(callback)

    def _fire(self, event: str, **kwargs) -> None:
        self.control = self.callback_handler.fire(
            event, self.args, self.state, self.control, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, processing_class=self.processing_class, **kwargs)

    # ------------------------------------------------------------------------------------------
    # loss

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The micro-batch's share of the window loss: sum of its item losses / num_items_in_batch.

        A model whose forward divides by a num_items_in_batch it is given (as found by _probe_num_items)
        receives it; any other returns a mean over its own items, which is rescaled by local items / window
        items, so that B x A micro-batches give exactly the update of one batch of B*A.
        With chunked_loss, a causal LM's loss comes from its hidden states (stoker.loss) unless the caller
        needs the logits (an evaluation whose metrics want predictions).
        """
        inputs = {**inputs, **self._forward_kwargs}
        labels = inputs.get(self.label_names[0])
        if self._chunked_head is not None and labels is not None and not (return_outputs and self._logits_wanted):
            del inputs[self.label_names[0]]
            loss, outputs = chunked_causal_lm_loss(model, self._chunked_head, inputs, labels, num_items_in_batch)
        elif self.compute_loss_func is not None:
            labels = inputs.pop(self.label_names[0], None)
            outputs = model(**inputs)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif self.args.label_smoothing_factor and labels is not None and not labels.is_floating_point():
            items = num_items_in_batch if num_items_in_batch is not None else count_targets(
                inputs, self.label_names[0], self._causal)
            del inputs[self.label_names[0]]
            base = _unwrap_peft(self.accelerator.unwrap_model(model))
            if "decoder_input_ids" not in inputs and hasattr(base, "prepare_decoder_input_ids_from_labels"):
                inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=labels)
            outputs = model(**inputs)
            loss = smoothed_label_loss(_logits_of(outputs), labels, self.args.label_smoothing_factor,
                                       self._causal, items)
        elif num_items_in_batch is not None and self._divides_by_num_items(model, inputs):
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            loss = self._loss_of(outputs)
        else:
            outputs = model(**inputs)
            loss = self._loss_of(outputs)
            if num_items_in_batch is not None:
                local = count_targets(inputs, self.label_names[0], self._causal)
                loss = loss * (local / num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _divides_by_num_items(self, model, inputs: dict) -> bool:
        if self._honours_num_items is None and self.accelerator.num_processes == 1:  # compute_loss called alone
            self._decide_loss_family(model, inputs)
        # still None: a batch without targets, whose loss only a model dividing by the count makes 0, not NaN
        return self._honours_num_items is not False

    def _decide_loss_family(self, model, batch: dict) -> None:
        """Settle what is still unknown of how the model's loss is normalised (self._causal for a model of no
        known family, self._honours_num_items) from a batch with labels. Called by every process at the same
        point (a window's start, an evaluation batch), since the probes' forwards may hold collectives (DDP's
        buffer broadcast, FSDP's gathers) and the verdicts are shared: a process whose batch cannot tell
        follows the others."""
        acc = self.accelerator

        def shared(verdict: bool | None) -> bool | None:
            votes = torch.tensor([verdict is True, verdict is False], dtype=torch.float32, device=acc.device)
            if acc.num_processes > 1:
                votes = acc.reduce(votes, reduction="sum")
            return False if votes[1] > 0 else True if votes[0] > 0 else None

        if self._causal is None:
            labels, ids = batch.get(self.label_names[0]), batch.get("input_ids")
            if isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor) and labels.shape == ids.shape and (
                    labels.dim() == 2 and not labels.is_floating_point()):
                self._causal = shared(self._probe_shift(model, batch, labels))
            else:
                self._causal = False  # not one integer label per input token: nothing to shift
        if self._honours_num_items is None and self.compute_loss_func is None and self._chunked_head is None:
            self._honours_num_items = shared(self._probe_num_items(model, {**batch, **self._forward_kwargs}))

    def _probe_shift(self, model, batch: dict, labels: torch.Tensor) -> bool | None:
        """Whether the model shifts its labels inside (token t predicting label t+1, as a causal LM does): its
        loss does not change when the first label of every row is ignored. None when the batch cannot tell (no
        row's first label is a target, or no scalar loss)."""
        if not (labels[:, 0] != -100).any():
            return None
        cut = labels.clone()
        cut[:, 0] = -100
        inputs = {**batch, **self._forward_kwargs}
        with self._probe_forwards(model) as forward:
            whole = self._loss_or_none(forward(**inputs))
            first_ignored = self._loss_or_none(forward(**{**inputs, self.label_names[0]: cut}))
        if whole is None or first_ignored is None or whole.dim() != 0 or not torch.isfinite(whole):
            return None
        return bool(torch.isclose(whole.double(), first_ignored.double(), rtol=1e-6, atol=0))

    def _probe_num_items(self, model, inputs: dict) -> bool | None:
        """Whether the model's loss is its summed item losses divided by num_items_in_batch: two forwards of one
        batch, with counts 1 and 2. transformers 5 heads that take **kwargs but return a mean anyway (BERT's
        masked-LM and token-classification heads, T5) fail it, as does a model that raises on the argument.
        None when this batch cannot tell (no targets: both losses 0 or NaN)."""
        device = self.accelerator.device
        try:
            with self._probe_forwards(model) as forward:
                one, two = (self._loss_of(forward(**inputs, num_items_in_batch=torch.tensor(n, device=device)))
                            for n in (1, 2))
        except TypeError:
            return False
        if not torch.isfinite(one) or one == 0:
            return None
        return bool(torch.isclose(one.double(), 2 * two.double(), rtol=1e-4, atol=0))

    @contextlib.contextmanager
    def _probe_forwards(self, model):
        """A forward function for probes that leaves no trace: no gradients, the same dropout masks in every
        call and the random state as it was, and the buffers (batch-norm statistics) put back, so the run stays
        reproducible and resumable. The model stays in training mode: an eval-mode forward repacks
        bitsandbytes' 4-bit CPU weights for inference only."""
        device = self.accelerator.device
        buffers = [(b, b.detach().clone()) for b in model.buffers()]

        def forward(**inputs):
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return model(**inputs)

        try:
            yield forward
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    @staticmethod
    def _loss_of(outputs) -> torch.Tensor:
        """The loss of a model's outputs: a tensor, a dict / ModelOutput's 'loss', or a tuple's first entry when
        it is a scalar (the loss first, as transformers models return tuples)."""
        loss = Trainer._loss_or_none(outputs)
        if loss is None:
            raise ValueError("the model returned no loss: return a loss tensor, a dict / ModelOutput with 'loss' "
                             "or a tuple with the loss first, pass labels in the batch, or give "
                             "Trainer(compute_loss_func=...)")
        return loss

    @staticmethod
    def _loss_or_none(outputs) -> torch.Tensor | None:
        if isinstance(outputs, torch.Tensor):
            return outputs
        if isinstance(outputs, Mapping):  # a ModelOutput is one
            return outputs.get("loss")
        if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor) and (
                outputs[0].dim() == 0):
            return outputs[0]
        return getattr(outputs, "loss", None)

    def _window_items(self, window: list[dict]) -> torch.Tensor:
        """Target tokens (or samples) in the whole accumulation window, summed over every process (over this
        process only with average_tokens_across_devices=False)."""
        total = sum(torch.as_tensor(count_targets(b, self.label_names[0], self._causal), device=self.accelerator.device)
                    for b in window)
        if self.accelerator.num_processes > 1 and self.args.average_tokens_across_devices:
            total = self.accelerator.reduce(total, reduction="sum")
        return total.clamp_min(1)  # an all-padding window contributes zero loss, not NaN

    # ------------------------------------------------------------------------------------------
    # training

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        micro_batch = getattr(self, "_micro_batch", self.args.per_device_train_batch_size)
        return build_dataloader(self.train_dataset, self.args, micro_batch, self.data_collator, train=True)

    def get_eval_dataloader(self, eval_dataset=None):
        if isinstance(eval_dataset, str):  # a name in the Trainer's dict of evaluation sets
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset")
        loader = build_dataloader(dataset, self.args, self._eval_batch_size, self.data_collator, train=False)
        return self.accelerator.prepare(loader)

    def _create_deepspeed_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """An "optimizer" or "scheduler" section of the DeepSpeed config is built by DeepSpeed (Accelerate's
        placeholders stand for it until then); otherwise stoker's own is handed to DeepSpeed."""
        from accelerate.utils import DummyOptim, DummyScheduler

        from .optim import create_scheduler, parameter_groups

        a, config = self.args, self.accelerator.state.deepspeed_plugin.deepspeed_config
        if self.optimizer is None:
            self.optimizer = DummyOptim(parameter_groups(self.model, a.weight_decay), lr=a.learning_rate,
                                        weight_decay=a.weight_decay) if "optimizer" in config else (
                self.create_optimizer())
        if self.lr_scheduler is not None:
            return
        if "scheduler" in config:
            self.lr_scheduler = DummyScheduler(self.optimizer, total_num_steps=num_training_steps)
        elif isinstance(self.optimizer, DummyOptim):  # stoker's schedule, on the optimizer DeepSpeed builds
            self.lr_scheduler = DummyScheduler(
                self.optimizer, lr_scheduler_callable=lambda opt: create_scheduler(opt, a, num_training_steps))
        else:
            self.lr_scheduler = create_scheduler(self.optimizer, a, num_training_steps)

    def _plan_steps(self, train_dataloader) -> tuple[int, int | None]:
        """(max_steps, steps per epoch or None for a dataset without a length)."""
        a = self.args
        try:
            per_epoch = len(window_sizes(len(train_dataloader), self._accumulation))
        except TypeError:
            per_epoch = None
        if a.max_steps > 0:
            return a.max_steps, per_epoch
        if not per_epoch:
            raise ValueError("train_dataset yields no full micro-batch (dataloader_drop_last=True with fewer rows "
                             f"than per_device_train_batch_size={a.per_device_train_batch_size})")
        return math.ceil(a.num_train_epochs * per_epoch), per_epoch

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs):
        """Train; resume_from_checkpoint is None, True (the newest complete checkpoint) or a checkpoint path.
        With model_init, each call trains a fresh model; `trial` (an Optuna trial or a dict) is handed to it.

        Raises TrainingPreempted (a SystemExit with PREEMPTED_EXIT_CODE) after checkpointing on SIGTERM/SIGUSR1.
        """
        memory = self._memory_tracker()
        if memory is not None:
            memory.start()
        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        self.is_in_train = True
        try:
            return self._inner_training_loop(resume_from_checkpoint, trial, ignore_keys_for_eval, memory)
        finally:
            self.is_in_train = False

    # named as transformers names it: its memory tracker recognises the stage by the caller's name
    def _inner_training_loop(self, resume_from_checkpoint, trial, ignore_keys_for_eval, memory):
        acc = self.accelerator
        if self._wrapped_in_place:
            raise RuntimeError(f"train() was called before on this Trainer, and {acc.distributed_type} wrapped the "
                               "model in place (DeepSpeed's engine, FSDP1's flat parameters), which cannot be done "
                               "twice: build a new Trainer and model for another run")
        a = self.args
        self._ignore_keys_for_eval = ignore_keys_for_eval
        resume_dir = self._resolve_resume(resume_from_checkpoint)
        if resume_dir is not None:
            self._check_checkpoint_kind(resume_dir)
        # every train() call is a run of its own: fresh state, controls and (unless given) optimizer/schedule
        s = self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                      is_world_process_zero=self.accelerator.is_main_process)
        if trial is not None:
            s.is_hyper_param_search = True
            s.trial_params = dict(getattr(trial, "params", trial))
            s.trial_name = str(getattr(trial, "number", ""))
        self.control = TrainerControl()
        self.optimizer, self.lr_scheduler = self._given_optimizers
        self.current_flos = 0
        self._seed()
        if self.model_init is not None:  # as transformers: a fresh model for every train() call
            model = self._set_up_model(self.call_model_init(trial))
            self._enable_gradient_checkpointing(model)
            acc.free_memory()  # drop Accelerate's references to the previous model
            self.model = self.model_wrapped = model
        self._micro_batch, self._accumulation = a.per_device_train_batch_size, a.gradient_accumulation_steps
        loop = ckpt.read_json(resume_dir, "loop_state.json") if resume_dir else None
        if loop is not None:  # may adopt the micro-batch that auto_find_batch_size settled on
            self._check_resume_settings(loop, resume_dir)
        # checkpoints of this run carry its id; a resumed run continues the id of its checkpoint
        self._run_id = (loop or {}).get("run_id") or uuid.uuid4().hex
        # prepared first: sharded over the processes, its length is the micro-batches of one process, which is
        # what the number of steps (and so the schedule) must be planned from
        self._train_dataloader = self.accelerator.prepare(self.get_train_dataloader())
        max_steps, per_epoch = self._plan_steps(self._train_dataloader)
        trainable, total = trainable_parameters(self.model)  # before FSDP makes them shards
        if is_sharded(acc) and not acc.is_fsdp2:  # FSDP1 flattens the parameters into its own, which the
            self.model_wrapped = acc.prepare(self.model)  # optimizer must be built on
            self.create_optimizer_and_scheduler(max_steps, self.model_wrapped)
            self.optimizer = acc.prepare(self.optimizer)
        elif is_deepspeed(acc):  # DeepSpeed builds one engine of the model, optimizer and schedule
            finish_deepspeed_config(acc, a, max_steps)
            self._create_deepspeed_optimizer_and_scheduler(max_steps)
            self.model_wrapped, self.optimizer, self.lr_scheduler = acc.prepare(self.model, self.optimizer,
                                                                                self.lr_scheduler)
        else:  # FSDP2 shards the parameters in place, and Accelerate moves the optimizer onto the shards
            self.create_optimizer_and_scheduler(max_steps)
            self.model_wrapped, self.optimizer = acc.prepare(self.model, self.optimizer)
        self._wrapped_in_place = is_deepspeed(acc) or (is_sharded(acc) and not acc.is_fsdp2)
        self._loader_micro_batch = self._micro_batch

        s.max_steps, s.train_batch_size = max_steps, self._micro_batch
        s.num_train_epochs = math.ceil(max_steps / per_epoch) if per_epoch else sys.maxsize
        s.compute_steps(a, max_steps)
        start_epoch, skip = 0, 0
        self._reset_accumulators()
        if resume_dir is not None:
            self._load_checkpoint(resume_dir)
            start_epoch, skip = loop["epoch"], 0 if a.ignore_data_skip else self._resume_skip(loop)
            if per_epoch:  # the epochs still needed from here: the planned number, unless the run was resumed with
                # another world size or batch (resume_mismatch='warn'), where epochs hold another number of steps
                left_in_epoch = len(window_sizes(max(len(self._train_dataloader) - skip, 0), self._accumulation))
                s.num_train_epochs = start_epoch + 1 + max(
                    math.ceil((max_steps - s.global_step - left_in_epoch) / per_epoch), 0)
        if s.is_world_process_zero:
            logger.info(f"{type(self.model).__name__}: {trainable:,} trainable parameters of {total:,} "
                        f"({100 * trainable / max(total, 1):.2f}%)")
            if self._causal:  # what memory this run should take (stoker.plan), before it takes it
                plan = start_of_training_line(self.model, a, self.train_dataset, self.accelerator.num_processes)
                logger.info(plan)
            os.makedirs(a.output_dir, exist_ok=True)
            for stale in ckpt.stale_temp_dirs(a.output_dir):  # left by a process killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
        self._last_saved_step = None
        self._fire("on_train_begin", train_dataloader=self._train_dataloader)
        if a.eval_on_start and resume_dir is None:
            self._evaluate_and_track()

        started = time.perf_counter()
        first_step = s.global_step
        with self._preemption_signals(), self._neftune():
            # resumed from the run's last checkpoint (the same script run again): nothing is left to do
            if s.global_step < s.max_steps:
                self._train_loop(per_epoch, start_epoch, skip)
        if self._preempted is not None:
            if acc.num_processes > 1:  # every rank has its share of the checkpoint on disk once all are here
                acc.wait_for_everyone()
                exit_with_code_after_preemption()
            raise TrainingPreempted(self._preempted, s.global_step)

        runtime = time.perf_counter() - started
        steps_run = max(s.global_step - first_step, 1)
        # over the whole run, a resumed one included: the losses before the checkpoint came back with it
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(self._samples_seen / runtime, 3),
            "train_steps_per_second": round(steps_run / runtime, 3),
            "train_tokens_per_second": round(self._tokens_seen / runtime, 3),
            "train_loss": self._total_loss / max(s.global_step - self._nonfinite_total, 1),
            **self._memory_metrics(),
        }
        self.store_flos()
        metrics["total_flos"] = s.total_flos
        if a.load_best_model_at_end and s.best_model_checkpoint:
            self._load_model_weights(s.best_model_checkpoint)
        if memory is not None:
            memory.stop_and_update_metrics(metrics)
        self.log(metrics)
        self._fire("on_train_end")
        return TrainOutput(s.global_step, metrics["train_loss"], metrics)

    def _seed(self) -> None:
        if self.args.full_determinism:
            from transformers.trainer_utils import enable_full_determinism

            enable_full_determinism(self.args.seed)  # seeds, and deterministic algorithms everywhere
        else:
            set_seed(self.args.seed)

    def _memory_tracker(self):
        """transformers' memory tracker when skip_memory_metrics=False (start and stop it in train, evaluate or
        predict themselves: it names the stage after its caller)."""
        if self.args.skip_memory_metrics:
            return None
        if self._memory is None:  # one for every stage: an evaluation inside train() is counted in train's
            from transformers.trainer_utils import TrainerMemoryTracker

            self._memory = TrainerMemoryTracker(skip_memory_metrics=False)
        return self._memory

    @contextlib.contextmanager
    def _neftune(self):
        """NEFTune (neftune_noise_alpha): uniform noise on the input embeddings in training forwards, drawn from
        torch's RNG (saved with checkpoints, so resumes stay exact)."""
        alpha = self.args.neftune_noise_alpha
        if not alpha:
            yield
            return
        embeddings = _unwrap_peft(self.accelerator.unwrap_model(self.model)).get_input_embeddings()

        def add_noise(module, inputs, output):
            if not module.training:
                return output
            bound = alpha / math.sqrt(output.size(1) * output.size(2))
            return output + torch.zeros_like(output).uniform_(-bound, bound)

        handle = embeddings.register_forward_hook(add_noise)
        try:
            yield
        finally:
            handle.remove()

    def _train_loop(self, per_epoch, start_epoch: int, skip: int) -> None:
        a, s, acc = self.args, self.state, self.accelerator
        model, optimizer = self.model_wrapped, self.optimizer
        self._window_started, self._excluded = time.perf_counter(), 0.0
        model.train()
        for epoch in range(start_epoch, s.num_train_epochs):
            self._epoch = epoch
            self._fire("on_epoch_begin")
            for window in self._epoch_windows(epoch, skip):
                self._fire("on_step_begin")
                window_loss, window = self._accumulate(model, window)
                self._batches_in_epoch += len(window)
                # with max_grad_norm=0 this only measures the norm (the non-finite guard needs it)
                grad_norm = full_tensor(acc.clip_grad_norm_(model.parameters(), a.max_grad_norm or math.inf))
                if self._check_step(window_loss, grad_norm):  # one host sync per step
                    self._fire("on_pre_optimizer_step")
                    optimizer.step()
                    self._fire("on_optimizer_step")
                    self._step_lr = self._learning_rate()  # the rate this step used, which is the one logged
                    # fp16 loss scaling skips steps with inf gradients; a plateau schedule steps after evaluation
                    if not acc.optimizer_step_was_skipped and not self._steps_on_metric():
                        self.lr_scheduler.step()
                    self._log_loss += window_loss
                    self._log_steps += 1
                    self._grad_norm = grad_norm
                elif not a.logging_nan_inf_filter:  # the update is still skipped; only the log shows it
                    self._log_loss += window_loss
                    self._log_steps += 1
                optimizer.zero_grad(set_to_none=True)
                s.global_step += 1
                s.epoch = epoch + (self._batches_in_epoch / len(self._train_dataloader) if per_epoch else 0)
                self._fire("on_step_end")
                if self.accelerator.num_processes == 1 and self._signal is not None:
                    self._preempted = self._signal  # alone, act on a signal as soon as the step is done
                if self._preempted is not None:  # checkpoint this step, then leave
                    self.control.should_save = self.control.should_training_stop = True
                self._maybe_log_save_evaluate()
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            skip = 0
            if per_epoch and self._batches_in_epoch >= len(self._train_dataloader):
                s.epoch = epoch + 1
            self._fire("on_epoch_end")
            self._maybe_log_save_evaluate()
            self.control.should_epoch_stop = False
            if self.control.should_training_stop or s.global_step >= s.max_steps:
                break
        if self._log_steps:  # loss and tokens of steps after the last log
            self._total_loss += self._reduce_log_loss()
        self._fold_token_counts()

    def _epoch_windows(self, epoch: int, skip: int) -> Iterator[list[dict]]:
        """The epoch's optimizer-step windows from micro-batch `skip` on; the last window may be shorter.

        Resuming skips indices in the sampler, so no skipped batch is loaded or run. When an out-of-memory
        error halves the micro-batch, the loader is rebuilt at the same sample position.
        """
        self._batches_in_epoch = skip
        while True:
            loader = self._train_loader_at(epoch, self._batches_in_epoch)
            size, window = self._micro_batch, []
            for batch in self._data_clock.timed(loader):  # sums the time spent waiting for batches
                window.append(dict(batch))  # a transformers collator's BatchEncoding is a Mapping, not a dict
                if len(window) == self._accumulation:
                    yield window
                    window = []
                    if self._micro_batch != size:
                        break
            else:
                if window:
                    yield window
                return

    def _train_loader_at(self, epoch: int, skip: int):
        acc = self.accelerator
        if self._loader_micro_batch != self._micro_batch:
            self._train_dataloader = acc.prepare(self.get_train_dataloader())
            self._loader_micro_batch = self._micro_batch
        loader = self._train_dataloader
        loader.set_epoch(epoch)
        if loader.generator is not None:  # worker seeds = f(data_seed, epoch), not the global RNG: resumable
            loader.generator.manual_seed(self.args.data_seed + epoch)
        return acc.skip_first_batches(loader, skip) if skip else loader

    def _accumulate(self, model, window: list[dict]) -> tuple[torch.Tensor, list[dict]]:
        """Forward and backward over a window; returns (window loss on this process, the window as run).

        With auto_find_batch_size, an out-of-memory error halves the micro-batch and retries the same
        samples as twice as many micro-batches: the update is unchanged because the loss is normalised over
        the window's target tokens, not over micro-batches.
        """
        from accelerate.utils.memory import should_reduce_batch_size

        while True:
            try:
                loss = self._forward_backward(model, window)
                break
            except Exception as e:
                if not (self.args.auto_find_batch_size and should_reduce_batch_size(e)):
                    raise
                window = self._halve_micro_batch(window, e)
        for batch in window:
            self._count_inputs(batch)
            self.current_flos += float(self.floating_point_ops(batch))
        return loss, window

    def _forward_backward(self, model, window: list[dict]) -> torch.Tensor:
        acc = self.accelerator
        deepspeed = is_deepspeed(acc)
        if self._causal is None or self._honours_num_items is None:
            self._decide_loss_family(model, window[0])
        num_items = self._window_items(window)
        window_loss = torch.zeros((), device=acc.device)
        try:
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                if deepspeed:  # DeepSpeed steps (inside backward) at the window's end only
                    acc.sync_gradients = last
                # gradients are all-reduced only on the window's last micro-batch
                with contextlib.nullcontext() if last else acc.no_sync(model):
                    window_loss += self.training_step(model, dict(batch), num_items)
                if not last:
                    self._fire("on_substep_end")
        finally:
            acc.sync_gradients = True  # Accelerate's optimizer ignores step and zero_grad until it is
        return window_loss

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its share of the window loss, detached. The loss is
        normalised by num_items_in_batch, the window's target count over every process, so a subclass that
        changes the inputs or adds to the loss and calls this keeps the update exact."""
        acc = self.accelerator
        model.train()
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        # DDP (and DeepSpeed) average gradients over processes; the loss is already normalised by the global
        # item count, so scale back up to get the sum over the global window. DeepSpeed would also divide it by
        # the accumulation steps.
        scale = acc.num_processes if self.args.average_tokens_across_devices else 1
        acc.backward(loss * scale, **({"scale_wrt_gas": False} if is_deepspeed(acc) else {}))
        if self.args.torch_empty_cache_steps and self.state.global_step % self.args.torch_empty_cache_steps == 0:
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        return loss.detach()

    def _halve_micro_batch(self, window: list[dict], error: Exception) -> list[dict]:
        from accelerate.utils.memory import clear_device_cache

        if self._micro_batch % 2:
            raise RuntimeError(f"out of memory with a micro-batch of {self._micro_batch}: auto_find_batch_size "
                               "can only halve an even micro-batch (use a power of two)") from error
        self.optimizer.zero_grad(set_to_none=True)
        clear_device_cache(garbage_collection=True)
        self._micro_batch //= 2
        self._accumulation *= 2
        self._batches_in_epoch *= 2
        self.state.train_batch_size = self._micro_batch
        logger.warning(f"out of memory at step {self.state.global_step + 1}; micro-batch now "
                       f"{self._micro_batch} x accumulation {self._accumulation} (same update)")
        return [part for batch in window for part in _split_batch(batch, self._micro_batch)]

    def _check_step(self, window_loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True if the update may be applied. Checked on every step, which costs one host sync per step: the
        price of never applying a non-finite update. Also shares a pending preemption signal across ranks."""
        acc = self.accelerator
        deepspeed = is_deepspeed(acc)
        bad = ~torch.isfinite(window_loss)
        # with fp16 loss scaling (Accelerate's or DeepSpeed's), inf gradients are the scaler's business
        if acc.scaler is None and not (deepspeed and self.args.fp16):
            bad |= ~torch.isfinite(torch.as_tensor(grad_norm, device=acc.device))
        mine = bad
        if acc.num_processes > 1:  # every rank must take the same decision
            flags = torch.stack([bad.float(), torch.tensor(float(self._signal is not None), device=acc.device)])
            flags = acc.reduce(flags, reduction="sum")
            bad, signalled = flags[0] > 0, flags[1].item() > 0
        else:
            signalled = self._signal is not None
        if signalled and self._preempted is None:
            self._preempted = self._signal or signal.SIGTERM
        if not bad.item():
            self._nonfinite_run = 0
            return True
        self._nonfinite_run += 1
        self._nonfinite_total += 1
        step = self.state.global_step + 1
        what = f"non-finite loss ({window_loss.item():.4g}) or gradient norm ({float(grad_norm):.4g}) at step {step}"
        if not mine.item():  # this process's numbers are finite: another one's are not
            what += f" on another process (this is process {acc.process_index})"
        if deepspeed and not acc.optimizer_step_was_skipped:  # its own overflow check skips some, not all
            raise NonFiniteError(f"{what}; DeepSpeed has applied the update inside its engine, where it cannot be "
                                 "skipped: stopping")
        if self.args.nonfinite_policy == "stop":
            raise NonFiniteError(f"{what}; stopping (nonfinite_policy='stop')")
        if self._nonfinite_run >= self.args.max_nonfinite_steps:
            raise NonFiniteError(f"{what}: {self._nonfinite_run} non-finite steps in a row "
                                 f"(max_nonfinite_steps={self.args.max_nonfinite_steps}); stopping")
        logger.warning(f"{what}; update skipped")
        return False

    @contextlib.contextmanager
    def _preemption_signals(self):
        """While training, SIGTERM / SIGUSR1 only set a flag: the loop finishes the optimizer step, saves and
        exits. The handler never raises, so a second signal during the save cannot interrupt it."""
        self._signal, self._preempted = None, None
        if not self.args.save_on_signal or threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
        previous = {sig: signal.signal(sig, self._on_signal) for sig in wanted}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def _reset_accumulators(self) -> None:
        """What the loop sums between two logs. Kept on the device (no host sync per step) and saved with
        each checkpoint, so that a resumed run logs the same numbers as the run that was never stopped."""
        device = self.accelerator.device
        self._log_loss = torch.zeros((), device=device)
        self._log_steps, self._grad_norm, self._step_lr = 0, None, None
        self._total_loss = 0.0  # every logged loss of the run, over every process: train_loss's numerator
        self._tokens = torch.zeros(2, dtype=torch.long, device=device)  # non-padding tokens, all tokens
        self._samples_seen, self._samples_at_log, self._tokens_seen = 0, 0, 0
        self._nonfinite_run, self._nonfinite_total = 0, 0
        # timing only, never saved: a resumed run measures its own waits
        self._data_clock, self._warned_data_wait, self._flops_shape = Stopwatch(), False, None

    def _pending_log(self) -> dict[str, Any]:
        return {"loss": self._log_loss, "steps": self._log_steps, "tokens": self._tokens,
                "total_loss": self._total_loss, "samples": self._samples_seen - self._samples_at_log,
                "nonfinite_total": self._nonfinite_total, "nonfinite_run": self._nonfinite_run}

    def _restore_pending_log(self, pending: dict[str, Any]) -> None:
        device = self.accelerator.device
        self._log_loss, self._tokens = pending["loss"].to(device), pending["tokens"].to(device)
        self._log_steps, self._samples_seen = pending["steps"], pending["samples"]
        self._total_loss = pending.get("total_loss", 0.0)
        self._nonfinite_total, self._nonfinite_run = pending["nonfinite_total"], pending["nonfinite_run"]

    def _count_inputs(self, batch: dict) -> None:
        non_padding = count_input_tokens(batch)
        ids = batch.get("input_ids")
        self._tokens += torch.stack([torch.as_tensor(non_padding, device=self._tokens.device),
                                     torch.as_tensor(ids.numel() if ids is not None else non_padding,
                                                     device=self._tokens.device)])
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        self._samples_seen += first.shape[0] * self.accelerator.num_processes if first is not None else 0

    def _fold_token_counts(self) -> tuple[int, int]:
        """Input tokens since the last call (non-padding, all), summed over every process and added to the
        run's counts. A host sync, so done when logging and once at the end rather than per step."""
        counts = self._tokens.clone()
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        tokens, all_tokens = (int(c) for c in counts.tolist())
        self._tokens.zero_()
        self._tokens_seen += tokens
        mode = self.args.include_num_input_tokens_seen
        self.state.num_input_tokens_seen += tokens if mode == "non_padding" else all_tokens if mode == "all" else 0
        return tokens, all_tokens

    def _reduce_log_loss(self) -> float:
        """Sum of window losses since the last log (over every process), then reset. A host sync."""
        total = self._log_loss.clone()
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
            if not self.args.average_tokens_across_devices:  # each process's loss is a mean of its own
                total /= self.accelerator.num_processes
        self._log_loss.zero_()
        self._log_steps = 0
        return total.item()

    def _maybe_log_save_evaluate(self) -> None:
        """Act on the control flags."""
        c, s = self.control, self.state
        if c.should_log and (self._log_steps or self._nonfinite_total):
            steps = self._log_steps
            logged = self._reduce_log_loss() if steps else 0.0
            self._total_loss += logged
            tokens, all_tokens = self._fold_token_counts()
            elapsed = max(time.perf_counter() - self._window_started - self._excluded, 1e-9)
            logs = {"loss": round(logged / steps, 6)} if steps else {}
            if self._grad_norm is not None:
                logs["grad_norm"] = float(self._grad_norm)
            if self._nonfinite_total:
                logs["nonfinite_steps_skipped"] = self._nonfinite_total
            logs["learning_rate"] = self._step_lr if self._step_lr is not None else self._learning_rate()
            logs["tokens_per_second"] = round(tokens / elapsed, 2)
            logs["samples_per_second"] = round((self._samples_seen - self._samples_at_log) / elapsed, 3)
            logs.update(self._throughput_diagnostics(tokens, all_tokens, self._samples_seen - self._samples_at_log,
                                                     elapsed))
            self._samples_at_log = self._samples_seen
            self.log(logs)
            self._window_started, self._excluded = time.perf_counter(), 0.0
        c.should_log = False
        paused = time.perf_counter()
        if c.should_evaluate:
            c.should_evaluate = False
            if self._evaluate_and_track() and self.args.save_strategy == "best":
                c.should_save = True
        if c.should_save:
            c.should_save = False
            if self._last_saved_step != s.global_step:  # epoch end right after a step save: same step
                self._save_checkpoint()
                self._last_saved_step = s.global_step
        self._excluded += time.perf_counter() - paused

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record logs in state.log_history and hand them to the on_log callbacks. The loop logs through this
        method, so a subclass that overrides it sees (and may change) every record."""
        if start_time is not None:  # as transformers: throughput since start_time
            logs = {**logs, **speed_metrics("train", start_time)}
        record = {**logs, "epoch": round(self.state.epoch, 4), "step": self.state.global_step}
        self.state.log_history.append(record)
        self._fire("on_log", logs=logs)

    def _throughput_diagnostics(self, tokens: int, all_tokens: int, samples: int, elapsed: float) -> dict:
        """Where the window's time went (stoker.diagnostics): the fraction spent waiting for data (warned
        about once above DATA_WAIT_WARNING) and, on a GPU, MFU and the peak of allocated memory so far."""
        a, acc = self.args, self.accelerator
        on_gpu = acc.device.type == "cuda"
        wait = min(self._data_clock.take() / elapsed, 1.0)
        out = {"data_wait_fraction": round(wait, 4)}
        if wait > DATA_WAIT_WARNING and not self._warned_data_wait:
            self._warned_data_wait = True
            logger.warning(data_wait_advice(wait, a, on_gpu))
        if not on_gpu:
            return out
        out["peak_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(acc.device) / 2**30, 3)
        peak = a.peak_tflops or diagnostics.peak_tflops(torch.cuda.get_device_name(acc.device),
                                                        diagnostics.matmul_precision(a.mixed_precision))
        if peak and samples:
            if self._flops_shape is None:  # parameter counts: computed once per run
                self._flops_shape = diagnostics.model_flops_shape(acc.unwrap_model(self.model_wrapped))
            per_token = diagnostics.flops_per_token(*self._flops_shape, seq_len=round(all_tokens / samples))
            out["mfu"] = round(diagnostics.mfu(tokens / elapsed, per_token, peak, acc.num_processes), 4)
        return out

    def _memory_metrics(self) -> dict[str, float]:
        if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
            return {"peak_memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
        import resource

        # ru_maxrss is KiB on Linux: the process's peak resident memory, the CPU-side equivalent
        return {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}

    # ------------------------------------------------------------------------------------------
    # evaluation and prediction

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Metrics of one evaluation set; with a dict of them (given here or to the Trainer) each one's metrics,
        prefixed with its name (eval_<name>_loss, ...). A name picks one set of the Trainer's dict."""
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, Mapping) or eval_dataset not in self.eval_dataset:
                known = sorted(self.eval_dataset) if isinstance(self.eval_dataset, Mapping) else []
                raise KeyError(f"eval_dataset={eval_dataset!r}: the Trainer's eval datasets are named {known}")
            eval_dataset = self.eval_dataset[eval_dataset]
        datasets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(datasets, Mapping):
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        memory = self._memory_tracker()
        if memory is not None:
            memory.start()
        # without compute_metrics no predictions are needed, only the loss (as transformers)
        output = self._run_evaluation(eval_dataset, "Evaluation", True if self.compute_metrics is None else None,
                                      ignore_keys, metric_key_prefix)
        metrics = output.metrics
        if memory is not None:
            memory.stop_and_update_metrics(metrics)
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def _evaluate_and_track(self) -> bool:
        """Evaluate, step a plateau schedule on the metric and update best_metric; True if this evaluation is
        the new best."""
        metrics = self.evaluate(ignore_keys=self._ignore_keys_for_eval)
        name = self.args.metric_for_best_model
        if self._steps_on_metric():  # as transformers: on metric_for_best_model, else eval_loss
            self.lr_scheduler.step(self._metric(metrics, name or "loss"))
        if name is None:
            return False
        value, s, best = self._metric(metrics, name), self.state, self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better and math.isfinite(value):
            s.best_metric, s.best_global_step = value, s.global_step
            if self._last_saved_step == s.global_step:  # evaluated after this step's checkpoint was written
                s.best_model_checkpoint = os.path.join(self.args.output_dir, f"{ckpt.PREFIX}{s.global_step}")
            return True
        return False

    @staticmethod
    def _metric(metrics: dict[str, float], name: str) -> float:
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={name!r}: {key!r} is not among the evaluation metrics "
                           f"{sorted(metrics)}")
        return metrics[key]

    def _steps_on_metric(self) -> bool:
        """Whether the schedule steps on an evaluation metric (ReduceLROnPlateau) rather than on every step."""
        return isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _learning_rate(self) -> float:
        if self._steps_on_metric() or not hasattr(self.lr_scheduler, "get_last_lr"):
            return self.optimizer.param_groups[0]["lr"]
        return self.lr_scheduler.get_last_lr()[0]

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        memory = self._memory_tracker()
        if memory is not None:
            memory.start()
        output = self._run_evaluation(test_dataset, "Prediction", None, ignore_keys, metric_key_prefix)
        if memory is not None:
            memory.stop_and_update_metrics(output.metrics)
        self._fire("on_predict", metrics=output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def _run_evaluation(self, dataset, description: str, prediction_loss_only, ignore_keys, prefix: str):
        """evaluation_loop over a dataset, without gradients, plus the speed metrics. With auto_find_batch_size,
        an out-of-memory error halves the evaluation batch (never the training batch) and starts over."""
        from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
        if self.model_wrapped is self.model:  # evaluate() before train(): place the model once
            self.model_wrapped = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        if not self.is_in_train and (self.args.bf16_full_eval or self.args.fp16_full_eval):
            self.model_wrapped.to(torch.bfloat16 if self.args.bf16_full_eval else torch.float16)
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        try:
            while True:
                started = time.time()  # wall-clock, as transformers' speed_metrics measures from
                try:
                    dataloader = self.get_eval_dataloader(dataset)
                    output = self.evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, prefix)
                    break
                except Exception as e:
                    if not (self.args.auto_find_batch_size and should_reduce_batch_size(e)
                            and self._eval_batch_size > 1):
                        raise
                    clear_device_cache(garbage_collection=True)
                    self._eval_batch_size //= 2
                    logger.warning(f"out of memory in evaluation; eval batch now {self._eval_batch_size}")
        finally:
            if was_training:
                model.train()
        output.metrics.update(speed_metrics(prefix, started, num_samples=output.num_samples,
                                            num_steps=math.ceil(output.num_samples / self._eval_batch_size)))
        return output

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """(loss, logits, labels) of one evaluation batch, without gradients. The loss is the batch's mean over its
        target tokens (a plain module given no labels: the mean it returns, if any; else None); logits are the
        predictions transformers.Trainer would take (a tuple for several outputs), labels one tensor or a tuple
        with one per label_names entry; logits and labels are None with prediction_loss_only."""
        inputs = dict(inputs)  # a transformers collator's BatchEncoding
        label = self._labels_of(inputs)
        loss = None
        with torch.no_grad():
            if label is None and (self._is_transformers or self.compute_loss_func):
                outputs = model(**inputs, **self._forward_kwargs)  # no labels, so no loss: predictions only
            elif label is None:  # a plain module: its own loss, if it returns one (a mean over its rows)
                outputs = model(**inputs)
                loss = self._loss_or_none(outputs)
            else:
                if self._causal is None or self._honours_num_items is None:
                    self._decide_loss_family(model, inputs)
                items = count_targets(inputs, self.label_names[0], self._causal)
                loss, outputs = self.compute_loss(model, dict(inputs), return_outputs=True,
                                                  num_items_in_batch=max(items, 1))
        loss = loss.detach() if loss is not None else None
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys and isinstance(outputs, Mapping):
            outputs = {k: v for k, v in outputs.items() if k not in ignore_keys}
        return loss, self._predictions_of(outputs, has_loss=loss is not None), label

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """prediction_step over every batch: the exact mean loss over the target tokens of the dataset, the
        predictions and labels gathered from every process, and compute_metrics of them."""
        a, acc, model, prefix = self.args, self.accelerator, self.model_wrapped, metric_key_prefix
        if prediction_loss_only is None:
            prediction_loss_only = a.prediction_loss_only
        self._logits_wanted = not prediction_loss_only  # otherwise chunked_loss never computes the logits
        loss_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        items_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        kept = {"predictions": [], "label_ids": [], "inputs": [], "losses": []}
        pending = {k: [] for k in kept}
        batch_metrics = None

        def gather(t):  # sequence lengths differ between processes: pad to a common length first
            return acc.gather_for_metrics(acc.pad_across_processes(t, dim=1, pad_index=-100),
                                          use_gather_object=a.eval_use_gather_object)

        rows_seen = 0  # an IterableDataset has no length to count its samples by
        for n, batch in enumerate(dataloader, 1):
            batch = dict(batch)  # a transformers collator's BatchEncoding
            loss, logits, label = self.prediction_step(model, batch, prediction_loss_only, ignore_keys)
            rows = count_targets(batch, None, False)
            rows_seen += rows
            if loss is not None:
                # each batch's loss is normalised over its own items (target tokens; rows for a plain module
                # without labels), then re-weighted by them: the exact mean over every item of the eval set
                items = count_targets(batch, self.label_names[0], self._causal)
                genuine = self._genuine_rows(batch)
                if genuine is not None and genuine > 0:  # score only this process's real rows: one extra
                    part = _split_batch(batch, genuine)[0]  # forward, once per pass at most
                    items = count_targets(part, self.label_names[0], self._causal)
                    loss = self.prediction_step(model, part, True, ignore_keys)[0]
                if genuine is None or genuine > 0:
                    loss_sum += loss.double() * items
                    items_sum += items
            if not prediction_loss_only:
                if logits is not None and self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, label)
                step = {"predictions": logits, "label_ids": label,
                        "inputs": batch.get("input_ids") if "inputs" in a.include_for_metrics else None,
                        "losses": loss.repeat(rows) if loss is not None and "loss" in a.include_for_metrics
                        else None}
                step = {k: _nested(gather, v) for k, v in step.items() if v is not None}
                if a.batch_eval_metrics:  # metrics of the batch now; nothing is kept
                    if self.compute_metrics is not None:
                        batch_metrics = self.compute_metrics(_eval_prediction(EvalPrediction, step, a),
                                                             compute_result=acc.gradient_state.end_of_dataloader)
                else:
                    for k, v in step.items():
                        pending[k].append(v)
                    if a.eval_accumulation_steps and n % a.eval_accumulation_steps == 0:
                        for k in kept:
                            kept[k] += [_nested(torch.Tensor.cpu, t) for t in pending[k]]
                            pending[k] = []
            self._fire("on_prediction_step")
        for k in kept:
            kept[k] += [_nested(torch.Tensor.cpu, t) for t in pending[k]]

        metrics = {}
        if acc.num_processes > 1:
            loss_sum, items_sum = acc.reduce(loss_sum, "sum"), acc.reduce(items_sum, "sum")
        if items_sum.item() > 0:
            metrics[f"{prefix}_loss"] = loss_sum.item() / items_sum.item()
        joined = {k: _concat_padded(v) if a.eval_do_concat_batches else [_concat_padded([t]) for t in v] or None
                  for k, v in kept.items()}
        if self.compute_metrics is not None and not a.batch_eval_metrics and joined["predictions"] is not None:
            batch_metrics = self.compute_metrics(_eval_prediction(EvalPrediction, joined, a))
        for k, v in (batch_metrics or {}).items():
            metrics[k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"] = v
        try:
            num_samples = self.num_examples(dataloader)
        except TypeError:  # a stream has no length (also inside Accelerate's shard of it): count what came
            num_samples = rows_seen * acc.num_processes
        return EvalLoopOutput(predictions=joined["predictions"], label_ids=joined["label_ids"], metrics=metrics,
                              num_samples=num_samples)

    def _genuine_rows(self, batch: dict) -> int | None:
        """How many rows of this process's evaluation batch are real samples; None if all of them are.

        With several processes Accelerate fills every process's last batch up to the same size with samples
        from the start of the dataset (even_batches), and gather_for_metrics cuts those from the gathered
        predictions: the first `remainder` gathered rows, in process order, are real. The loss makes the same
        cut, so that every sample counts exactly once and eval_loss equals the single-process value.
        """
        acc = self.accelerator
        state = acc.gradient_state
        if acc.num_processes == 1 or not state.end_of_dataloader or state.remainder <= 0:
            return None
        rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        genuine = min(max(state.remainder - acc.process_index * rows, 0), rows)
        return None if genuine == rows else genuine

    def _labels_of(self, batch: dict):
        """The batch's labels as transformers.Trainer collects them: one tensor, or a tuple with one per entry of
        label_names; None unless every one of them is present."""
        found = tuple(batch.get(name) for name in self.label_names)
        if any(t is None for t in found):
            return None
        return found[0] if len(found) == 1 else found

    def _predictions_of(self, outputs, has_loss: bool):
        """The predictions in a model's outputs, as transformers.Trainer takes them: every entry of a dict /
        ModelOutput but the loss and the config's keys_to_ignore_at_inference, or a tuple after its loss; one
        entry is returned as itself, several as a tuple."""
        if isinstance(outputs, torch.Tensor):
            return None if has_loss else outputs  # a bare loss, or bare logits
        ignore = {"loss", *(getattr(getattr(_unwrap_peft(self.model), "config", None), "keys_to_ignore_at_inference",
                                    None) or ())}
        if isinstance(outputs, Mapping):
            found = tuple(v for k, v in outputs.items() if k not in ignore)
        else:
            found = tuple(outputs[1:] if has_loss else outputs)
        found = tuple(v for v in found if _is_nested_tensors(v))  # a KV cache object is no prediction
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    # ------------------------------------------------------------------------------------------
    # saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model for use outside stoker: transformers/peft models with save_pretrained
        (safetensors; peft stores the adapter only), plain modules as safetensors + stoker_model.json."""
        output_dir = output_dir or self.args.output_dir
        acc = self.accelerator
        state_dict = self._state_dict_for_saving()
        if acc.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            ckpt.save_weights(acc.unwrap_model(self.model_wrapped), output_dir, state_dict=state_dict)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
            ckpt.write_json(output_dir, "training_args.json", self.args.to_dict())
        acc.wait_for_everyone()

    def _state_dict_for_saving(self) -> dict | None:
        """The full state dict, gathered across shards (every rank must call it). A peft model's save_pretrained
        picks the adapter weights from it (a frozen, maybe 4-bit, base is never gathered nor written), or from
        the model itself when it is not sharded (None)."""
        acc = self.accelerator
        if is_sharded(acc):
            return gather_full_model(self.model_wrapped, trainable_only=self._is_peft())
        if not self._is_peft():
            return acc.get_state_dict(self.model_wrapped)
        return gather_trainable_zero3(self.model_wrapped) if is_deepspeed(acc) and zero_stage(acc) == 3 else None

    def _is_peft(self) -> bool:
        return ckpt.is_peft_model(self.accelerator.unwrap_model(self.model_wrapped))

    def _save_checkpoint(self) -> str:
        a, s, acc = self.args, self.state, self.accelerator
        final = os.path.join(a.output_dir, f"{ckpt.PREFIX}{s.global_step}")
        tmp = ckpt.temp_dir_for(final)
        if s.best_global_step == s.global_step:  # (an evaluation after this save sets it in _evaluate_and_track)
            s.best_model_checkpoint = final
        self.store_flos()
        s.stateful_callbacks = callback_states(self.callback_handler.callbacks, self.control)
        if not parameters_finite(acc, self.model_wrapped):  # decided by every rank together
            raise NonFiniteError(f"refusing to save {os.path.basename(final)}: the model has non-finite parameters")
        # a sharded model's checkpoint holds every rank's shards, and the full model only if asked for (a peft
        # adapter, small, always)
        sharded = is_sharded(acc)
        full = not sharded or gathers_full_model(acc) or self._is_peft()
        state_dict = self._state_dict_for_saving() if full else None
        # every rank writes part of the folder: a rank's failure (a full disk, a permission error, state that
        # cannot be stored) is shared with all before they go on, and nothing half-written stays behind
        failure = None
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except OSError as e:
            failure = e
        self._all_saved(failure, tmp, final)
        try:
            if sharded:  # a collective, whose failures every rank raises
                save_shards(tmp, self.model_wrapped, self.optimizer, acc.is_main_process, self._is_peft())
            elif is_deepspeed(acc):  # every rank its partition of the optimizer state
                save_zero_partition(tmp, self.optimizer, acc.process_index)
            if acc.is_main_process:
                self._write_checkpoint_files(tmp, state_dict, full, sharded)
            if not a.save_only_model:
                ckpt.save_state(tmp, f"process_{acc.process_index}",
                                {"rng": _rng_state(), "pending_log": self._pending_log()})
        except Exception as e:  # safetensors reports a failed write as SafetensorError, not OSError
            failure = e
        self._all_saved(failure, tmp, final)
        try:
            if acc.is_main_process:
                ckpt.commit(tmp, final, s.global_step)
        except OSError as e:
            failure = e
        self._all_saved(failure, tmp, final)
        if acc.is_main_process:
            self._rotate_checkpoints()
        acc.wait_for_everyone()
        self._fire("on_save")
        return final

    def _rotate_checkpoints(self) -> None:
        """save_total_limit counts this run's checkpoints only: those an earlier run left in output_dir are kept
        (as transformers keeps them), unless overwrite_output_dir, which removes them once this run has a
        complete checkpoint of its own."""
        a, s = self.args, self.state
        mine, others = [], []
        for path in ckpt.list_checkpoints(a.output_dir):
            (mine if _run_of(path) == self._run_id else others).append(path)
        ckpt.rotate(a.output_dir, a.save_total_limit, keep=s.best_model_checkpoint, among=mine)
        if a.overwrite_output_dir:
            for path in others:
                shutil.rmtree(path, ignore_errors=True)

    def _write_checkpoint_files(self, tmp: str, state_dict: dict | None, full: bool, sharded: bool) -> None:
        """The main process's part of a checkpoint: the model (or what its shards are the weights of), the
        optimizer state when it is whole, and the scheduler, scaler, trainer and loop state."""
        acc, a, s = self.accelerator, self.args, self.state
        model = acc.unwrap_model(self.model_wrapped)
        if full:
            ckpt.save_weights(model, tmp, state_dict=state_dict)
        elif hasattr(model, "config"):  # what the shards are the weights of, for `stoker consolidate`
            config = copy.deepcopy(model.config)
            config.architectures = [model_class_name(model)]  # as save_pretrained records it
            config.save_pretrained(tmp)
        if not a.save_only_model:
            if not sharded and not is_deepspeed(acc):
                ckpt.save_state(tmp, "optimizer", self.optimizer.state_dict())
            ckpt.save_state(tmp, "scheduler", self.lr_scheduler.state_dict())
            if acc.scaler is not None:
                ckpt.save_state(tmp, "scaler", acc.scaler.state_dict())
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            f.write(s.to_json_string())
        ckpt.write_json(tmp, "training_args.json", a.to_dict())
        ckpt.write_json(tmp, "loop_state.json", self._loop_state())

    def _all_saved(self, failure: Exception | None, tmp: str, final: str) -> None:
        """Raise CheckpointError on every rank if any rank failed to write its part (a collective)."""
        acc = self.accelerator
        failed = failure is not None
        if acc.num_processes > 1:
            failed = acc.reduce(torch.tensor(float(failed), device=acc.device), reduction="sum").item() > 0
        if not failed:
            return
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        why = (getattr(failure, "strerror", None) or failure) if failure is not None else (
            "another process could not write its part")
        raise ckpt.CheckpointError(f"saving {final} failed: {why}; the partial folder was removed and earlier "
                                   "checkpoints are intact") from failure

    def _load_model_weights(self, folder: str) -> None:
        """The weights of a checkpoint of this kind of run (see _check_checkpoint_kind), as
        load_best_model_at_end loads them."""
        acc, model = self.accelerator, self.model_wrapped
        if is_sharded(acc):
            load_shards(folder, model, trainable_only=self._is_peft())
        elif is_deepspeed(acc) and zero_stage(acc) == 3:
            load_zero3_weights(model, folder, acc.is_main_process)
        else:
            ckpt.load_weights(acc.unwrap_model(model), folder)

    def _check_checkpoint_kind(self, folder: str) -> None:
        """Sharded (FSDP), ZeRO-partitioned (DeepSpeed) and whole optimizer states load only into their own kind."""
        def kind(sharded: bool, deepspeed: bool) -> str:
            return "an FSDP" if sharded else "a DeepSpeed" if deepspeed else "a data-parallel (or single-process)"

        saved = kind(os.path.isdir(os.path.join(folder, MODEL_SHARDS)),
                     is_zero_checkpoint(folder))
        now = kind(is_sharded(self.accelerator), is_deepspeed(self.accelerator))
        if saved != now:
            raise ckpt.CheckpointError(f"{folder} was written by {saved} run and this is {now} run: resume it with "
                                       "the fsdp / deepspeed settings it was written with")

    def _loop_state(self) -> dict[str, Any]:
        """Where the data stream stands, and the settings that must not change for an exact resume."""
        a = self.args
        return {
            "epoch": self._epoch,
            "batches_in_epoch": self._batches_in_epoch,
            "data_seed": a.data_seed,
            "world_size": self.accelerator.num_processes,
            "seed": a.seed,
            "per_device_train_batch_size": self._micro_batch,  # as run: auto_find_batch_size may have halved it
            "gradient_accumulation_steps": self._accumulation,
            "train_dataset_len": len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None,
            "run_id": self._run_id,
            "save_only_model": a.save_only_model,
        }

    def _check_resume_settings(self, loop: dict[str, Any], folder: str) -> None:
        """Refuse (or, with resume_mismatch='warn', report) settings that make the resume inexact."""
        a = self.args
        saved_micro, saved_acc = loop["per_device_train_batch_size"], loop["gradient_accumulation_steps"]
        if a.auto_find_batch_size and saved_micro * saved_acc == self._micro_batch * self._accumulation:
            self._micro_batch, self._accumulation = saved_micro, saved_acc  # the size that fit memory
        now = {"per_device_train_batch_size": self._micro_batch, "gradient_accumulation_steps": self._accumulation,
               "world_size": self.accelerator.num_processes, "data_seed": a.data_seed, "seed": a.seed,
               "train_dataset_len": len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None}
        changed = [f"{k}={loop[k]!r} (now {v!r})" for k, v in now.items() if loop.get(k) != v]
        if not changed:
            return
        what = f"{folder} was written with {', '.join(changed)}: resuming cannot reproduce the original run"
        if a.resume_mismatch == "error":
            raise ckpt.CheckpointError(f"{what}; restore those settings, or set resume_mismatch='warn' to continue")
        logger.warning(f"{what}; continuing with the new settings (resume_mismatch='warn')")

    def _resume_skip(self, loop: dict[str, Any]) -> int:
        """Micro-batches of the current size to skip in the resumed epoch (the same samples, if sizes match)."""
        consumed = loop["batches_in_epoch"] * loop["per_device_train_batch_size"] * loop["world_size"]
        return consumed // (self._micro_batch * self.accelerator.num_processes)

    def _resolve_resume(self, resume) -> str | None:
        a = self.args
        if resume is None or resume is False:
            resume = a.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() in ("true", "false"):  # from a flag or a config file
            resume = resume.lower() == "true"
        if resume is None or resume is False:
            # a new run, also into an output_dir that holds an earlier run's checkpoints (as transformers 5): each
            # checkpoint it writes replaces one of the same step atomically (see _rotate_checkpoints for the rest)
            return None
        if resume is True:
            complete = []
            for path in reversed(ckpt.list_checkpoints(a.output_dir)):
                problem = ckpt.verify(path)
                if problem is None:
                    complete.append(path)
                else:
                    logger.warning(f"skipping {path}: {problem}")
            runs = {}
            for path in complete:
                runs.setdefault(_run_of(path), []).append(os.path.basename(path))
            if len(runs) > 1:  # the newest by step may be the other run's: which run goes on is not the user's call
                listing = "; ".join(", ".join(sorted(names, key=ckpt.checkpoint_step)) for names in runs.values())
                raise ckpt.CheckpointError(
                    f"resume_from_checkpoint=True: output_dir={a.output_dir!r} holds the checkpoints of "
                    f"{len(runs)} different runs ({listing}), and resuming the newest could continue another run "
                    "than the last one: pass the checkpoint to resume as resume_from_checkpoint='<path>', or "
                    "remove the other run's checkpoints")
            if complete:
                return self._resumable(complete[0])
            logger.info(f"no complete checkpoint in {a.output_dir}; starting from scratch")
            return None
        problem = ckpt.verify(resume) if os.path.isdir(resume) else "no such folder"
        if problem:
            raise ckpt.CheckpointError(f"resume_from_checkpoint={resume!r}: {problem}")
        return self._resumable(resume)

    @staticmethod
    def _resumable(folder: str) -> str:
        loop = ckpt.read_json(folder, "loop_state.json")
        if loop.get("save_only_model"):
            raise ckpt.CheckpointError(f"{folder} was written with save_only_model=True: it holds the model only (no "
                                       "optimizer, scheduler or RNG state) and cannot be resumed; load its weights "
                                       "(from_pretrained) to start a new run, or save without save_only_model")
        return folder

    def _load_checkpoint(self, folder: str) -> None:
        """Restore everything saved by _save_checkpoint but the data position (see _resume_skip)."""
        acc = self.accelerator
        if is_sharded(acc):
            load_shards(folder, self.model_wrapped, self.optimizer, self._is_peft())
        elif is_deepspeed(acc):  # every rank's partition, as DeepSpeed wants them all
            if zero_stage(acc) < 3:  # ZeRO-3 takes the parameters from its partitions
                self._load_model_weights(folder)
            load_zero_partitions(folder, self.optimizer, acc.num_processes, acc.process_index)
        else:
            self._load_model_weights(folder)
            self.optimizer.load_state_dict(ckpt.load_state(folder, "optimizer"))
        self.lr_scheduler.load_state_dict(ckpt.load_state(folder, "scheduler"))
        if acc.scaler is not None and os.path.exists(os.path.join(folder, "scaler.json")):
            acc.scaler.load_state_dict(ckpt.load_state(folder, "scaler"))
        saved = TrainerState.from_dict(ckpt.read_json(folder, "trainer_state.json"))
        s = self.state
        for name in ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
                     "best_global_step", "best_model_checkpoint", "stateful_callbacks"):
            setattr(s, name, getattr(saved, name))
        if self.args.restore_callback_states_from_checkpoint:
            missing = restore_callback_states(self.callback_handler.callbacks, s.stateful_callbacks)
            if missing:
                logger.warning(f"{folder} holds the state of callbacks {missing}, which this Trainer does not have; "
                               "their state is not restored")
        own = ckpt.load_state(folder, f"process_{acc.process_index}")
        _set_rng_state(own["rng"])
        self._restore_pending_log(own["pending_log"])


def _run_of(checkpoint: str) -> str | None:
    """The id of the run that wrote a checkpoint (None for one written before stoker recorded it)."""
    try:
        return ckpt.read_json(checkpoint, "loop_state.json").get("run_id")
    except (OSError, ValueError):
        return None


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _split_batch(batch: dict, rows: int) -> list[dict]:
    """Cut a micro-batch into pieces of `rows` rows: the batches a loader with that batch size yields, since a
    sampler's index order nests (batch i of 2n rows = batches 2i and 2i+1 of n rows)."""
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    return [{k: v[i:i + rows] if isinstance(v, torch.Tensor) and v.shape[:1] == first.shape[:1] else v
             for k, v in batch.items()} for i in range(0, first.shape[0], rows)]


def _eval_prediction(cls, values: dict, args):
    """An EvalPrediction with the inputs and losses that include_for_metrics asks for."""
    return cls(predictions=values.get("predictions"), label_ids=values.get("label_ids"),
               inputs=values.get("inputs") if "inputs" in args.include_for_metrics else None,
               losses=values.get("losses") if "loss" in args.include_for_metrics else None)


def _logits_of(outputs) -> torch.Tensor:
    """The logits of a model called without labels: a dict / ModelOutput's, or a tuple's first entry."""
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def _is_nested_tensors(value) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(_is_nested_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


def _nested(fn, value):
    """fn applied to every tensor of a tensor or a (nested) tuple of them."""
    if isinstance(value, (tuple, list)):
        return type(value)(_nested(fn, v) for v in value)
    return fn(value)


def _concat_padded(tensors: list, pad: int = -100):
    """Concatenate batches along dim 0, padding later dims to the largest (sequence lengths vary); batches of
    (nested) tuples give a tuple of arrays, as transformers' nested_concat does."""
    if not tensors:
        return None
    if isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(_concat_padded([t[i] for t in tensors], pad) for i in range(len(tensors[0])))
    if tensors[0].dim() == 0:
        return torch.stack(tensors).numpy()
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = torch.full((sum(t.shape[0] for t in tensors), *shape), pad, dtype=tensors[0].dtype)
    row = 0
    for t in tensors:
        out[(slice(row, row + t.shape[0]), *(slice(0, n) for n in t.shape[1:]))] = t
        row += t.shape[0]
    if out.dtype == torch.bfloat16:
        out = out.float()
    return out.numpy()
