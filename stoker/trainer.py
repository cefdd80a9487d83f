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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from . import diagnostics
from .arguments import ConfigError, TrainingArguments
from .callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    JsonlLoggerCallback,
    ProgressCallback,
    TensorBoardCallback,
    TrainerControl,
    TrainerState,
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
from .lora import trainable_parameters
from .loss import chunked_causal_lm_loss, chunked_loss_problems, model_family, output_head

# Exit code after a checkpoint on SIGTERM/SIGUSR1: EX_TEMPFAIL, "temporary failure, try again" (requeue and
# resume with resume_from_checkpoint=True).
PREEMPTED_EXIT_CODE = 75


class TrainingPreempted(SystemExit):
    """Raised by train() once the checkpoint after a SIGTERM/SIGUSR1 is committed; exits with code 75."""

    def __init__(self, signum: int, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum, self.step = signum, step

    def __str__(self):
        return f"preempted by signal {self.signum}: checkpoint-{self.step} saved; exiting with {PREEMPTED_EXIT_CODE}"


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm (see nonfinite_policy)."""


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


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        args: TrainingArguments | None = None,
        train_dataset=None,
        eval_dataset=None,
        data_collator: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        processing_class=None,
        peft_config=None,
        compute_loss_func: Callable | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ):
        self.args = args if args is not None else TrainingArguments()
        if peft_config is not None:
            if ckpt.is_peft_model(model):
                raise ConfigError(["peft_config: the model is already a PeftModel; pass one or the other"], "Trainer")
            from .lora import wrap

            model = wrap(model, peft_config, self.args.gradient_checkpointing)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.compute_metrics = compute_metrics
        self.compute_loss_func = compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.processing_class = processing_class
        base = _unwrap_peft(model)
        self._is_transformers = hasattr(base, "config")
        self._family = model_family(model) if isinstance(model, torch.nn.Module) else "other"
        # a causal LM's loss skips each row's first label, which the item count must skip too. Known from
        # transformers' model mappings; for any other model with one label per token, None until a probe of the
        # first batch (_probe_shift) tells
        self._causal = (True if self._family == "causal_lm" else
                        None if self._family == "other" and compute_loss_func is None else False)
        # whether forward divides its summed loss by a `num_items_in_batch` it is given: decided by a probe on the
        # first batch (_probe_num_items), since many models accept the argument and ignore it
        self._honours_num_items = None if isinstance(model, torch.nn.Module) and _accepts_num_items(base) else False
        # a KV cache is wasted memory in a loss forward, and while one exists transformers ignores the
        # position_ids of packed rows (stoker.packing) and lets their sequences attend to each other
        self._forward_kwargs = {"use_cache": False} if "use_cache" in forward_columns(base) else {}
        self._chunked_head = output_head(model) if self.args.chunked_loss else None
        self._logits_wanted = False  # set by evaluation: whether chunked_loss must still compute logits
        # as transformers: the forward arguments named like labels (start_positions and end_positions for
        # question answering)
        self.label_names = self.args.label_names or (_label_arguments(base) if self._is_transformers else None) or [
            "labels"]
        self.data_collator = data_collator or PaddingCollator(self._pad_token_id())
        if self.args.remove_unused_columns and hasattr(base, "config"):
            self.data_collator = ColumnFilter(self.data_collator, forward_columns(base) | set(self.label_names))
        self._check_inputs(model, optimizers)

        self.accelerator = self._build_accelerator(model, optimizers)
        self._apply_precision_switches()
        self._enable_gradient_checkpointing(model)
        self.model = model
        self.model_wrapped = model  # the prepared (DDP/compiled) model once training starts
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

    # ------------------------------------------------------------------------------------------
    # set-up

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
        """Target tokens (or samples) in the whole accumulation window, summed over every process."""
        total = sum(torch.as_tensor(count_targets(b, self.label_names[0], self._causal), device=self.accelerator.device)
                    for b in window)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        return total.clamp_min(1)  # an all-padding window contributes zero loss, not NaN

    # ------------------------------------------------------------------------------------------
    # training

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        micro_batch = getattr(self, "_micro_batch", self.args.per_device_train_batch_size)
        return build_dataloader(self.train_dataset, self.args, micro_batch, self.data_collator, train=True)

    def get_eval_dataloader(self, dataset=None):
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset")
        loader = build_dataloader(dataset, self.args, self._eval_batch_size, self.data_collator, train=False)
        return self.accelerator.prepare(loader)

    def create_optimizer_and_scheduler(self, num_training_steps: int, model=None) -> None:
        from .optim import create_optimizer, create_scheduler

        if self.optimizer is None:
            self.optimizer = create_optimizer(self.model if model is None else model, self.args)
        if self.lr_scheduler is None:
            self.lr_scheduler = create_scheduler(self.optimizer, self.args, num_training_steps)

    def _create_deepspeed_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """An "optimizer" or "scheduler" section of the DeepSpeed config is built by DeepSpeed (Accelerate's
        placeholders stand for it until then); otherwise stoker's own is handed to DeepSpeed."""
        from accelerate.utils import DummyOptim, DummyScheduler

        from .optim import create_optimizer, create_scheduler, parameter_groups

        a, config = self.args, self.accelerator.state.deepspeed_plugin.deepspeed_config
        if self.optimizer is None:
            self.optimizer = DummyOptim(parameter_groups(self.model, a.weight_decay), lr=a.learning_rate,
                                        weight_decay=a.weight_decay) if "optimizer" in config else (
                create_optimizer(self.model, a))
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

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Train; resume_from_checkpoint is None, True (the newest complete checkpoint) or a checkpoint path.

        Raises TrainingPreempted (a SystemExit with PREEMPTED_EXIT_CODE) after checkpointing on SIGTERM/SIGUSR1.
        """
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        acc = self.accelerator
        if self._wrapped_in_place:
            raise RuntimeError(f"train() was called before on this Trainer, and {acc.distributed_type} wrapped the "
                               "model in place (DeepSpeed's engine, FSDP1's flat parameters), which cannot be done "
                               "twice: build a new Trainer and model for another run")
        a = self.args
        resume_dir = self._resolve_resume(resume_from_checkpoint)
        if resume_dir is not None:
            self._check_checkpoint_kind(resume_dir)
        # every train() call is a run of its own: fresh state, controls and (unless given) optimizer/schedule
        s = self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                      is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        self.optimizer, self.lr_scheduler = self._given_optimizers
        set_seed(a.seed)
        self._micro_batch, self._accumulation = a.per_device_train_batch_size, a.gradient_accumulation_steps
        loop = ckpt.read_json(resume_dir, "loop_state.json") if resume_dir else None
        if loop is not None:  # may adopt the micro-batch that auto_find_batch_size settled on
            self._check_resume_settings(loop, resume_dir)
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
        s.logging_steps, s.eval_steps, s.save_steps = (
            math.ceil(max_steps * v) if v < 1 else int(v) for v in (a.logging_steps, a.eval_steps, a.save_steps))
        start_epoch, skip = 0, 0
        self._reset_accumulators()
        if resume_dir is not None:
            self._load_checkpoint(resume_dir)
            start_epoch, skip = loop["epoch"], self._resume_skip(loop)
            if per_epoch:  # the epochs still needed from here: the planned number, unless the run was resumed with
                # another world size or batch (resume_mismatch='warn'), where epochs hold another number of steps
                left_in_epoch = len(window_sizes(max(len(self._train_dataloader) - skip, 0), self._accumulation))
                s.num_train_epochs = start_epoch + 1 + max(
                    math.ceil((max_steps - s.global_step - left_in_epoch) / per_epoch), 0)
        if s.is_world_process_zero:
            print(f"[stoker] {type(self.model).__name__}: {trainable:,} trainable parameters of {total:,} "
                  f"({100 * trainable / max(total, 1):.2f}%)", file=sys.stderr)
            if self._causal:  # what memory this run should take (stoker.plan), before it takes it
                from .plan import start_of_training_line

                plan = start_of_training_line(self.model, a, self.train_dataset, self.accelerator.num_processes)
                print(f"[stoker] {plan}", file=sys.stderr)
            os.makedirs(a.output_dir, exist_ok=True)
            for stale in ckpt.stale_temp_dirs(a.output_dir):  # left by a process killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
        self._last_saved_step = None
        self._fire("on_train_begin", train_dataloader=self._train_dataloader)
        if a.eval_on_start and resume_dir is None:
            self._evaluate_and_track()

        started = time.perf_counter()
        first_step = s.global_step
        with self._preemption_signals():
            self._train_loop(per_epoch, start_epoch, skip)
        if self._preempted is not None:
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
        if a.load_best_model_at_end and s.best_model_checkpoint:
            self._load_model_weights(s.best_model_checkpoint)
        self.log(metrics)
        self._fire("on_train_end")
        return TrainOutput(s.global_step, metrics["train_loss"], metrics)

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
                    loss = self.compute_loss(model, dict(batch), num_items_in_batch=num_items)
                    # DDP (and DeepSpeed) average gradients over processes; the loss is already normalised by
                    # the global item count, so scale back up to get the sum over the global window. DeepSpeed
                    # would also divide it by the accumulation steps.
                    acc.backward(loss * acc.num_processes, **({"scale_wrt_gas": False} if deepspeed else {}))
                window_loss += loss.detach()
                if not last:
                    self._fire("on_substep_end")
        finally:
            acc.sync_gradients = True  # Accelerate's optimizer ignores step and zero_grad until it is
        return window_loss

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
        print(f"stoker: warning: out of memory at step {self.state.global_step + 1}; micro-batch now "
              f"{self._micro_batch} x accumulation {self._accumulation} (same update)", file=sys.stderr)
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
        print(f"stoker: warning: {what}; update skipped", file=sys.stderr)
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

    def log(self, logs: dict[str, float]) -> None:
        """Record logs in state.log_history and hand them to the on_log callbacks."""
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
            print(f"stoker: warning: {data_wait_advice(wait, a, on_gpu)}", file=sys.stderr)
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

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Metrics over eval_dataset (default: the Trainer's). A dict of datasets (or the name of one of the
        Trainer's) is evaluated one by one, each logged with the prefix `<metric_key_prefix>_<name>_`."""
        given = eval_dataset is not None
        dataset = eval_dataset if given else self.eval_dataset
        if isinstance(dataset, str):
            if not isinstance(self.eval_dataset, Mapping) or dataset not in self.eval_dataset:
                known = sorted(self.eval_dataset) if isinstance(self.eval_dataset, Mapping) else []
                raise KeyError(f"eval_dataset={dataset!r}: the Trainer's eval datasets are named {known}")
            dataset = self.eval_dataset[dataset]
        if isinstance(dataset, Mapping):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, metric_key_prefix=f"{metric_key_prefix}_{name}"))
            return metrics
        metrics = self._evaluation_loop(dataset, metric_key_prefix).metrics
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def _evaluate_and_track(self) -> bool:
        """Evaluate, step a plateau schedule on the metric and update best_metric; True if this evaluation is
        the new best."""
        metrics = self.evaluate()
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

    def predict(self, test_dataset, metric_key_prefix: str = "test"):
        output = self._evaluation_loop(test_dataset, metric_key_prefix)
        self._fire("on_predict", metrics=output.metrics)
        return output

    def _evaluation_loop(self, dataset, prefix: str):
        """Run the model over a dataset without gradients. With auto_find_batch_size, an out-of-memory error
        halves the evaluation batch (never the training batch) and starts the pass over."""
        from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

        if self.model_wrapped is self.model:  # evaluate() before train(): place the model once
            self.model_wrapped = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        try:
            while True:
                try:
                    return self._evaluation_pass(model, self.get_eval_dataloader(dataset), prefix)
                except Exception as e:
                    if not (self.args.auto_find_batch_size and should_reduce_batch_size(e)
                            and self._eval_batch_size > 1):
                        raise
                    clear_device_cache(garbage_collection=True)
                    self._eval_batch_size //= 2
                    print(f"stoker: warning: out of memory in evaluation; eval batch now {self._eval_batch_size}",
                          file=sys.stderr)
        finally:
            if was_training:
                model.train()

    def _evaluation_pass(self, model, dataloader, prefix: str):
        from transformers.trainer_utils import EvalPrediction, PredictionOutput

        acc = self.accelerator
        want_predictions = self.compute_metrics is not None or prefix != "eval"
        self._logits_wanted = want_predictions  # otherwise chunked_loss never computes the logits
        loss_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        items_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        preds, labels, pending_preds, pending_labels = [], [], [], []
        rows_seen = 0
        started = time.perf_counter()
        for n, batch in enumerate(dataloader, 1):
            batch = dict(batch)  # a transformers collator's BatchEncoding
            label = self._labels_of(batch)
            loss = None
            with torch.no_grad():
                if label is None and (self._is_transformers or self.compute_loss_func):
                    outputs = model(**batch, **self._forward_kwargs)  # no labels, so no loss: predictions only
                elif label is None:  # a plain module: its own loss, if it returns one (a mean over its rows)
                    outputs = model(**batch)
                    loss = self._loss_or_none(outputs)
                    if loss is not None:
                        genuine = self._genuine_rows(batch)
                        if genuine:  # this process's real rows only, as below
                            loss = self._loss_of(model(**_split_batch(batch, genuine)[0]))
                        rows = count_targets(batch, None, False) if genuine is None else genuine
                        loss_sum += loss.double() * rows
                        items_sum += rows
                else:
                    # each batch's loss is normalised over its own items, then re-weighted by them: the
                    # result is the exact mean over every target token of the eval set
                    if self._causal is None or self._honours_num_items is None:
                        self._decide_loss_family(model, batch)
                    items = count_targets(batch, self.label_names[0], self._causal)
                    loss, outputs = self.compute_loss(model, dict(batch), return_outputs=True,
                                                      num_items_in_batch=items)
                    genuine = self._genuine_rows(batch)
                    if genuine is not None and genuine > 0:  # score only this process's real rows: one
                        batch_part = _split_batch(batch, genuine)[0]  # extra forward, once per pass at most
                        items = count_targets(batch_part, self.label_names[0], self._causal)
                        loss = self.compute_loss(model, dict(batch_part), num_items_in_batch=max(items, 1))
                    if genuine is None or genuine > 0:
                        loss_sum += loss.double() * items
                        items_sum += items
            rows_seen += count_targets(batch, None, False)
            if want_predictions:
                logits = self._predictions_of(outputs, has_loss=label is not None or loss is not None)
                if logits is not None and self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, label)
                # sequence lengths differ between processes: pad to a common length before gathering
                gather = lambda t: acc.gather_for_metrics(acc.pad_across_processes(t, dim=1, pad_index=-100))
                if logits is not None:
                    pending_preds.append(_nested(gather, logits))
                if label is not None:
                    pending_labels.append(_nested(gather, label))
                if self.args.eval_accumulation_steps and n % self.args.eval_accumulation_steps == 0:
                    preds += [_nested(torch.Tensor.cpu, t) for t in pending_preds]
                    labels += [_nested(torch.Tensor.cpu, t) for t in pending_labels]
                    pending_preds, pending_labels = [], []
            self._fire("on_prediction_step")
        preds += [_nested(torch.Tensor.cpu, t) for t in pending_preds]
        labels += [_nested(torch.Tensor.cpu, t) for t in pending_labels]

        metrics = {}
        if acc.num_processes > 1:
            loss_sum, items_sum = acc.reduce(loss_sum, "sum"), acc.reduce(items_sum, "sum")
        if items_sum.item() > 0:
            metrics[f"{prefix}_loss"] = loss_sum.item() / items_sum.item()
        predictions = _concat_padded(preds)
        label_ids = _concat_padded(labels)
        if self.compute_metrics is not None and predictions is not None:
            for k, v in self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids)).items():
                metrics[k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"] = v
        runtime = time.perf_counter() - started
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        metrics[f"{prefix}_samples_per_second"] = round(rows_seen * acc.num_processes / runtime, 3)
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

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

    def save_model(self, output_dir: str | None = None) -> None:
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
        s.stateful_callbacks = {type(cb).__name__: cb.state() for cb in self.callback_handler.callbacks
                                if callable(getattr(cb, "state", None))}
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
            ckpt.rotate(a.output_dir, a.save_total_limit, keep=s.best_model_checkpoint)
        acc.wait_for_everyone()
        self._fire("on_save")
        return final

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
        print(f"stoker: warning: {what}; continuing with the new settings (resume_mismatch='warn')", file=sys.stderr)

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
            existing = ckpt.list_checkpoints(a.output_dir)
            if existing and not a.overwrite_output_dir:
                raise ConfigError([f"output_dir={a.output_dir!r}: already holds {len(existing)} checkpoint(s) "
                                   f"(newest {os.path.basename(existing[-1])}); resume with "
                                   "train(resume_from_checkpoint=True), or set overwrite_output_dir=True"],
                                  "Trainer inputs")
            return None
        if resume is True:
            for path in reversed(ckpt.list_checkpoints(a.output_dir)):
                problem = ckpt.verify(path)
                if problem is None:
                    return path
                print(f"stoker: warning: skipping {path}: {problem}", file=sys.stderr)
            print(f"stoker: no complete checkpoint in {a.output_dir}; starting from scratch", file=sys.stderr)
            return None
        problem = ckpt.verify(resume) if os.path.isdir(resume) else "no such folder"
        if problem:
            raise ckpt.CheckpointError(f"resume_from_checkpoint={resume!r}: {problem}")
        return resume

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
        for cb in self.callback_handler.callbacks:
            values = s.stateful_callbacks.get(type(cb).__name__)
            if values is not None and callable(getattr(cb, "load_state", None)):
                cb.load_state(values)
        own = ckpt.load_state(folder, f"process_{acc.process_index}")
        _set_rng_state(own["rng"])
        self._restore_pending_log(own["pending_log"])


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
