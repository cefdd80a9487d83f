"""The Trainer: one managed training loop over an accelerate.Accelerator, steered by callbacks.

`Trainer._optimizer_step` is one optimizer step, top to bottom (accumulate, clip, check, update, record); the
loop's outline around it is told once, in docs/architecture.md ("The step"). One train() call is a `Run`
(stoker.run), the one owner of its state, built by `_start_run` and passed down; device placement, DDP, FSDP,
DeepSpeed and mixed precision are Accelerate's, behind a backend object that the loop calls without branching on
which one it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import math
import random
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from . import checkpoint_format as ckpt
from .arguments import TrainingArguments
from .background_save import BackgroundWriter
from .callbacks import (
    DEFAULT_CALLBACKS,
    CallbackHandler,
    JsonlLoggerCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
    integration_callbacks,
)
from .checkpointer import Checkpointer, resolve_resume, resume_settings, save_model
from .data import (
    ColumnFilter,
    HostCounting,
    PaddingCollator,
    build_dataloader,
    forward_columns,
)
from .diagnostics import peak_memory_metrics
from .distributed.accelerator import build_accelerator
from .distributed.backends import OptimizerSource, backend_for
from .distributed.context_parallel import SequenceSplit, split_multiple
from .distributed.deepspeed import non_embedding_parameters
from .distributed.parallelism import read_parallelism_config
from .errors import ConfigError, NonFiniteError, SpikeError, TrainingPreempted, exit_with_code_after_preemption
from .evaluation import (
    Collected,
    OutOfMemoryInEvaluation,
    agreeing_on_out_of_memory,
    eval_prediction,
    evaluating,
    evaluation_readers,
    genuine_rows,
    labels_of,
    predictions_of,
    split_batch,
)
from .float8 import use_float8
from .goodput import Ledger, furthest_step, summary_line
from .log import logger, set_log_levels, transformers_logger
from .lora import trainable_parameters, wrap
from .loss import (
    LabelSmoothing,
    LoadBalancing,
    LossConvention,
    count_targets,
    has_router_loss,
    loss_computation,
    loss_or_none,
    output_head,
    prefix_body,
)
from .memory_plan import async_save_line, rollback_line, start_of_training_line
from .optim import set_mode, steps_on_metric, updates_in_backward
from .outputs import EvalLoopOutput, PredictionOutput, TrainOutput, speed_metrics
from .packing import packed_train_set
from .report import ReportCallback
from .rollback import SpikeDetected, SpikeRollback
from .run import Run
from .sdpa_mask import answers_mask, unpadded_attention
from .step import (
    LogSums,
    LoopPosition,
    MicroBatchHalver,
    NonFinitePolicy,
    PendingStep,
    PreemptionSignals,
    StepCheck,
    neftune_noise,
    plan_steps,
    window_sizes,
)
from .trainer_checks import batch_problems, run_problems, trainer_input_problems
from .transformers_surface import TransformersSurface

# the hooks whose override makes the train batches or the loss (TRAIN_HOOKS), or the eval (EVAL_HOOKS) or test
# (PREDICT_HOOKS) batches, the loss or the evaluation itself: where a subclass overrides one, the first batch of
# that set is not checked against the model's forward, since what reaches the model is the override's business
TRAIN_HOOKS = ("get_train_dataloader", "compute_loss")
EVAL_HOOKS = ("get_eval_dataloader", "compute_loss", "prediction_step", "evaluation_loop", "evaluate")
PREDICT_HOOKS = ("get_test_dataloader", "compute_loss", "prediction_step", "evaluation_loop", "predict")


# whether the loss of the training_step in progress went through stoker's own compute_loss (and so is already the
# micro-batch's share of the window): a list the call marks, scoped to the one call rather than kept on the Trainer
_WINDOW_SHARES: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("stoker_window_shares",
                                                                                   default=None)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well


def _label_arguments(model) -> list[str]:
    from transformers.utils import find_labels

    return find_labels(type(model))


def _defining_class(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


def _unwrap_peft(model):
    return model.get_base_model() if ckpt.is_peft_model(model) else model


def offload_checkpointed_inputs(model, device: torch.device) -> None:
    """gradient_checkpointing_kwargs' offload: each checkpointed layer runs under torch's save_on_cpu, so that what
    the recompute keeps (a layer's inputs) waits in host memory: a copy to the host in the forward and back in the
    backward, for layers x tokens x hidden of device memory. transformers pins that memory on every host and fails
    where nothing can pin (a CPU-only host); here it is pinned only when the model lives on an accelerator, and on
    the CPU the hook keeps the tensors where they already are."""
    pin = device.type != "cpu"
    device_type = device.type if pin else "cpu"
    wrapped = 0
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)  # set by transformers' enable call
        if checkpoint is None or getattr(checkpoint, "offloads", False):
            continue

        def offloaded(function, *args, checkpoint=checkpoint, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device_type):
                return checkpoint(function, *args, **kwargs)

        offloaded.offloads = True
        module._gradient_checkpointing_func = offloaded
        wrapped += 1
    if not wrapped:
        raise ConfigError([f"gradient_checkpointing_kwargs offload=True: {type(model).__name__} checkpoints by its own "
                           f"means (no transformers checkpointing function on its layers), which stoker cannot move "
                           f"to the host; accepted: a transformers model, or offload left out"], "Trainer inputs")


class Trainer(TransformersSurface):
    """Trains, evaluates and predicts with a PyTorch model, with the constructor and methods of
    transformers.Trainer (a script written for it runs with the import changed).

    What it promises beyond that surface:

    - Exact gradient accumulation and data parallelism: B micro-batches x A accumulation steps x N processes
      give the update of one batch of B*A*N rows, for every model family (causal and masked LMs, classifiers,
      seq2seq, plain modules), because each micro-batch's loss is normalised over the target items of the
      whole window.
    - Exact resume: a run resumed from a checkpoint ends with the same parameters, optimizer state and logged
      losses as the run that was never stopped (float32 on CPU, bit for bit). Checkpoints are JSON and
      safetensors only, committed atomically; nothing is ever unpickled.
    - Preemption: on SIGTERM / SIGUSR1 the current step is finished, checkpointed, and train() raises
      TrainingPreempted (exit code 75).
    - Bad input (arguments, model, data, collator) is reported before any work, every problem at once, as a
      ConfigError; a dataset's rows on its first real batch, before the model sees it (the collator is never
      called for a check of its own).

    Override points, as in transformers: compute_loss, training_step, prediction_step, evaluation_loop,
    create_optimizer, create_scheduler, get_train_dataloader, get_eval_dataloader, log.
    """

    # transformers' switch for an override of compute_loss that computes its own loss: True when it returns its
    # share of the window (divided by num_items_in_batch), False when it returns a mean over its micro-batch
    # (training_step then weighs it by the micro-batch's share of the window's items); None decides as
    # transformers does, from whether the model takes loss kwargs (`model_accepts_loss_kwargs`)
    loss_is_scaled_for_ga: bool | None = None

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
        self.args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")  # transformers' choice
        self._memory = None  # transformers' TrainerMemoryTracker, with skip_memory_metrics=False
        memory = self._memory_tracker()
        if memory is not None:  # its first stage, "init", is reported with the first train/eval/test metrics
            memory.start()
        self.model_init = model_init
        if (model is None) == (model_init is None):
            raise ConfigError(["model, model_init: pass one of them, a model or a function returning a fresh one "
                               "(`Trainer` requires either a `model` or `model_init` argument"
                               + (")" if model is None else ", but not both)")], "Trainer")
        self._seed()  # as transformers, full_determinism included: model_init's weights follow the seed
        if model is None:
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
            self.train_dataset, self._given_collator = packed_train_set(
                self.args, model, self.train_dataset, data_collator, self._pad_token_id(), self._forward_kwargs)
            self._set_collator(_unwrap_peft(model))
        problems = trainer_input_problems(self.args, model, optimizers, self.train_dataset, self.eval_dataset,
                                          self.compute_loss_func)
        if problems:
            raise ConfigError(problems, "Trainer inputs")

        self._given_optimizers = optimizers  # built anew by each train() call unless given here
        use_float8(model, self.args)  # fp8: linear layers to torchao's Float8Linear, before Accelerate wraps them
        self._build_accelerator(model)
        set_log_levels(self.args)
        if self.args.gpu_default_notice and self.accelerator.is_main_process:  # bf16 / TF32 chosen for the script
            logger.info(self.args.gpu_default_notice)
        self._enable_gradient_checkpointing(model)
        self.model = model
        self.model_wrapped = model  # the prepared (DDP/compiled) model once training starts
        self.current_flos = 0  # FLOPs since the last store_flos (transformers' estimate)
        self.is_in_train = False
        self._initial_num_input_tokens_seen = 0  # when this train() call started (transformers' name)
        self.optimizer, self.lr_scheduler = optimizers
        self._trial, self._flops_model, self._flops_parameters = None, None, None  # empty at first
        self._ray_report = None
        # what get_train_dataloader batches by (as transformers): the micro-batch, which auto_find_batch_size halves
        self._train_batch_size = self.args.per_device_train_batch_size
        self._answers_mask = False  # whether the forwards answer sdpa's mask from the host (set as a run starts)
        self._eval_batch_size = self.args.per_device_eval_batch_size  # halved on OOM (auto_find_batch_size)
        self._eval_dataloaders = {}  # with dataloader_persistent_workers: "eval" or a set's name -> its loader
        # the evaluation sets whose first batch has been checked against the model (by id)
        self._rows_checked = set()

        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        # as transformers: its defaults and the trackers, the callbacks given, then the progress display;
        # metrics.jsonl is written by a writer the handler keeps outside that list (the list a script sees,
        # edits and compares is transformers')
        defaults = [*DEFAULT_CALLBACKS, *integration_callbacks(self.args.report_to)]
        if self.args.training_report:
            defaults.append(ReportCallback())
        self.callback_handler = CallbackHandler(defaults + list(callbacks or []), self.model, self.processing_class,
                                                self.optimizer, self.lr_scheduler, writers=[JsonlLoggerCallback()])
        self.callback_handler.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        self._fire("on_init_end")
        if memory is not None:
            memory.stop_and_update_metrics()

    # ------------------------------------------------------------------------------------------
    # set-up

    def _build_accelerator(self, model=None) -> None:
        # built again in a Ray worker for a search trial's arguments (an Accelerator belongs to its process)
        self.accelerator = build_accelerator(self.args, model, self._given_optimizers)
        self._backend = backend_for(self.accelerator, self.args)
        # context parallelism (parallelism_config cp_size > 1): how each micro-batch's sequence is split
        config = self.accelerator.parallelism_config
        self._sequence_split = SequenceSplit(self.accelerator) if config is not None and config.cp_size > 1 else None
        # async_save's writer: one checkpoint in flight at most, which save_model waits for as the run's end does
        self._checkpoint_writer = BackgroundWriter(self.accelerator)

    def _set_up_model(self, model):
        """What depends on the model (its loss convention, forward's columns, LoRA, debug hooks); run again for
        each fresh model from model_init. Returns the model to train (the peft model with peft_config)."""
        a = self.args
        if self._peft_config is not None:
            model = wrap(model, self._peft_config, a.gradient_checkpointing)
        base = _unwrap_peft(model)
        if "underflow_overflow" in a.debug:
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(base)
        self._is_transformers = hasattr(base, "config")
        # transformers' attribute (its rule, read by subclasses): whether forward takes **kwargs, through which a
        # loss of the model's own would receive num_items_in_batch
        self.model_accepts_loss_kwargs = getattr(base, "accepts_loss_kwargs", None)
        if self.model_accepts_loss_kwargs is None:
            self.model_accepts_loss_kwargs = any(p.kind == p.VAR_KEYWORD
                                                 for p in inspect.signature(base.forward).parameters.values())
        # whether a loss-only evaluation with use_liger_kernel hands forward skip_logits=True (prediction_step)
        self._takes_skip_logits = (self._is_transformers or self.model_accepts_loss_kwargs
                                   or "skip_logits" in forward_columns(base))
        label_smoothing = a.label_smoothing_factor
        if label_smoothing and getattr(getattr(base, "config", None), "problem_type",
                                                None) == "multi_label_classification":
            # as transformers: a warning, and the run trains on the model's own multi-label loss
            warnings.warn(f"Label smoothing is not compatible with multi-label classification: "
                          f"label_smoothing_factor={a.label_smoothing_factor} is ignored for this "
                          f"{type(base).__name__} (problem_type='multi_label_classification')", UserWarning,
                          stacklevel=3)
            label_smoothing = 0.0
        # transformers' attribute, kept because an override of compute_loss calls it as transformers' does (and
        # tests/parity checks it): the one smoother, which stoker's own loss sums over the window (stoker.loss)
        self.label_smoother = LabelSmoothing(label_smoothing) if label_smoothing else None
        # as transformers: the forward arguments named like labels (start_positions and end_positions for
        # question answering)
        self.label_names = a.label_names or (_label_arguments(base) if self._is_transformers else None) or ["labels"]
        # a KV cache is wasted memory in a loss forward, and while one exists transformers ignores the
        # position_ids of packed rows (stoker.packing) and lets their sequences attend to each other
        self._forward_kwargs = {"use_cache": a.use_cache} if "use_cache" in forward_columns(base) else {}
        chunked_head = output_head(model) if a.chunked_loss else None
        # a MoE model's load-balancing loss, weighed over moe_aux_loss_scope (stoker.loss.load_balancing); the probes
        # of its loss convention see the task loss alone, which a per-micro-batch aux term would blur
        balancing = (LoadBalancing(base, a.moe_aux_loss_scope, self.label_names, self._forward_kwargs)
                     if has_router_loss(base) else None)
        probe_kwargs = {**self._forward_kwargs, **({"output_router_logits": False} if balancing is not None else {})}
        self._convention = LossConvention(model, base, self.label_names[0], probe_kwargs,
                                          loss_func=self.compute_loss_func is not None,
                                          chunked=chunked_head is not None)
        # global_batch's routing pass, run before each window's first backward (None: no pass)
        self._window_routing = balancing if balancing is not None and balancing.routes_windows else None
        # how compute_loss computes the loss, decided here once (stoker.loss.computation)
        self._loss = loss_computation(self._convention, self._forward_kwargs, chunked_head=chunked_head,
                                      compute_loss_func=self.compute_loss_func, smoother=self.label_smoother,
                                      base_model=base, prefix_body=prefix_body(model) if a.shared_prefix else None,
                                      balancing=balancing, fused_loss=a.use_liger_kernel)
        self._set_collator(base)
        return model

    def _set_collator(self, base) -> None:
        # under context parallelism, rows padded to a length the sequence splits into (split_multiple)
        self.data_collator = self._given_collator or PaddingCollator(
            self._pad_token_id(), split_multiple(read_parallelism_config(self.args.parallelism_config)[0]),
            always_mask=hasattr(base, "config") and "attention_mask" in forward_columns(base))
        if self.args.remove_unused_columns and hasattr(base, "config"):
            self.data_collator = ColumnFilter(self.data_collator, forward_columns(base) | set(self.label_names))

    def _enable_gradient_checkpointing(self, model) -> None:
        if not self.args.gradient_checkpointing:
            return
        # as transformers (5.17+): every_n_layers picks the layers and offload where their saved inputs live; the
        # other keys go to torch.utils.checkpoint, which would take those two for forward's arguments
        kwargs = {"use_reentrant": False, **(self.args.gradient_checkpointing_kwargs or {})}
        layers = {"every_n_layers": kwargs.pop("every_n_layers")} if "every_n_layers" in kwargs else {}
        offload = kwargs.pop("offload", False)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **layers)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **layers)
        if offload:
            offload_checkpointed_inputs(model, self.accelerator.device)
        config = getattr(_unwrap_peft(model), "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # a KV cache is useless in training and conflicts with recomputation

    def _pad_token_id(self) -> int:
        pad = getattr(self.processing_class, "pad_token_id", None)
        return pad if pad is not None else 0

    def add_callback(self, callback) -> None:
        """Register a callback (an instance, or a class to instantiate); its events fire from now on."""
        self.callback_handler.add_callback(callback)

    def remove_callback(self, callback) -> None:
        """Unregister a callback (the instance, or the first callback of a class), as transformers: an instance that
        is not registered raises ValueError."""
        self.callback_handler.remove_callback(callback)

    def pop_callback(self, callback):
        """Unregister a callback and return it (None if it was not registered)."""
        return self.callback_handler.pop_callback(callback)

    def _fire(self, event: str, **kwargs) -> None:
        """Fire `event` through the handler, which hands every callback its model, optimizer, schedule and loaders
        (a subclass calling self.callback_handler.on_<event> fires the same). A control a callback returns of its
        own has its flags taken into the Trainer's, the one the run holds."""
        control = self.callback_handler.fire(event, self.args, self.state, self.control, **kwargs)
        if control is not self.control:
            vars(self.control).update(vars(control))

    # ------------------------------------------------------------------------------------------
    # loss

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """The micro-batch's share of the window loss: sum of its item losses / num_items_in_batch.

        How is decided once per model (stoker.loss.computation): a model whose forward divides by a
        num_items_in_batch it is given (as LossConvention finds out) receives it; any other returns a mean over
        its own items, which is rescaled by local items / window items, so that B x A micro-batches give exactly
        the update of one batch of B*A. compute_loss_func, label_smoothing_factor and chunked_loss (a causal LM's
        loss from its hidden states, unless the caller asks for the outputs: an evaluation that keeps its
        predictions needs the logits) each replace the model's loss; with shared_prefix, a training micro-batch's
        common leading tokens are run once (stoker.loss.prefix).
        """
        loss, outputs = self._loss(model, inputs, self.accelerator, num_items_in_batch, return_outputs)
        shares = _WINDOW_SHARES.get()
        if shares is not None:  # inside training_step: an override that calls this returns (a change of) the share
            shares.append(True)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------------------------------
    # training

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The training loader without its first `num_batches` micro-batches, for an epoch resumed part-way
        (transformers' hook: Accelerate's skip_first_batches skips them in the sampler, so none is loaded). A
        subclass with a stateful or streaming loader overrides it."""
        return self.accelerator.skip_first_batches(dataloader, num_batches)

    def get_train_dataloader(self):
        """The training DataLoader, prepared by Accelerate as transformers returns it (sharded over the processes,
        `total_batch_size` rows per step of all of them): micro-batches of the current size (halved by
        auto_find_batch_size), shuffled by data_seed (or grouped by length), collated by data_collator. Override
        to change how batches are made; a loader the override returns unprepared is prepared by the loop, and
        one that is not a DataLoader (any iterable with a length) is read as it is."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset (or a get_train_dataloader that builds "
                             "its own loader)")
        # counted on the host before the copy to the device: what the chunked loss, the shared prefix and sdpa's
        # choice of the causal kernel (stoker.sdpa_mask) would otherwise read back from the device
        collator = self.data_collator
        if self.args.chunked_loss or self.args.shared_prefix or self._answers_mask:
            collator = HostCounting(collator, self.label_names[0])
        # under sequence parallelism, this rank's slice of each row (the ranks of a group read the same rows)
        collator = self.accelerator.training_collator(collator, self.label_names[0])
        loader = build_dataloader(self.train_dataset, self.args, self._train_batch_size, collator, train=True)
        return self.accelerator.prepare(loader)

    def _prepared(self, loader):
        """`loader` prepared by Accelerate unless it already is (or is no DataLoader at all)."""
        if isinstance(loader, torch.utils.data.DataLoader) and not isinstance(loader, DataLoaderStateMixin):
            return self.accelerator.prepare(loader)
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        """The prepared evaluation DataLoader of `eval_dataset` (a dataset, a name in the Trainer's dict of them,
        or None for the Trainer's own), in order, per_device_eval_batch_size rows per process. With
        dataloader_persistent_workers the loader of the Trainer's own set, or of each named one, is built once
        and reused, as transformers does, so its workers live across evaluations; the Trainer's own set passed in
        gets that loader too (another set passed in gets its own: transformers would return the kept one)."""
        own = eval_dataset is None or eval_dataset is self.eval_dataset
        key = eval_dataset if isinstance(eval_dataset, str) else "eval" if own else None
        if key is not None and key in self._eval_dataloaders:
            return self._eval_dataloaders[key]
        if isinstance(eval_dataset, str):  # a name in the Trainer's dict of evaluation sets
            eval_dataset = self.eval_dataset[eval_dataset]
        loader = self._evaluation_loader(eval_dataset if eval_dataset is not None else self.eval_dataset)
        if key is not None and self.args.dataloader_persistent_workers:
            self._eval_dataloaders[key] = loader
        return loader

    def _evaluation_loader(self, dataset):
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        loader = build_dataloader(dataset, self.args, self._eval_batch_size, self.data_collator, train=False)
        return self.accelerator.prepare(loader)

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
        self._hp_search_setup(trial)  # a search trial's arguments
        self.is_in_train = True
        try:
            return self._inner_training_loop(resume_from_checkpoint, trial, ignore_keys_for_eval, memory)
        finally:
            self.is_in_train = False

    # named as transformers names it: its memory tracker recognises the stage by the caller's name
    def _inner_training_loop(self, resume_from_checkpoint, trial, ignore_keys_for_eval, memory):
        """One run: set up (`_start_run`), the loop, the run's metrics."""
        a = self.args
        ledger = Ledger()  # where the wall time of the call goes, from here (stoker.goodput)
        run = self._start_run(resolve_resume(resume_from_checkpoint, a), trial, ignore_keys_for_eval, ledger)
        s = self.state
        self._fire("on_train_begin")
        if a.eval_on_start and not run.resumed:
            with ledger.phase("evaluation"):
                self._evaluate_and_track(run)
            if self._ray_report is not None:
                self._report_to_ray(None)

        started, first_step, preempted = time.perf_counter(), s.global_step, None
        run.started, self._initial_num_input_tokens_seen = time.time(), s.num_input_tokens_seen
        embeddings = (_unwrap_peft(self.accelerator.unwrap_model(self.model)).get_input_embeddings()
                      if a.neftune_noise_alpha else None)
        with run.signals, run.checkpointer.background_writes(), neftune_noise(embeddings, a.neftune_noise_alpha):
            # resumed from the run's last checkpoint (the same script run again): nothing is left to do
            if s.global_step < s.max_steps:
                preempted = self._train_loop(run)
            with ledger.phase("checkpoint"):  # the loop waits for the last checkpoint's write (async_save)
                run.checkpointer.writer.finish()
        ledger.end_steps()
        if preempted is not None:
            if self.accelerator.num_processes > 1:  # every rank has its share of the checkpoint once all are here
                self.accelerator.wait_for_everyone()
                exit_with_code_after_preemption()
            raise TrainingPreempted(preempted, s.global_step)
        return self._finalize_training(run, time.perf_counter() - started, s.global_step - first_step, memory)

    def _overridden(self, hooks: tuple[str, ...]) -> list[str]:
        """Those of `hooks` that a class outside stoker defines (stoker's own Seq2SeqTrainer overrides none)."""
        return [m for m in hooks if _defining_class(type(self), m).__module__.split(".")[0] != "stoker"]

    def _start_run(self, resume_dir: str | None, trial, ignore_keys_for_eval, ledger: Ledger) -> Run:
        """Everything before the first step: fresh state, the run's problems refused all at once (run_problems),
        the model, optimizer and schedule prepared by the backend, the checkpoint resumed from (counted in the
        ledger as resume); returns the run, the one owner of its state (stoker.run)."""
        a, acc = self.args, self.accelerator
        self._backend.check_new_run()
        pos = LoopPosition(epoch=0, batches=0, micro_batch=a.per_device_train_batch_size,
                           accumulation=a.gradient_accumulation_steps)
        dataset_len = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        # refused before anything of the run is set up; may adopt the micro-batch auto_find_batch_size settled on
        with ledger.phase("resume") if resume_dir else contextlib.nullcontext():
            loop = resume_settings(resume_dir, self._backend, a, dataset_len, pos) if resume_dir else None
        # every train() call is a run of its own: fresh state, controls and (unless given) optimizer/schedule
        s = self.state = TrainerState(is_local_process_zero=acc.is_local_main_process,
                                      is_world_process_zero=acc.is_main_process)
        if trial is not None:
            s.is_hyper_param_search = True
            s.trial_params = dict(getattr(trial, "params", trial))
            s.trial_name = self._trial_id(trial)
        self.control = TrainerControl()
        self.optimizer, self.lr_scheduler = self._given_optimizers  # what create_optimizer builds on
        self.current_flos = 0
        self._seed()
        # the shuffle of this run: args.seed (and so a data_seed not given) may have changed since the Accelerator
        # was built (a script setting args.seed, a hyperparameter trial's arguments)
        acc.dataloader_config.data_seed = a.data_seed
        # every run prepares against a clean Accelerator: it would keep the last run's model, optimizer and loaders
        # in its lists, and with fp16 unscale_gradients() unscales every optimizer listed (the gradients divided by
        # the scale once per run, or an error for the same optimizer given twice); with model_init, the model the
        # constructor built goes too. The cost, a garbage collection, is paid only where there is something to free
        if self._backend.runs or self.model_init is not None:
            acc.free_memory()
        if self.model_init is not None:  # as transformers: a fresh model for every train() call
            model = self._set_up_model(self.call_model_init(trial))
            self._enable_gradient_checkpointing(model)
            self.model = self.model_wrapped = model
        # whether this model's forwards answer sdpa's mask from rows the host counted (the loader counts them)
        self._answers_mask = answers_mask(_unwrap_peft(self.model), a, acc.device)
        run_id = (loop or {}).get("run_id") or uuid.uuid4().hex  # a resumed run continues its checkpoint's id
        rollback = self._spike_rollback(loop, run_id)
        loader = self._train_loader(pos.micro_batch, rollback)
        problems = run_problems(a, self.model, self.train_dataset, acc, loader, rollback)
        if problems:
            raise ConfigError(problems, "Trainer")
        if a.use_liger_kernel:
            self._apply_liger_kernel()
        checkpointer = Checkpointer(a, self._backend, run_id, dataset_len, self._checkpoint_writer)
        # planned over the prepared loader: sharded over the processes, its length is the micro-batches of one
        # process, which is what the number of steps (and so the schedule) must be planned from, over every row
        max_steps, per_epoch = plan_steps(loader, pos.accumulation, a)
        if loop is not None and per_epoch:
            max_steps = checkpointer.replanned_steps(resume_dir, loop, pos, len(loader), per_epoch) or max_steps
        trainable, total = trainable_parameters(self.model)  # before FSDP makes them shards
        # no float32 copy of the logits where stoker computes the loss (a compute_loss_func, or a compute_loss of
        # a subclass, gets them in float32, as from transformers.Trainer)
        half_outputs = self.compute_loss_func is None and not self._overridden(("compute_loss",))
        self.model_wrapped, self.optimizer, self.lr_scheduler = self._backend.prepare(
            self.model, OptimizerSource(*self._given_optimizers, self._build_optimizer_and_scheduler,
                                        self.create_optimizer), max_steps, half_outputs)

        handler = self.callback_handler  # what callbacks receive from now on (as transformers updates them here)
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        for writer in handler.writers:  # metrics.jsonl's records name their run (goodput.furthest_step reads them)
            writer.run_id = run_id
        s.max_steps, s.train_batch_size = max_steps, pos.micro_batch
        s.num_train_epochs = math.ceil(max_steps / per_epoch) if per_epoch else sys.maxsize
        s.compute_steps(a, max_steps)
        run = Run(model=self.model_wrapped, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, accelerator=acc,
                  state=s, control=self.control, callbacks=handler.callbacks, position=pos,
                  log=LogSums(acc.device, counts_pairs=acc.device.type == "cuda"),  # MFU's term: GPU only
                  checkpointer=checkpointer, train_dataloader=loader, steps_per_epoch=per_epoch,
                  halver=MicroBatchHalver(a.auto_find_batch_size, pos, s, acc, self._backend),
                  nonfinite=NonFinitePolicy(a, self._backend),
                  # the step's check, deferred to the next step where a non-finite update can be skipped on the device
                  check=StepCheck(acc, self._backend.skips_on_device(self.optimizer),
                                  not self._backend.scaler_handles_inf(), a.spike_rollback,
                                  a.average_tokens_across_devices),
                  schedule_per_step=not self._steps_on_metric(), signals=PreemptionSignals(a.save_on_signal),
                  resumed=resume_dir is not None, rollback=rollback, ignore_keys_for_eval=ignore_keys_for_eval,
                  ledger=ledger)
        if resume_dir is not None:
            with ledger.phase("resume"):
                checkpointer.restore(resume_dir, loop, run, pos)
            # the steps an earlier run of this run reached past the checkpoint are redone: counted as recomputed
            ledger.recompute_until = furthest_step(a.output_dir, run_id)
            if per_epoch:  # the epochs still needed from here: the planned number, unless the run was resumed with
                # another world size or batch (resume_mismatch='warn'), where epochs hold another number of steps
                left = len(window_sizes(max(len(loader) - pos.batches, 0), pos.accumulation))
                s.num_train_epochs = pos.epoch + 1 + max(math.ceil((max_steps - s.global_step - left) / per_epoch), 0)
        self._log_run_start(trainable, total, loader)
        if s.is_world_process_zero:
            checkpointer.open_output_dir()
        return run

    def _spike_rollback(self, loop: dict | None, run_id: str) -> SpikeRollback | None:
        """The run's spike rollback (stoker.rollback), or, without spike_rollback, the rows a resumed run keeps
        skipping: those its checkpoint quarantined and those its run recorded in quarantine.jsonl after it (a
        crash between a rollback and the next checkpoint). None where there is neither."""
        a = self.args
        quarantined = set((loop or {}).get("quarantine", []))
        if loop is not None:
            quarantined.update(i for r in SpikeRollback.recorded(a.output_dir, run_id) for i in r["indices"])
        if not (a.spike_rollback or quarantined):
            return None
        return SpikeRollback(a, self.accelerator, run_id, quarantined, (loop or {}).get("spike_losses", []),
                             getattr(self.train_dataset, "sources", None))

    def _log_run_start(self, trainable: int, total: int, loader) -> None:
        """transformers' header, then what the run will take: its trainable parameters, memory plan, the spike
        rollback's and async_save's host memory."""
        a, s, acc = self.args, self.state, self.accelerator
        self._log_training_header(trainable, loader)
        if not s.is_world_process_zero:
            return
        if a.spike_rollback:
            level, line = rollback_line(self.model, a, acc.num_processes, parallelism=acc.parallelism_config)
            getattr(logger, level)(line)
        logger.info(f"{type(self.model).__name__}: {trainable:,} trainable parameters of {total:,} "
                    f"({100 * trainable / max(total, 1):.2f}%)")
        if self._convention.causal:  # what memory this run should take (stoker.memory_plan), before it takes it
            logger.info(start_of_training_line(self.model, a, self.train_dataset, acc.num_processes,
                                               acc.parallelism_config))
        if a.async_save:
            logger.info(async_save_line(self.model, a, acc.num_processes, acc.parallelism_config))

    def _train_loader(self, micro_batch: int, rollback: SpikeRollback | None):
        """The prepared training loader of `micro_batch` rows per process (get_train_dataloader batches by
        _train_batch_size, as transformers'), skipping the quarantined rows where the run has any."""
        self._train_batch_size = self.state.train_batch_size = micro_batch
        loader = self.callback_handler.train_dataloader = self._prepared(self.get_train_dataloader())
        if rollback is not None:
            rollback.install(loader)
        return loader

    def _build_optimizer_and_scheduler(self, model, steps: int) -> tuple:
        """What a backend calls when it needs the run's optimizer and schedule built (transformers' hooks, which a
        subclass may override, build what was not given)."""
        self.create_optimizer_and_scheduler(steps, model)
        return self.optimizer, self.lr_scheduler

    def _apply_liger_kernel(self) -> None:
        """Patch the model with Liger's kernels, as transformers does when training starts (evaluation alone needs
        no package; run_problems has refused a run that cannot have them)."""
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        base = _unwrap_peft(self.model)
        if self._is_transformers:
            _apply_liger_kernel_to_instance(model=base, **(self.args.liger_kernel_config or {}))
        else:
            logger.warning(f"use_liger_kernel=True: {type(base).__name__} is not a transformers model; no Liger "
                           "kernel is applied")

    def _log_training_header(self, trainable: int, loader) -> None:
        """transformers' "***** Running training *****" lines, in its words and on its trainer logger, so that
        what a script or test captures from that logger at log_level='info' is the same."""
        a, s = self.args, self.state
        epochs, per_epoch, examples = self.set_initial_training_values(a, loader)[:3]
        for line in ("***** Running training *****", f"  Num examples = {examples:,}",
                     f"  Num Epochs = {epochs:,}", f"  Num update steps per epoch = {per_epoch:,}",
                     f"  Instantaneous batch size per device = {a.per_device_train_batch_size:,}",
                     "  Total train batch size (w. parallel, distributed & accumulation) = "
                     f"{self.get_total_train_batch_size():,}",
                     f"  Gradient Accumulation steps = {a.gradient_accumulation_steps}",
                     f"  Total optimization steps = {s.max_steps:,}",
                     f"  Number of trainable parameters = {trainable:,}"):
            transformers_logger.info(line)

    def _finalize_training(self, run: Run, runtime: float, steps_run: int, memory) -> TrainOutput:
        """The run's metrics (over the whole run, a resumed one included: the losses before the checkpoint came
        back with it), the best model loaded back if asked for, on_train_end."""
        a, s, log = self.args, self.state, run.log
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(log.samples_seen / runtime, 3),
            "train_steps_per_second": round(max(steps_run, 1) / runtime, 3),
            "train_loss": log.total_loss / max(s.global_step - log.nonfinite_total, 1),
        }
        diagnostics = {"train_tokens_per_second": round(log.tokens_seen / runtime, 3),
                       **peak_memory_metrics(self.accelerator.device)}
        self.store_flos()
        metrics["total_flos"] = s.total_flos
        if a.load_best_model_at_end and s.best_model_checkpoint:
            self._backend.load_weights(s.best_model_checkpoint, self.model_wrapped)
            if s.is_world_process_zero:
                logger.info(f"loaded the best model, {s.best_model_checkpoint} ({a.metric_for_best_model}="
                            f"{s.best_metric})")
        run.checkpointer.keep_only_best(s.best_model_checkpoint)
        if memory is not None:
            memory.stop_and_update_metrics(metrics)
        # the ledger, and spike_rollback's counts (quarantine.jsonl names the rows), are train()'s metrics and the
        # final record's diagnostics (metrics.jsonl, the report); the logged record keeps transformers' keys alone
        ledger = run.ledger.finish()
        if run.rollback is not None:
            ledger.update(rollbacks=run.rollback.rollbacks, quarantined_rows=len(run.rollback.quarantined))
        diagnostics.update(ledger)
        if s.is_world_process_zero:
            logger.info(summary_line(diagnostics))
        self._log(metrics, None, diagnostics)
        self._fire("on_train_end")
        return TrainOutput(s.global_step, metrics["train_loss"], {**metrics, **ledger})

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

    def _train_loop(self, run: Run) -> int | None:
        """The epochs from the run's position on, rolled back to the last snapshot on a spike (spike_rollback);
        returns the signal that preempted the run, or None."""
        log, rollback = run.log, run.rollback
        self.model_wrapped.train()
        log.restart_clock()
        run.ledger.begin_steps(self.state.global_step, log.data_clock)
        if rollback is not None and rollback.enabled:
            self._snapshot(run)
        try:
            while True:
                try:
                    preempted = self._epochs(run)
                    break
                except SpikeDetected as spike:
                    self._roll_back(run, spike)
        finally:
            if rollback is not None:
                rollback.release()
        if log.steps:  # loss and tokens of steps after the last log
            log.total_loss += log.reduce_loss(self.accelerator, self.args.average_tokens_across_devices)
        seen = log.fold_tokens(self.accelerator, self.args.include_num_input_tokens_seen)[2]
        self.state.num_input_tokens_seen += seen
        return preempted

    def _snapshot(self, run: Run) -> None:
        """spike_rollback: snapshot the run as it stands after the current step (its verdict read first, the FLOPs
        counted so far folded into the state, which the snapshot holds)."""
        with run.ledger.phase("rollback"):  # the cost of being able to roll back
            self._apply_pending_verdict(run)
            self.store_flos()
            run.rollback.snapshot(run, run.ledger.mark())

    def _roll_back(self, run: Run, spike: SpikeDetected) -> None:
        """A spike: its window's rows quarantined and recorded, the run put back to its last snapshot (every process
        does the same). After max_rollbacks, the snapshot's state is checkpointed and SpikeError raised."""
        rollback = run.rollback
        with run.ledger.phase("rollback"):
            record = rollback.quarantine(spike)
            snapshot = rollback.restore(run)
        run.ledger.rolled_back(snapshot.ledger_mark)  # the steps since the snapshot are lost
        self.current_flos = 0  # counted since the snapshot, which folded the count before it into the state
        if self.accelerator.is_main_process:
            logger.warning(rollback.describe(record))
        if rollback.rollbacks > self.args.max_rollbacks:
            path = self._save_checkpoint(run)
            raise SpikeError(f"{rollback.describe(record)}: more than max_rollbacks={self.args.max_rollbacks} "
                             f"rollbacks, stopping; {path} holds the last good state with the spike's rows "
                             f"quarantined (resume from it to go on without them, or raise max_rollbacks or "
                             f"spike_factor)")

    def _epochs(self, run: Run) -> int | None:
        """The epochs from the run's position on; returns the signal that preempted the run, or None."""
        s, pos = self.state, run.position
        model = self.model_wrapped
        preempted = None
        for epoch in range(pos.epoch, s.num_train_epochs):
            pos.epoch = epoch
            self._fire("on_epoch_begin")
            windows = self._windows(run)
            first = self._first_window(windows, run)
            if first is not None:
                for window in itertools.chain([first], windows):
                    preempted = self._optimizer_step(model, window, run)
                    if s.global_step == run.ledger.recompute_until:  # the steps an earlier run reached are redone
                        run.ledger.caught_up()
                    # read anew after every event: a callback may return a TrainerControl of its own, which then
                    # replaces self.control (as in transformers)
                    if self.control.should_epoch_stop or self.control.should_training_stop:
                        break
            self._apply_pending_verdict(run)  # the last step's, before the epoch's events see the state
            if run.steps_per_epoch and pos.batches >= len(run.train_dataloader):
                s.epoch = pos.epoch + 1
            self._fire("on_epoch_end")
            self._maybe_log_save_evaluate(run)
            pos.batches, self.control.should_epoch_stop = 0, False
            if self.control.should_training_stop or s.global_step >= s.max_steps:
                break
        return preempted

    def _optimizer_step(self, model, window: list[dict], run: Run) -> int | None:
        """One optimizer step: accumulate, clip, check, update, record; returns the signal that preempts the run."""
        a, s, acc, pos, check = self.args, self.state, self.accelerator, run.position, run.check
        self._fire("on_step_begin")
        # accumulate: forward and backward of every micro-batch; out of memory reruns the same samples halved
        window, window_loss = self._accumulate(model, window, run)
        for batch in window:
            run.log.count(batch, acc.data_parallel_size)
            self.current_flos += float(self.floating_point_ops(batch))
        if run.rollback is not None:  # the window's rows, named if its verdict is a spike
            run.rollback.window(s.global_step + 1, pos, len(window))
        pos.batches += len(window)
        # clip: with max_grad_norm=0 this only measures the norm (the check needs it); a DTensor's is made whole
        grad_norm = acc.clip_grad_norm_(model.parameters(), a.max_grad_norm or math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # check: deferred, the previous step's verdict is read and recorded only now that this step's work is queued
        if (previous := self._verdict(run)) is not None:
            self._record(run, *previous, applied=previous[1])
        skip = check.queue(window_loss, grad_norm, s.global_step + 1, self._learning_rate(), run.signals.received)
        # synchronous, this step's verdict is read now (one host sync) and a non-finite update never runs; deferred,
        # the update is queued with the flag that skips it on the device (`skip`)
        verdict = None if check.deferred else self._verdict(run)
        if applied := verdict is None or verdict[1]:
            self._fire("on_pre_optimizer_step")
            applied = self._backend.optimizer_step(self.optimizer, skip)  # False: fp16 loss scaling skipped it
            self._fire("on_optimizer_step")
        if verdict is not None:  # record: synchronous, now; deferred, at the next step's check
            self._record(run, *verdict, applied=applied)
        self.optimizer.zero_grad(set_to_none=True)
        s.global_step += 1
        s.epoch = pos.epoch + (pos.batches / len(run.train_dataloader) if run.steps_per_epoch else 0)
        # out of memory in a callback: the windows from the next on are halved
        with run.halver.after_update() if run.halver.enabled else contextlib.nullcontext():
            self._fire("on_step_end")
        # alone, a process acts on a signal as soon as the step is done; several act on the one they agreed on
        preempted = run.signals.received if acc.num_processes == 1 else check.preempted
        if preempted:  # checkpoint this step, then leave
            self.control.should_save = self.control.should_training_stop = True
        self._maybe_log_save_evaluate(run)
        return preempted

    def _verdict(self, run: Run) -> tuple[PendingStep, bool] | None:
        """The step whose check is pending and whether its update may run (None when no step is pending): the
        check's flags read from their host copy, then the spike rollback's say (SpikeDetected) and the non-finite
        policy's (a skip warned about and counted, or NonFiniteError)."""
        taken = run.check.take(run.signals.received)
        if taken is None:
            return None
        pending, verdict = taken
        if run.rollback is not None and run.rollback.enabled:  # a spike (or a non-finite step) rolls the run back
            run.rollback.check_loss(pending.step, verdict.loss, verdict.finite)
        if not verdict.finite and updates_in_backward(self.optimizer):
            raise NonFiniteError(f"non-finite loss or gradient norm at step {pending.step}; optim={self.args.optim!r} "
                                 "has applied the update inside the backward, where it cannot be skipped: stopping")
        allowed = verdict.finite or run.nonfinite.allows(verdict, run.log, pending.loss, pending.grad_norm,
                                                         pending.step, self.accelerator.process_index)
        if verdict.finite:
            run.log.nonfinite_run = 0  # a finite step ends a run of non-finite ones
        return pending, allowed

    def _record(self, run: Run, pending: PendingStep, allowed: bool, applied: bool) -> None:
        """A step whose verdict is known, in the log and the schedule: its loss, gradient norm and learning rate
        logged and the schedule stepped where its update was applied (a plateau schedule steps after evaluation);
        a skipped one logged as such (unless logging_nan_inf_filter) and, synchronous, the fp16 scaler told."""
        if allowed:
            run.log.add_step(pending.loss, pending.grad_norm, pending.learning_rate)
            if applied and run.schedule_per_step:
                self.lr_scheduler.step()
            return
        if not run.check.deferred:
            self._backend.step_skipped()  # the fp16 scaler, which unscaled this step's gradients, sees it end
        if not self.args.logging_nan_inf_filter:  # the update is still skipped; only the log shows it
            run.log.add_step(pending.loss)

    def _apply_pending_verdict(self, run: Run) -> None:
        """Before anything looks at the state (a log, an evaluation, a save, a snapshot, an epoch's end): the
        verdict of a deferred step read and recorded, so that what it sees is what the synchronous check would
        have left."""
        decided = self._verdict(run)
        if decided is not None:
            self._record(run, *decided, applied=decided[1])

    def _accumulate(self, model, window: list[dict], run: Run) -> tuple[list[dict], torch.Tensor]:
        """Forward and backward of every micro-batch of the window; returns the window as it ran and its loss
        (detached). Every micro-batch's loss is normalised over the target items of the whole window, on every
        process, so that the accumulated gradient is exactly that of one batch of the window's rows. Out of memory
        (auto_find_batch_size) reruns the same samples at half the micro-batch (run.halver); where several processes
        agree on it, they do so before the last backward (the backend calls `before_sync` there)."""
        acc, halver = self.accelerator, run.halver
        before_sync = halver.before_gradient_sync if halver.agreeing else None
        while True:
            try:
                if not self._convention.settled:  # once, on the first window (or until a batch can tell)
                    self._convention.decide(model, window[0], acc)
                num_items = self._convention.window_items(window, acc, self.args.average_tokens_across_devices)
                if self._window_routing is not None:  # global_batch: the window's expert loads, before any backward
                    self._window_routing.route(model, window, acc, self.args.average_tokens_across_devices)
                window_loss = torch.zeros((), device=acc.device)
                for i, batch in enumerate(window):
                    last = i == len(window) - 1
                    with self._backend.micro_batch(model, last, before_sync):  # gradients sync on the last one only
                        window_loss += self.training_step(model, batch, num_items)
                    if not last:
                        self._fire("on_substep_end")
            except Exception as e:
                window = halver.retry(e, window, self.optimizer)
                continue
            if halver.agreeing:
                halver.window_done()
            return window, window_loss

    def _first_window(self, windows: Iterator[list[dict]], run: Run) -> list[dict] | None:
        """The epoch's first window, once every process has its own; None where the epoch holds no batch on some
        process (training then stops, as transformers stops it, with a warning, on every process). The run's first
        batch is also checked against the model here (trainer_checks.batch_problems), before the model sees it,
        and refused on every process if any process's fails (ConfigError). On several processes one all-reduce
        of two numbers per epoch: without it a process whose share of the epoch is empty (a stream used up, rows
        fewer than the processes) would loop on epochs while another waits in a collective for ever."""
        acc, pos, starts_epoch = self.accelerator, run.position, run.position.batches == 0
        problems, error, window = [], None, None
        try:
            window = next(windows, None)
        except Exception as e:  # the first batch could not be built: reported as bad input on every process
            if run.rows_checked or self._overridden(TRAIN_HOOKS):
                raise
            problems, error = [f"train_dataset: its first batch could not be built (its rows or the data collator): "
                               f"{type(e).__name__}: {e}"], e
        if window is not None and not run.rows_checked and not self._overridden(TRAIN_HOOKS):
            problems = batch_problems(self.model, "train_dataset", window[0], self.compute_loss_func,
                                      self.label_names, self._convention.family, self._filters_columns())
        if window is not None and not run.rows_checked and self._sequence_split is not None and not problems:
            problems = [f"train_dataset: {p}" for p in self._sequence_split.batch_problems(window[0])]
        empty, refused = window is None, bool(problems)
        if acc.num_processes > 1:
            flags = acc.reduce(torch.tensor([float(empty), float(refused)], device=acc.device), "sum").tolist()
            empty, refused = flags[0] > 0, flags[1] > 0
        if refused:
            raise ConfigError(problems or ["train_dataset: the first batch of another process cannot be run by the "
                                           "model (that process names the problem)"], "Trainer inputs") from error
        run.rows_checked = True
        if empty and starts_epoch:  # (a resumed epoch may have nothing left: it simply ends)
            logger.warning(f"epoch {pos.epoch} yields no batch"
                           + (f" on {int(flags[0])} of {acc.num_processes} processes" if acc.num_processes > 1 else "")
                           + f" (There seems not to be a single sample in your epoch_iterator), stopping training at "
                           f"step {self.state.global_step} of max_steps={self.state.max_steps}: an IterableDataset "
                           "that is used up, or fewer rows than the processes with even_batches=False or "
                           "dataloader_drop_last=True")
            self.control.should_training_stop = True
        return None if empty else window

    def _unchecked_set(self, dataloader, description: str) -> tuple[str, int] | None:
        """(name, id) of the evaluation or test set `dataloader` reads, where its first batch is still to be checked
        against the model: not checked before, and made by stoker's own hooks (a subclass that overrides one makes
        what reaches the model its own business); else None."""
        predicting = description == "Prediction"
        dataset = getattr(dataloader, "dataset", None)
        if (dataset is None or id(dataset) in self._rows_checked
                or self._overridden(PREDICT_HOOKS if predicting else EVAL_HOOKS)):
            return None
        named = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {}
        key = next((k for k, v in named.items() if v is dataset), None)
        return ("test_dataset" if predicting else "eval_dataset" if key is None else f"eval_dataset[{key!r}]",
                id(dataset))

    def _checked_first_batch(self, batches: Iterator, name: str, key: int):
        """The first batch of an evaluation set (or None, where this process has none), checked against the model
        (trainer_checks.batch_problems) before the model sees it, when the set's first evaluation starts; refused on
        every process if any process's fails (ConfigError), after one all-reduce of one number."""
        acc, problems, error, first = self.accelerator, [], None, None
        try:
            first = next(batches, None)
        except Exception as e:
            problems, error = [f"{name}: its first batch could not be built (its rows or the data collator): "
                               f"{type(e).__name__}: {e}"], e
        if first is not None:
            problems = batch_problems(self.model, name, first, self.compute_loss_func, self.label_names,
                                      self._convention.family, self._filters_columns())
        refused = bool(problems)
        if acc.num_processes > 1:
            refused = acc.reduce(torch.tensor([float(refused)], device=acc.device), "sum").item() > 0
        if refused:
            raise ConfigError(problems or [f"{name}: the first batch of another process cannot be run by the model "
                                           "(that process names the problem)"], "Trainer inputs") from error
        self._rows_checked.add(key)
        return first

    def _filters_columns(self) -> bool:
        return isinstance(self.data_collator, ColumnFilter)

    def _windows(self, run: Run) -> Iterator[list[dict]]:
        """The epoch's optimizer-step windows from micro-batch `run.position.batches` on; the last may be shorter.

        Resuming skips indices in the sampler, so no skipped batch is loaded or run. When an out-of-memory
        error has halved the micro-batch, the loader is rebuilt at the same sample position.
        """
        pos = run.position
        while True:
            size = pos.micro_batch
            if self._train_batch_size != size:  # halved after an out-of-memory error
                run.train_dataloader = self._train_loader(size, run.rollback)
            loader = run.train_dataloader
            if hasattr(loader, "set_epoch"):  # a loader of the user's own may have none, as in transformers
                loader.set_epoch(pos.epoch)
            if getattr(loader, "generator", None) is not None:  # worker seeds = f(data_seed, epoch), not the
                loader.generator.manual_seed(self.args.data_seed + pos.epoch)  # global RNG: resumable
                if not pos.batches:
                    # transformers' loader, without a generator, draws its base seed from the global RNG as each
                    # epoch's iterator starts; one draw here keeps dropout (and any global draw after it) on
                    # transformers' stream for the same seed. Only at an epoch's start: a resumed epoch's draw
                    # was taken before its checkpoint saved the RNG state
                    torch.empty((), dtype=torch.int64).random_()
            if pos.batches:
                loader = self.get_resumed_dataloader(loader, pos.batches)
            # the time spent waiting for batches (starting the loader's workers included) is summed for the log
            window = []
            for batch in run.log.data_clock.timed(loader):
                # a transformers collator's BatchEncoding is a Mapping, not a dict; what is no Mapping at all is
                # refused by the first batch's check (_first_window)
                window.append(dict(batch) if isinstance(batch, Mapping) else batch)
                if len(window) == pos.accumulation:
                    yield window
                    window = []
                    if pos.micro_batch != size:
                        break
            else:
                if window:
                    yield window
                return

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its share of the window loss, detached. The loss is
        normalised by num_items_in_batch, the window's target count over every process, so a subclass that
        changes the inputs or adds to the loss and calls this keeps the update exact."""
        if not (model.training and self.model.training):  # only when the mode changed: train() walks every module
            model.train()
        # read inline, not through stoker.optim's helpers, so that a plain step enters no more functions
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        if callable(getattr(inner, "train", None)):  # a schedule-free optimizer back on its training point
            inner.train()
        # context parallelism: this rank's slice of the sequence (copies; `inputs` stays whole), for the forward and
        # the backward, where the ring attention passes the keys and values around the group again
        split, given = (self._sequence_split(inputs) if self._sequence_split is not None
                        else (contextlib.nullcontext(), dict(inputs)))
        shares = []  # marked by stoker's compute_loss, if this micro-batch's loss goes through it
        token = _WINDOW_SHARES.set(shares)
        with split:
            try:  # rows counted unpadded on the host: sdpa's causal path without a read of the mask (sdpa_mask)
                with unpadded_attention(inputs) if self._answers_mask else contextlib.nullcontext():
                    loss = self.compute_loss(model, given, num_items_in_batch=num_items_in_batch)
            finally:
                _WINDOW_SHARES.reset(token)
            # an override of compute_loss that returned its own mean over the micro-batch (loss_is_scaled_for_ga
            # False, or None with a model that takes no loss kwargs, where transformers divides by the accumulation
            # steps) is weighed by the micro-batch's items over the window's: transformers' division where the
            # micro-batches hold equal items, exact where they do not. A loss from stoker's compute_loss is the share
            scaled = self.loss_is_scaled_for_ga
            if scaled is None:
                scaled = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
            if not (shares or scaled or num_items_in_batch is None):
                loss = self._convention.mean_share(loss, inputs, num_items_in_batch)
            # DDP, FSDP (and DeepSpeed) average gradients over processes (FSDP2 over the context-parallel ranks as
            # well: averaged_ranks); the loss is already normalised by the global item count, so scale back up to
            # get the sum over the global window. LOMO updates the parameters inside the backward, at the
            # schedule's rate (Accelerate's lomo_backward)
            fused = {"learning_rate": self._learning_rate()} if hasattr(inner, "fused_backward") else {}
            self._backend.backward(loss * (self.accelerator.averaged_ranks if self.args.average_tokens_across_devices
                                           else 1), **fused)
        if self.args.torch_empty_cache_steps and self.state.global_step % self.args.torch_empty_cache_steps == 0:
            clear_device_cache()
        return loss.detach()

    # ------------------------------------------------------------------------------------------
    # FLOPs (state.total_flos, as transformers counts them: 6 x parameters x tokens)

    def floating_point_ops(self, inputs: dict) -> int:
        """6 x the main input's tokens x the non-embedding parameters (0 for a model without num_parameters);
        override it for another estimate."""
        model = self.model
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return 0
        if self._flops_model is not model:  # counted once per model: it visits every parameter
            self._flops_model, self._flops_parameters = model, non_embedding_parameters(model)
        return 6 * inputs[main_input].numel() * self._flops_parameters

    def store_flos(self) -> None:
        """Add the FLOPs counted since the last call, summed over every process, to state.total_flos and restart
        the count. Every process must call it (a collective when there are several). The ranks of a tensor-parallel
        group each count their group's whole batch with the whole model's parameters, so a batch counts once."""
        flos = torch.tensor(float(self.current_flos), device=self.accelerator.device, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            flos = self.accelerator.reduce(flos, reduction="sum") / self.accelerator.ranks_per_count
        self.state.total_flos += flos.item()
        self.current_flos = 0

    def _maybe_log_save_evaluate(self, run: Run) -> None:
        """Act on the control flags: log, evaluate, save (time spent evaluating and saving is not counted in
        the logged throughput)."""
        s, log, c = self.state, run.log, self.control  # read anew after each event: a callback may replace it
        if c.should_log or c.should_evaluate or c.should_save:
            self._apply_pending_verdict(run)
        if self.args.async_save:  # the checkpoint in flight committed, or its failure raised
            run.checkpointer.poll(run)
        if self.control.should_log and (log.steps or log.nonfinite_total):
            logs, diagnostics, seen = log.logs(self.args, self.accelerator, self.model_wrapped, self._learning_rate())
            s.num_input_tokens_seen += seen
            self._log(logs, run.started, diagnostics)
            log.restart_clock()
        self.control.should_log = False
        paused = time.perf_counter()
        if self.control.should_evaluate:
            self.control.should_evaluate = False
            with run.ledger.phase("evaluation"):
                best = self._evaluate_and_track(run)
            if best and self.args.save_strategy == "best":
                self.control.should_save = True
        if self.control.should_save:
            self.control.should_save = False
            if run.checkpointer.last_saved_step != s.global_step:  # epoch end right after a step save
                with run.ledger.phase("checkpoint"):  # async_save: the snapshot, and any wait for the last write
                    self._save_checkpoint(run)
        if self._ray_report is not None:  # a Ray search trial's evaluation, with this step's checkpoint if saved
            self._report_to_ray(self._committed_checkpoint(run))
        rollback = run.rollback
        if (rollback is not None and rollback.enabled and s.global_step % self.args.spike_snapshot_steps == 0
                and rollback.saved.step != s.global_step):
            self._snapshot(run)
        log.excluded += time.perf_counter() - paused

    def log(self, logs: dict[str, float], start_time: float | None = None, diagnostics: dict | None = None) -> None:
        """Record logs, with the epoch, in state.log_history (with the step) and hand them to the on_log callbacks,
        as transformers does: with include_num_input_tokens_seen also num_input_tokens_seen and, given the run's
        start_time (time.time()), train_runtime and train_tokens_per_second of this train() call. The loop logs
        through this method, so a subclass that overrides it sees (and may change) every record. `diagnostics`,
        stoker's wall-clock figures of the record (which differ between two identical runs, so they stay out of
        log_history), go to on_log beside it (metrics.jsonl writes them). As in transformers, `logs` itself gets the
        epoch (and the token figures): the metrics evaluate() and train() return carry it, and the on_log
        callbacks receive this dict, so PrinterCallback's removal of total_flos shows in them too."""
        s = self.state
        logs["epoch"] = s.epoch
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = s.num_input_tokens_seen
            if start_time is not None:
                logs.update(speed_metrics("train", start_time,
                                          num_tokens=s.num_input_tokens_seen - self._initial_num_input_tokens_seen))
        s.log_history.append({**logs, "step": s.global_step})
        self._fire("on_log", logs=logs, diagnostics=diagnostics or {})

    def _log(self, logs: dict[str, float], start_time: float | None, diagnostics: dict) -> None:
        """log() from the loop, with exactly the arguments its signature takes: an override written for
        transformers' log(logs, start_time) gets no diagnostics, and one written as log(self, logs) (older scripts,
        transformers' own plateau test) gets the logs alone. Read at each call, so that a log replaced on the
        instance is called right too (reading a signature is cheap beside a log record, which comes once per
        logging_steps)."""
        parameters = list(inspect.signature(self.log).parameters.values())
        kinds = {p.kind for p in parameters}
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        args, kwargs = [logs], {}
        if (len(positional) >= 2 and positional[1].name != "diagnostics") or inspect.Parameter.VAR_POSITIONAL in kinds:
            args.append(start_time)  # positionally, as transformers calls it
        elif any(p.name == "start_time" for p in parameters) or inspect.Parameter.VAR_KEYWORD in kinds:
            kwargs["start_time"] = start_time
        if any(p.name == "diagnostics" for p in parameters[1:]) or inspect.Parameter.VAR_KEYWORD in kinds:
            kwargs["diagnostics"] = diagnostics
        self.log(*args, **kwargs)

    # ------------------------------------------------------------------------------------------
    # evaluation and prediction

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Metrics of one evaluation set; with a dict of them (given here or to the Trainer) each one's metrics,
        prefixed with its name (eval_<name>_loss, ...). A name picks one set of the Trainer's dict."""
        if isinstance(eval_dataset, str):  # kept as the name: get_eval_dataloader caches by it
            if not isinstance(self.eval_dataset, Mapping) or eval_dataset not in self.eval_dataset:
                known = sorted(self.eval_dataset) if isinstance(self.eval_dataset, Mapping) else []
                raise KeyError(f"eval_dataset={eval_dataset!r}: the Trainer's eval datasets are named {known}")
        datasets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(datasets, Mapping):
            metrics = {}
            for name, dataset in datasets.items():  # the Trainer's own sets by name, as transformers
                metrics.update(self.evaluate(name if datasets is self.eval_dataset else dataset, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        memory = self._memory_tracker()
        if memory is not None:
            memory.start()
        # without compute_metrics no predictions are needed, only the loss (as transformers)
        output = self._run_evaluation(self.get_eval_dataloader, eval_dataset, "Evaluation",
                                      True if self.compute_metrics is None else None,
                                      ignore_keys, metric_key_prefix)
        metrics = output.metrics
        if memory is not None:
            memory.stop_and_update_metrics(metrics)
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def _evaluate_and_track(self, run: Run) -> bool:
        """Evaluate, step a plateau schedule on the metric and update best_metric; True if this evaluation is
        the new best."""
        metrics = self.evaluate(ignore_keys=run.ignore_keys_for_eval)
        self._report_to_hp_search(metrics)  # a search trial's objective, which its pruner may stop it on
        name = self.args.metric_for_best_model
        if self._steps_on_metric():  # as transformers: on metric_for_best_model, else eval_loss
            self.lr_scheduler.step(self._metric(metrics, name or "loss"))
        if name is None:
            return False
        value, s, best = self._metric(metrics, name), self.state, self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better and math.isfinite(value):
            s.best_metric, s.best_global_step = value, s.global_step
            if run.checkpointer.last_saved_step == s.global_step:  # evaluated after this step's checkpoint
                s.best_model_checkpoint = ckpt.checkpoint_dir(self.args.output_dir, s.global_step)
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
        """Whether the schedule steps on an evaluation metric (ReduceLROnPlateau, GreedyLR) rather than on every
        step."""
        return steps_on_metric(self.lr_scheduler)

    def _learning_rate(self) -> float:
        # the schedule's last rate: a schedule that steps on a metric (ReduceLROnPlateau, GreedyLR) records the
        # optimizer's after each of its steps; a schedule without get_last_lr leaves the optimizer's
        last = getattr(self.lr_scheduler, "get_last_lr", None)
        rate = last()[0] if last is not None else self.optimizer.param_groups[0]["lr"]
        # a tensor where the optimizer keeps its rate as one (torchao's low-bit AdamW), read as transformers does
        return rate.item() if isinstance(rate, torch.Tensor) else rate

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        """Predictions, labels (if the dataset has them) and metrics of a dataset, gathered from every process in
        dataset order, as transformers returns them (a PredictionOutput of numpy arrays)."""
        memory = self._memory_tracker()
        if memory is not None:
            memory.start()
        output = self._run_evaluation(self.get_test_dataloader, test_dataset, "Prediction", None, ignore_keys,
                                      metric_key_prefix)
        if memory is not None:
            memory.stop_and_update_metrics(output.metrics)
        self._fire("on_predict", metrics=output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def _run_evaluation(self, loader_of: Callable, dataset, description: str, prediction_loss_only, ignore_keys,
                        prefix: str):
        """evaluation_loop over loader_of(dataset) (get_eval_dataloader or get_test_dataloader), plus the speed
        metrics. With auto_find_batch_size, an out-of-memory error halves the evaluation batch (never the training
        batch) and starts over; on several processes every process halves, or none: one that ran out of memory in a
        batch's forwards tells the others before the batch's gather (OutOfMemoryInEvaluation), and one anywhere
        else, where the others may be waiting in a collective, is raised."""
        acc = self.accelerator
        while True:
            started = time.time()  # wall-clock, as transformers' speed_metrics measures from
            try:
                dataloader = loader_of(dataset)
                output = self.evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, prefix)
                break
            except Exception as e:
                agreed = isinstance(e, OutOfMemoryInEvaluation)
                if not (self.args.auto_find_batch_size and (agreed or should_reduce_batch_size(e))
                        and self._eval_batch_size > 1):
                    raise
                if acc.num_processes > 1 and not agreed:
                    raise RuntimeError(
                        f"out of memory in evaluation on process {acc.process_index} of {acc.num_processes}, outside "
                        "an evaluation batch's forwards under DDP, where the processes cannot agree on halving "
                        f"({self._backend.kind} run; the others may be waiting in a collective). Lower "
                        f"per_device_eval_batch_size (now {self._eval_batch_size})") from e
                clear_device_cache(garbage_collection=True)
                self._eval_batch_size //= 2
                self._eval_dataloaders.clear()  # built for the old batch size
                logger.warning(f"out of memory in evaluation; eval batch now {self._eval_batch_size}")
        output.metrics.update(speed_metrics(prefix, started, num_samples=output.num_samples,
                                            num_steps=math.ceil(output.num_samples / self._eval_batch_size)))
        return output

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """(loss, logits, labels) of one evaluation batch, in eval mode (a model in training mode is put back in it
        afterwards) and without gradients, so that a direct call is as deterministic as evaluate(). The loss is the
        batch's mean over its
        target tokens (a plain module given no labels: the mean it returns, if any; else None); logits are the
        predictions transformers.Trainer would take (a tuple for several outputs), labels one tensor or a tuple
        with one per label_names entry; logits and labels are None with prediction_loss_only."""
        inputs = dict(inputs)  # a transformers collator's BatchEncoding
        label = labels_of(inputs, self.label_names)
        loss = None
        with evaluating(model):
            if label is None and (self._is_transformers or self.compute_loss_func):
                outputs = model(**inputs, **self._forward_kwargs)  # no labels, so no loss: predictions only
            elif label is None:  # a plain module: its own loss, if it returns one (a mean over its rows)
                outputs = model(**inputs)
                loss = loss_or_none(outputs)
            else:
                # as transformers: a model patched by Liger then skips the logits; others ignore the flag. Every
                # forward of a loss-only evaluation gets it, the loss convention's one-off probes (which need
                # only losses) included, so that a probe calls the model as the evaluation does. A plain module
                # gets it where its forward takes it (transformers hands it to every model, and one without the
                # argument fails there)
                skip = {"skip_logits": True} if (self.args.use_liger_kernel and prediction_loss_only
                                                 and self._takes_skip_logits) else {}
                inputs = {**inputs, **skip}
                if not self._convention.settled:
                    self._convention.decide(model, inputs, self.accelerator)
                items = self._convention.targets(inputs)
                if prediction_loss_only:  # the loss alone: chunked_loss then computes no logits
                    loss, outputs = self.compute_loss(model, inputs, num_items_in_batch=max(items, 1)), None
                else:
                    loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                                      num_items_in_batch=max(items, 1))
        loss = loss.detach() if loss is not None else None
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys and isinstance(outputs, Mapping):
            outputs = {k: v for k, v in outputs.items() if k not in ignore_keys}
        config = getattr(_unwrap_peft(self.model), "config", None)
        ignore = set(getattr(config, "keys_to_ignore_at_inference", None) or ())
        return loss, predictions_of(outputs, loss is not None, ignore), label

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """prediction_step over every batch: the exact mean loss over the target tokens of the dataset, the
        predictions and labels gathered from every process, and compute_metrics of them.

        As in transformers, this (not evaluate() or predict()) prepares the model for evaluation and puts it in eval
        mode, where it stays until training_step puts it back in training mode, so that a subclass calling it
        directly (transformers' question-answering example does) evaluates deterministically; the batches run
        without gradients."""
        if self.model_wrapped is self.model:  # evaluation before train(): place the model once
            self.model_wrapped = self._backend.place_for_evaluation(self.model)
        if not self.is_in_train and (self.args.bf16_full_eval or self.args.fp16_full_eval):
            self.model_wrapped.to(torch.bfloat16 if self.args.bf16_full_eval else torch.float16)
        a, acc, model, prefix = self.args, self.accelerator, self.model_wrapped, metric_key_prefix
        model.eval()
        set_mode(self.optimizer, "eval")  # a schedule-free optimizer's averaged parameters, as transformers
        self.callback_handler.eval_dataloader = dataloader
        if prediction_loss_only is None:
            prediction_loss_only = a.prediction_loss_only
        # each batch's loss is normalised over its own items (target tokens; rows for a plain module without
        # labels), then re-weighted by them: the exact mean over every item of the eval set
        loss_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        items_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        transformers_logger.info(f"\n***** Running {description} *****")
        try:
            transformers_logger.info(f"  Num examples = {self.num_examples(dataloader)}")
        except TypeError:
            transformers_logger.info("  Num examples: Unknown")
        transformers_logger.info(f"  Batch size = {self._eval_batch_size}")
        collected = Collected(acc, a.eval_accumulation_steps, a.eval_use_gather_object, a.eval_do_concat_batches)
        batch_metrics, rows_seen = None, 0  # an IterableDataset has no length to count its samples by
        # auto_find_batch_size on several processes: an out-of-memory error in a batch's forwards is told to every
        # process, which then halve the evaluation batch together (_run_evaluation)
        agree = a.auto_find_batch_size and acc.num_processes > 1 and self._backend.agrees_on_out_of_memory
        batches = iter(dataloader)
        if (unchecked := self._unchecked_set(dataloader, description)) is not None:  # its first batch, checked
            first = self._checked_first_batch(batches, *unchecked)
            batches = itertools.chain([first] if first is not None else [], batches)
        for n, batch in enumerate(batches, 1):
            batch = dict(batch)  # a transformers collator's BatchEncoding
            with agreeing_on_out_of_memory(acc, agree), torch.no_grad():  # also around a subclass's prediction_step
                loss, logits, label = self.prediction_step(model, batch, prediction_loss_only, ignore_keys)
                scored, (genuine, rescore) = batch, genuine_rows(batch, acc)
                if loss is not None and rescore:  # each process scores its real rows once more, once per pass at
                    # most, all together (a sharded model's forward is a collective); a batch without fillers or
                    # without real rows is scored whole and that loss not kept
                    part = split_batch(batch, genuine)[0] if genuine else batch
                    again = self.prediction_step(model, part, True, ignore_keys)[0]
                    if genuine:
                        scored, loss = part, again
            rows = count_targets(batch, None, False)
            rows_seen += rows
            if loss is not None and (genuine is None or genuine > 0):
                items = self._convention.targets(scored)
                loss_sum += loss.double() * items
                items_sum += items
            if not prediction_loss_only:
                if logits is not None and self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, label)
                values = {"predictions": logits, "label_ids": label,
                          "inputs": batch.get("input_ids") if "inputs" in a.include_for_metrics else None,
                          "losses": loss.repeat(rows) if loss is not None and "loss" in a.include_for_metrics
                          else None}
                # as transformers: prediction keeps every batch's predictions for its result
                step = collected.gather(values, n, keep=not a.batch_eval_metrics or description == "Prediction")
                if a.batch_eval_metrics and self.compute_metrics is not None:  # metrics of the batch now
                    batch_metrics = self.compute_metrics(eval_prediction(step, a.include_for_metrics),
                                                         compute_result=acc.gradient_state.end_of_dataloader)
            self._fire("on_prediction_step")

        metrics = {}
        if acc.num_processes > 1:
            loss_sum, items_sum = acc.reduce(loss_sum, "sum"), acc.reduce(items_sum, "sum")
        if items_sum.item() > 0:
            metrics[f"{prefix}_loss"] = loss_sum.item() / items_sum.item()
        joined = collected.joined()
        if self.compute_metrics is not None and not a.batch_eval_metrics and joined["predictions"] is not None:
            batch_metrics = self.compute_metrics(eval_prediction(joined, a.include_for_metrics))
        for k, v in (batch_metrics or {}).items():
            metrics[k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"] = v
        try:
            num_samples = self.num_examples(dataloader)
        except TypeError:  # a stream has no length (also inside Accelerate's shard of it): count what came
            num_samples = rows_seen * evaluation_readers(acc)
        return EvalLoopOutput(predictions=joined["predictions"], label_ids=joined["label_ids"], metrics=metrics,
                              num_samples=num_samples)

    # ------------------------------------------------------------------------------------------
    # saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model for use outside stoker: transformers/peft models with save_pretrained
        (safetensors; peft stores the adapter only), plain modules as safetensors + stoker_model.json. Every
        process must call it (a sharded model is gathered). A checkpoint being written in the background is
        committed first."""
        self._checkpoint_writer.finish()
        save_model(output_dir or self.args.output_dir, self.accelerator, self._backend, self.model_wrapped,
                   self.processing_class, self.args)

    def _save_checkpoint(self, run: Run) -> str:
        """Write checkpoint-<global_step> of the run at its position (stoker.checkpointer does the work), then
        on_save."""
        self.store_flos()
        s = self.state
        if s.best_global_step == s.global_step:  # (an evaluation after this save sets it in _evaluate_and_track)
            s.best_model_checkpoint = ckpt.checkpoint_dir(self.args.output_dir, s.global_step)
        path = run.checkpointer.save(run)
        self._fire("on_save")
        return path

    def _committed_checkpoint(self, run: Run) -> str | None:
        """This step's checkpoint, committed (async_save's write waited for), or None if the step saved none."""
        if run.checkpointer.last_saved_step != self.state.global_step:
            return None
        run.checkpointer.writer.finish()
        return ckpt.checkpoint_dir(self.args.output_dir, self.state.global_step)
