"""One object per way of running a model over processes: plain (one process, or DDP), FSDP1, FSDP2 and DeepSpeed.

The Trainer builds its backend once, from the Accelerator (`backend_for`), and calls it wherever the backends
differ, so that neither the loop nor the checkpointing branches on the kind of run:

    prepare(model, source, max_steps)        the model prepared for a run, with its optimizer and schedule
    place_for_evaluation(model)              the model as evaluate() / predict() run it before train()
    wraps_in_place                           whether prepare changed the model for good (train() runs once)
    micro_batch(model, last), backward(loss) one micro-batch of an accumulation window
    scaler_handles_inf(), update_applied_despite_nonfinite()   what the non-finite guard may decide
    skips_on_device(optimizer)               whether a non-finite update can be skipped on the device (deferred check)
    optimizer_step(optimizer, skip)          a step applied (or skipped on the device, or by fp16 loss scaling)
    step_skipped()                           a step the guard skipped, seen by the fp16 scaler
    state_dict_for_saving, writes_full_model, write_model           the model in a checkpoint or save_model
    rank_parts, optimizer_state              the optimizer state (and shards) in a checkpoint
    saves_in_background                      whether async_save can snapshot what it saves
    load_weights, load_training_state        what a checkpoint gives back
    kind, resumes, check_checkpoint          which checkpoints this run can resume

Every method that says "every rank" is a collective: all processes must call it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import checkpoint_format as ckpt
from ..compilation import compile_blocks, resolved_scope
from ..errors import CheckpointError, ConfigError
from ..optim import create_scheduler, parameter_groups
from .accelerator import async_save_refusal, check_sharding_active
from .deepspeed import (
    averages_sequence_groups,
    finish_deepspeed_config,
    gather_trainable_zero3,
    is_deepspeed,
    is_zero_checkpoint,
    load_zero3_weights,
    load_zero_partitions,
    save_zero_partition,
    zero_partitions_written,
    zero_stage,
)
from .fsdp import (
    MODEL_SHARDS,
    gather_full_model,
    gathers_full_model,
    is_sharded,
    load_shards,
    load_whole,
    model_class_name,
    plan_shards,
)
from .parallelism import SIZES, describe, is_layout_sharded, shard_with_plans
from .sequence_parallel import fresh_sequence_parallelism, splits_sequences

# how checkpoint messages name each kind of run
PLAIN_KIND, FSDP_KIND, DEEPSPEED_KIND = "a data-parallel (or single-process)", "an FSDP", "a DeepSpeed"


class OptimizerSource(NamedTuple):
    """Where a run's optimizer and schedule come from: the pair given to the Trainer (either may be None) and the
    Trainer's hooks that build what was not given (a subclass may override them, as transformers')."""

    given_optimizer: Any
    given_scheduler: Any
    build: Callable[[Any, int], tuple[Any, Any]]  # (model, steps) -> (optimizer, schedule): both, or the given
    build_optimizer: Callable[[Any], Any]  # model -> the optimizer alone (or the given one)


class Prepared(NamedTuple):
    """What prepare makes for a run: the model as trained (DDP/FSDP/DeepSpeed-wrapped), its optimizer, schedule."""

    model: Any
    optimizer: Any
    lr_scheduler: Any


def backend_for(accelerator, args) -> Backend:
    """The backend of the run Accelerate set up. Refuses (ConfigError) a run with `fsdp` set in which Accelerate
    did not set up FSDP, which would otherwise train unsharded, and async_save with a backend that cannot save in
    the background (DeepSpeed, also when accelerate launch's configuration asks for it)."""
    check_sharding_active(args, accelerator.distributed_type)
    if is_layout_sharded(getattr(accelerator, "parallelism_config", None)):  # refused with fsdp and deepspeed
        backend = PlanShardedBackend(accelerator, args)
    elif is_deepspeed(accelerator):
        backend = DeepSpeedBackend(accelerator, args)
    elif is_sharded(accelerator):
        # the plugin's version, read without AcceleratorState.is_fsdp2, which fails where the process-wide state
        # says FSDP but this Accelerator has no plugin (a state set up by hand before it was built)
        version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 2)
        backend = FSDP1Backend(accelerator, args) if version == 1 else FSDP2Backend(accelerator, args)
    else:
        backend = Backend(accelerator, args)
    if args.async_save and not backend.saves_in_background:
        raise ConfigError([async_save_refusal(f"{backend.kind} run")], "distributed configuration")
    return backend


def checkpoint_kind(folder: str) -> str:
    """The kind of run that wrote a checkpoint, from what it holds (FSDP shards, ZeRO partitions, or neither), as
    checkpoint messages name it."""
    if os.path.isdir(os.path.join(folder, MODEL_SHARDS)):
        return FSDP_KIND
    return DEEPSPEED_KIND if is_zero_checkpoint(folder) else PLAIN_KIND


def without_fp32_outputs(model) -> bool:
    """Drop Accelerate's `convert_outputs_to_fp32` from a prepared model's forward, keeping its autocast. Under
    bf16 / fp16 Accelerate casts every output of the forward to float32: a float32 copy of the full logits on
    every training forward (2.1 GB at 8 x 2048 tokens x 32k vocabulary, 8.4 GB at 128k), which the loss does not
    need (transformers' loss functions upcast inside the forward, and so do stoker's). Returns whether there was
    one to drop (none in float32, nor under DeepSpeed, which does its own mixed precision)."""
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    forward = model.__dict__.get("forward")
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        return False
    # Accelerate's two shapes: a bound method around an autocast-wrapped function, or the autocast-wrapped
    # callable itself; unwrap_model(keep_fp32_wrapper=False) still finds the original forward below either
    inner = converter.model_forward
    model.forward = MethodType(inner, model) if hasattr(forward, "__func__") else inner
    return True


class Backend:
    """The plain backend: one process, or DDP (Accelerate's wrapper; every process holds the whole model and
    optimizer state). The base of the others, which override where they differ."""

    kind = PLAIN_KIND  # as checkpoint messages name this kind of run
    resumes = (PLAIN_KIND, FSDP_KIND)  # the kinds of checkpoint it resumes: here an FSDP run's shards too
    saves_in_background = True  # async_save: what a checkpoint holds can be snapshot in host memory
    wraps_in_place = False  # prepare leaves the model usable by another train() call
    # whether the processes can agree on an out-of-memory error before a window's gradient all-reduce (DDP's
    # forward holds no collective that a process could be left waiting in)
    agrees_on_out_of_memory = True
    # whether a fused optimizer's update may be skipped on the device (skips_on_device): FSDP's DTensor shards and
    # DeepSpeed's engine keep the synchronous check
    skips_updates_on_device = True
    # the sizes of parallelism_config that are not 1 where the model is sharded by its plans (tensor parallelism,
    # FSDP2 by fsdp_plan): the layout a checkpoint records and resume messages name; None where the processes are
    # the layout
    sharding: dict[str, int] | None = None

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.runs = 0  # prepare calls so far: one per train()
        self._placed_for_evaluation = None  # the model evaluate() placed before a train() call, if it did
        self._initial_scaler_state = None  # the fp16 scaler as the first run found it
        self._before_sync = None  # called by backward before the gradients of a window are synchronised
        self._window_model = None  # the model of the last micro-batch run (DDP-wrapped on several processes)

    # -- a run -------------------------------------------------------------------------------------------

    def check_new_run(self) -> None:
        """Refuse a second train() after one that wrapped the model in place, which cannot be done twice (a
        RuntimeError, before anything of the run is set up)."""
        if self.wraps_in_place and self.runs:
            raise RuntimeError(f"train() was called before on this Trainer, and {self.accelerator.distributed_type} "
                               "wrapped the model in place (DeepSpeed's engine, FSDP1's flat parameters), which "
                               "cannot be done twice: build a new Trainer and model for another run")

    def prepare(self, model, source: OptimizerSource, max_steps: int, half_outputs: bool = False) -> Prepared:
        """The model prepared for training (DDP-, FSDP- or DeepSpeed-wrapped), with the optimizer and schedule
        for `max_steps` steps from `source`. `half_outputs`: the caller computes the loss from what it gets
        without needing float32 logits, so the forward's outputs stay as autocast made them (without_fp32_outputs)."""
        self.runs += 1
        self._restart_loss_scale()
        model = self._compiled(self._unplaced(model))
        prepared = self._prepare(model, source, max_steps)
        # Accelerate put its autocast forward on this very module, before any DDP or FSDP wrapper (reached without
        # unwrap_model, which imports DeepSpeed wherever it is installed)
        if half_outputs and self.accelerator.mixed_precision != "no":
            without_fp32_outputs(model)
        return prepared

    def _compiled(self, model):
        """`model` with its repeated blocks compiled in place where torch_compile asks for them and Accelerate
        compiles nothing itself (one process or DDP; sharded runs use Accelerate's regional compilation, given
        its plugin by build_accelerator). Before DDP wraps it: DDP's hooks sit on the parameters, outside the
        blocks' graphs."""
        if resolved_scope(self.args, model) == "blocks" and self.accelerator.state.dynamo_plugin.backend.value == "NO":
            compile_blocks(model, self.args)
        return model

    def _restart_loss_scale(self) -> None:
        """Every run starts from the fp16 scaler's initial scale, as a fresh Trainer's does (a resumed run then
        loads its checkpoint's)."""
        scaler = self.accelerator.scaler
        if scaler is None:
            return
        if self._initial_scaler_state is None:
            self._initial_scaler_state = scaler.state_dict()
        else:
            scaler.load_state_dict(self._initial_scaler_state)

    def place_for_evaluation(self, model):
        """The model as evaluate() and predict() run it before any train() call: Accelerate's evaluation-only
        preparation (on the device, mixed precision patched into its forward, compiled if asked), not wrapped."""
        self._placed_for_evaluation = self.accelerator.prepare_model(self._compiled(model), evaluation_mode=True)
        return self._placed_for_evaluation

    def _unplaced(self, model):
        """`model`, once the evaluation-only preparation of place_for_evaluation is undone. That preparation marks
        the model as prepared, and Accelerate never prepares a model twice: the run would train without DDP or
        FSDP, each process on its own share of the data, the replicas drifting apart (as transformers.Trainer
        does after an evaluate() before train())."""
        placed, self._placed_for_evaluation = self._placed_for_evaluation, None
        if placed is not None:
            acc = self.accelerator
            acc._models = [m for m in acc._models if m is not placed]
            plain = acc.unwrap_model(placed, keep_fp32_wrapper=False, keep_torch_compile=False)  # its own forward
            plain.__dict__.pop("_is_accelerate_prepared", None)
        return model

    def _prepare(self, model, source: OptimizerSource, max_steps: int) -> Prepared:
        optimizer, scheduler = source.build(model, max_steps)
        return Prepared(*self.accelerator.prepare(model, optimizer), scheduler)

    @contextlib.contextmanager
    def micro_batch(self, model, last: bool, before_sync: Callable[[], None] | None = None):
        """The context of one micro-batch of an accumulation window: gradients are synchronised across
        processes only on the window's last micro-batch (`last`), whose backward first calls `before_sync` (where
        every process agrees on out-of-memory errors, stoker.step.MicroBatchHalver). With accelerator_config's
        gradient_accumulation_kwargs sync_each_batch=True, on every micro-batch (no no_sync window): each
        backward all-reduces what it added, so the window's gradient is the same sum (the loss of each micro-batch
        is already normalised over the whole window), at the cost of one all-reduce per micro-batch."""
        self._before_sync, self._window_model = (before_sync if last else None), model
        try:
            with contextlib.nullcontext() if last or self.args.accelerator_config.syncs_each_batch() else (
                    self.accelerator.no_sync(model)):
                yield
        finally:
            self._before_sync = None

    def backward(self, loss, learning_rate: float | None = None) -> None:
        """Backward of a micro-batch's loss, as normalised by the loop (Accelerate scales it for fp16); with
        `learning_rate`, the fused backward of a LOMO optimizer, which updates the parameters as it goes."""
        before, self._before_sync = self._before_sync, None
        if before is not None:  # the window's last micro-batch, before its gradient all-reduce
            before()
        self.accelerator.backward(loss, **({} if learning_rate is None else {"learning_rate": learning_rate}))

    def abandon_window(self) -> None:
        """Every process, after a window that all of them dropped (out of memory on one, before its gradient
        all-reduce): DDP starts the next window as after a finished one. Its reducer, which a forward of the last
        micro-batch readied for a backward that never ran, is reset (else the next no_sync backward would
        all-reduce on this process alone: a hang), and every process broadcasts buffers in its next forward."""
        model = self._window_model
        if isinstance(model, DistributedDataParallel):
            model.reducer._reset_state()  # torch's own reset, "so that forward can run despite a failed backward"
            model.require_forward_param_sync = True

    def scaler_handles_inf(self) -> bool:
        """Whether fp16 loss scaling owns inf gradients (it skips their step and lowers the scale), so that the
        non-finite guard looks at the loss only."""
        return self.accelerator.scaler is not None

    def skips_on_device(self, optimizer) -> bool:
        """Whether a non-finite step's update can be skipped on the device, without the host reading the verdict
        first: torch's fused Adam and AdamW (`_step_supports_amp_scaling`) skip their whole update, step counts
        included, where the `found_inf` the GradScaler hands them is 1, and a skipped first step leaves zero
        moments, as a step never taken would. Not fused SGD with momentum, whose skipped first step still makes its
        momentum buffer with torch.empty_like (whatever memory held) for the next step to read, nor Adagrad: only
        the skips known to be exact. Not with fp16 loss scaling (the scaler owns that flag and reads its own
        verdict), and on the plain backend only (FSDP's DTensor parameters and DeepSpeed's engine keep the
        synchronous check)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        return (self.skips_updates_on_device and self.accelerator.scaler is None
                and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
                and bool(getattr(inner, "_step_supports_amp_scaling", False)))

    def optimizer_step(self, optimizer, skip: Any = None) -> bool:
        """optimizer.step(); whether the update was applied. Under fp16 the scaler skips a step whose gradients
        hold inf or NaN and lowers its scale (its update(), inside Accelerate's step): Accelerate reports the skip
        (optimizer_step_was_skipped) only where the scaler did not call optimizer.step, never for a fused optimizer
        (torch's fused AdamW, the default), whose kernel skips the update itself. So the scale is compared as well,
        as transformers does: it drops exactly when the scaler found inf. The cost, fp16 only: reading the scale
        after the step is a host sync (the one before it is free, right after the step's check). With `skip` (the
        deferred check's device flag), the update is queued and skipped on the device where the flag is 1; the
        host reads nothing."""
        if skip is not None:  # skipped on the device where skip is 1, as the GradScaler skips a fused step
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.found_inf = skip
            try:
                optimizer.step()
            finally:
                del inner.found_inf
            return True
        scaler = self.accelerator.scaler
        before = scaler.get_scale() if scaler is not None else None
        optimizer.step()
        if self.accelerator.optimizer_step_was_skipped:
            return False
        return before is None or scaler.get_scale() >= before

    def step_skipped(self) -> None:
        """A step the non-finite guard skipped after clip_grad_norm_ unscaled its gradients: the fp16 scaler ends it
        as it ends a step it skips itself (update(): the scale backs off after inf gradients); otherwise the next
        step's unscale_ raises "unscale_() has already been called on this optimizer since the last update()"."""
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.update()

    def update_applied_despite_nonfinite(self) -> bool:
        """Whether a step found non-finite has already been applied, so that it cannot be skipped."""
        return False

    # -- saving ------------------------------------------------------------------------------------------

    def _is_peft(self, model) -> bool:
        return ckpt.is_peft_model(self.accelerator.unwrap_model(model))

    def state_dict_for_saving(self, model) -> dict | None:
        """The state dict that save_pretrained / save_weights writes (every rank must call it). A peft model's
        save_pretrained picks the adapter weights from the model itself (None): a frozen, maybe 4-bit, base is
        never gathered nor written."""
        return None if self._is_peft(model) else self.accelerator.get_state_dict(model)

    def writes_full_model(self, model) -> bool:
        """Whether a checkpoint holds the model in save_pretrained's form (rather than shards only)."""
        return True

    def write_model(self, folder: str, model, state_dict: dict | None) -> None:
        """Main process: the model files of a checkpoint, from `state_dict_for_saving`'s result."""
        ckpt.save_weights(self.accelerator.unwrap_model(model), folder, state_dict=state_dict)

    def rank_parts(self, folder: str, model, optimizer, copy=None) -> Callable[[], None]:
        """Every rank: what each process writes of a checkpoint itself, as a write to run later, with the state
        taken now (`copy`: host copies of its tensors, for a write in the background). Nothing here: the state is
        whole."""
        return lambda: None

    def optimizer_state(self, optimizer) -> dict | None:
        """The optimizer state the main process writes (optimizer.json + tensors) when it is whole on every
        process; None where every rank writes its part."""
        return optimizer.state_dict()

    # -- loading -----------------------------------------------------------------------------------------

    def load_weights(self, folder: str, model) -> None:
        """Every rank: the weights of a checkpoint of this kind of run into the model (as load_best_model_at_end
        loads them)."""
        ckpt.load_weights(self.accelerator.unwrap_model(model), folder)

    def load_training_state(self, folder: str, model, optimizer) -> None:
        """Every rank: the weights and optimizer state of a checkpoint, to resume from it; an FSDP run's shards
        are read whole (torch.distributed.checkpoint matches them by name and offsets)."""
        if checkpoint_kind(folder) == FSDP_KIND:
            load_shards(folder, self.accelerator.unwrap_model(model), optimizer, self._is_peft(model))
            return
        self.load_weights(folder, model)
        optimizer.load_state_dict(ckpt.load_state(folder, "optimizer"))

    def check_checkpoint(self, folder: str) -> None:
        """Refuse a checkpoint this kind of run cannot load (before any work): ZeRO partitions load only into
        DeepSpeed, a whole optimizer state not into FSDP shards."""
        saved = checkpoint_kind(folder)
        if saved not in self.resumes:
            accepted = " or ".join(f"{kind} run's" for kind in self.resumes)
            raise CheckpointError(f"{folder} was written by {saved} run and this is {self.kind} run, which resumes "
                                  f"{accepted} checkpoints: resume it with the fsdp / deepspeed / parallelism_config "
                                  "settings it was written with")


class FSDPBackend(Backend):
    """What FSDP1 and FSDP2 share: every rank writes and reads its own shards of the model and optimizer state
    (torch.distributed.checkpoint, in safetensors files). A checkpoint holds the full model too with
    state_dict_type FULL_STATE_DICT (the default), or for a peft adapter."""

    kind = FSDP_KIND
    resumes = (FSDP_KIND,)
    agrees_on_out_of_memory = False  # FSDP's forward gathers the parameters: a collective of every layer
    skips_updates_on_device = False

    def state_dict_for_saving(self, model) -> dict | None:
        """The full state dict, gathered across shards on the main process ({} on the others), or only the
        trainable parameters of a peft model (every rank must call it)."""
        return gather_full_model(model, trainable_only=self._is_peft(model))

    def writes_full_model(self, model) -> bool:
        """With state_dict_type FULL_STATE_DICT, or for a peft adapter (small); else shards only."""
        return gathers_full_model(self.accelerator) or self._is_peft(model)

    def write_model(self, folder: str, model, state_dict: dict | None) -> None:
        """The full model when it is gathered; otherwise the config of what the shards are the weights of, for
        `stoker consolidate`."""
        if self.writes_full_model(model):
            super().write_model(folder, model, state_dict)
            return
        model = self.accelerator.unwrap_model(model)
        if hasattr(model, "config"):
            config = copy.deepcopy(model.config)
            config.architectures = [model_class_name(model)]  # as save_pretrained records it
            config.save_pretrained(folder)

    def rank_parts(self, folder: str, model, optimizer, copy=None) -> Callable[[], None]:
        """Every rank its shards of the model (or of its trainable parameters) and of the optimizer state, planned
        with every rank now (a collective, whose failures every rank raises)."""
        return plan_shards(folder, model, optimizer, self.accelerator.is_main_process, self._is_peft(model), copy)

    def optimizer_state(self, optimizer) -> dict | None:
        """None: the optimizer state is in every rank's shards."""

    def load_weights(self, folder: str, model) -> None:
        """Every rank its shards of the checkpoint's model (or adapter), matched by name and offsets."""
        load_shards(folder, model, trainable_only=self._is_peft(model))

    def load_training_state(self, folder: str, model, optimizer) -> None:
        """Every rank its shards of the model and of the optimizer state."""
        load_shards(folder, model, optimizer, self._is_peft(model))


class FSDP2Backend(FSDPBackend):
    """FSDP2 (fully_shard): the parameters become DTensor shards in place, and Accelerate moves the optimizer
    onto the shards (the plain backend's prepare); the model stays usable by another train() call."""


class PlanShardedBackend(FSDPBackend):
    """Tensor parallelism and FSDP2 by the model's own plans (transformers' tp_plan and fsdp_plan): the model is
    sharded by transformers as from_pretrained(..., distributed_config=...) shards it, or taken as it is where it was
    sharded at load, and never wrapped in DDP: its DTensors reduce their own gradients (FSDP2 averaging them over
    its data-parallel ranks, as DDP does). Accelerate only patches its forward (mixed precision) and prepares the
    optimizer; its data loader hands the ranks of one tensor-parallel group the same rows. Every rank writes and
    reads its own shards (torch.distributed.checkpoint, as FSDP's), which resume in any layout of the same global
    batch (the plain backend reads them whole); it resumes a plain run's whole checkpoint too, each rank keeping
    its slices."""

    resumes = (FSDP_KIND, PLAIN_KIND)

    def __init__(self, accelerator, args):
        super().__init__(accelerator, args)
        config = accelerator.parallelism_config
        self.sharding = {name: getattr(config, name) for name in SIZES if getattr(config, name) != 1}
        self.kind = f"a {describe(config)}"  # as messages name this run: its layout, not the format it shares with FSDP

    def _prepare(self, model, source: OptimizerSource, max_steps: int) -> Prepared:
        """The model sharded (in place, so that another train() takes it as it is), then the optimizer built on
        its DTensor parameters."""
        acc = self.accelerator
        model = shard_with_plans(model, acc.parallelism_config, acc.device)
        model = acc.prepare_model(model, device_placement=False, evaluation_mode=True)
        optimizer, scheduler = source.build(model, max_steps)
        return Prepared(model, acc.prepare(optimizer), scheduler)

    def writes_full_model(self, model) -> bool:
        """Shards only: no FSDP plugin to ask for a full state dict, and no rank gathers the whole model."""
        return False

    def load_weights(self, folder: str, model) -> None:
        """Every rank its slices of the checkpoint's model: its shards, or a plain run's whole model."""
        if checkpoint_kind(folder) == PLAIN_KIND:
            load_whole(folder, self.accelerator.unwrap_model(model))
        else:
            super().load_weights(folder, model)

    def load_training_state(self, folder: str, model, optimizer) -> None:
        """Every rank its slices of the model and optimizer state: its shards, or a plain run's whole state."""
        if checkpoint_kind(folder) == PLAIN_KIND:
            load_whole(folder, self.accelerator.unwrap_model(model), optimizer)
        else:
            super().load_training_state(folder, model, optimizer)


class FSDP1Backend(FSDPBackend):
    """FSDP1 (FullyShardedDataParallel): it flattens the parameters into its own, so the model is wrapped first
    and the optimizer built on the flat parameters; that wrapping cannot be undone (train() runs once per
    Trainer)."""

    wraps_in_place = True

    def _prepare(self, model, source: OptimizerSource, max_steps: int) -> Prepared:
        """The model wrapped first, then the optimizer built on its flat parameters and prepared."""
        wrapped = self.accelerator.prepare(model)
        optimizer, scheduler = source.build(wrapped, max_steps)
        return Prepared(wrapped, self.accelerator.prepare(optimizer), scheduler)


class DeepSpeedBackend(Backend):
    """DeepSpeed: one engine of the model, optimizer and schedule, which steps inside backward at the end of a
    window. Every rank writes its ZeRO partition of the optimizer state; ZeRO-3 also partitions the parameters,
    which are gathered to save and loaded one module at a time. The engine cannot be built twice on one model."""

    kind = DEEPSPEED_KIND
    resumes = (DEEPSPEED_KIND,)
    saves_in_background = False  # the engine writes its partitions from its own state, which moves on
    wraps_in_place = True
    agrees_on_out_of_memory = False  # auto_find_batch_size is refused with DeepSpeed (it fixes the micro-batch)
    skips_updates_on_device = False  # the engine steps inside backward
    _loss_scale = 1  # what backward multiplies the loss by: the sequence-parallel group's size where DeepSpeed
    # averages the group's gradients (ZeRO-3 before deepspeed 0.20.2), whose shares of the loss must add up

    def _prepare(self, model, source: OptimizerSource, max_steps: int) -> Prepared:
        """Fill the config's "auto" values known only now (the schedule's steps), then one engine of the model,
        the optimizer and the schedule. An "optimizer" or "scheduler" section of the config is built by DeepSpeed
        (Accelerate's placeholders stand for it until then); otherwise stoker's own (or the given one) is handed
        to DeepSpeed."""
        from accelerate.utils import DummyOptim, DummyScheduler

        acc = self.accelerator
        finish_deepspeed_config(acc, self.args, max_steps)
        if splits_sequences(acc.parallelism_config):  # Accelerate registers the Ulysses attention in prepare
            fresh_sequence_parallelism(acc.parallelism_config.sp_handler.sp_attn_implementation)
            # where DeepSpeed averages a group's gradients, each rank's share of the loss is scaled back to a sum
            self._loss_scale = acc.parallelism_config.sp_size if averages_sequence_groups(zero_stage(acc)) else 1
        a, config = self.args, acc.state.deepspeed_plugin.deepspeed_config
        optimizer = source.given_optimizer
        if optimizer is None:
            optimizer = DummyOptim(parameter_groups(model, a.weight_decay), lr=a.learning_rate,
                                   weight_decay=a.weight_decay) if "optimizer" in config else (
                source.build_optimizer(model))
        scheduler = source.given_scheduler
        if scheduler is None:
            if "scheduler" in config:
                scheduler = DummyScheduler(optimizer, total_num_steps=max_steps)
            elif isinstance(optimizer, DummyOptim):  # stoker's schedule, on the optimizer DeepSpeed builds
                scheduler = DummyScheduler(
                    optimizer, lr_scheduler_callable=lambda opt: create_scheduler(opt, a, max_steps))
            else:
                scheduler = create_scheduler(optimizer, a, max_steps)
        return Prepared(*acc.prepare(model, optimizer, scheduler))

    @contextlib.contextmanager
    def micro_batch(self, model, last: bool, before_sync: Callable[[], None] | None = None):
        """As the plain backend's, and DeepSpeed steps (inside backward) on the window's last micro-batch only:
        Accelerate's sync_gradients says which; it is True again afterwards, since Accelerate's optimizer
        ignores step and zero_grad until it is."""
        self.accelerator.sync_gradients = last
        try:
            with super().micro_batch(model, last, before_sync):
                yield
        finally:
            self.accelerator.sync_gradients = True

    def backward(self, loss) -> None:
        """The loop normalises the loss over the whole window, so DeepSpeed must not divide it by the
        accumulation steps again."""
        before, self._before_sync = self._before_sync, None
        if before is not None:  # the window's last micro-batch, before DeepSpeed's gradient reduction
            before()
        self.accelerator.backward(loss * self._loss_scale if self._loss_scale != 1 else loss, scale_wrt_gas=False)

    def scaler_handles_inf(self) -> bool:
        """DeepSpeed's own fp16 loss scaler (with args.fp16), or Accelerate's."""
        return self.accelerator.scaler is not None or bool(self.args.fp16)

    def update_applied_despite_nonfinite(self) -> bool:
        """DeepSpeed applies the update inside its engine; its own overflow check skips some non-finite steps,
        not all, and one it did not skip cannot be undone."""
        return not self.accelerator.optimizer_step_was_skipped

    def _zero3(self) -> bool:
        return zero_stage(self.accelerator) == 3

    def state_dict_for_saving(self, model) -> dict | None:
        """As the plain backend's, but a peft adapter under ZeRO-3 is gathered whole on every rank (ZeRO-3 leaves
        each rank only its partition of a parameter)."""
        if self._is_peft(model) and self._zero3():
            return gather_trainable_zero3(model)
        return super().state_dict_for_saving(model)

    def rank_parts(self, folder: str, model, optimizer, copy=None) -> Callable[[], None]:
        """Every rank its ZeRO partition of the optimizer state, read from the engine when the write runs (so
        async_save is refused: saves_in_background)."""
        return lambda: save_zero_partition(folder, optimizer, self.accelerator.process_index)

    def optimizer_state(self, optimizer) -> dict | None:
        """None: the optimizer state is in every rank's partition."""

    def check_checkpoint(self, folder: str) -> None:
        """As the plain backend's, and the checkpoint's ZeRO partitions must be as many as the processes: stoker
        writes them in its own format (no pickle), which DeepSpeed's universal-checkpoint converter does not
        read, and DeepSpeed repartitions nothing else."""
        super().check_checkpoint(folder)
        written, world = zero_partitions_written(folder), self.accelerator.num_processes
        if written != world:
            raise CheckpointError(
                f"{folder} holds the ZeRO partitions of {written} processes and this run has {world}: DeepSpeed's "
                f"optimizer state resumes only on as many processes. Resume on {written} (torchrun "
                f"--nproc_per_node {written}, or accelerate launch --num_processes {written}), or start a new run "
                f"from its model (model_name_or_path={folder!r}: the weights, without the optimizer state)")

    def load_weights(self, folder: str, model) -> None:
        """Under ZeRO-3, one module at a time, gathered and partitioned again (no rank holds the whole model)."""
        if self._zero3():
            load_zero3_weights(model, folder, self.accelerator.is_main_process)
        else:
            super().load_weights(folder, model)

    def load_training_state(self, folder: str, model, optimizer) -> None:
        """The weights (ZeRO-3 takes the parameters from its partitions instead), then every rank's partition of
        the optimizer state."""
        acc = self.accelerator
        if not self._zero3():
            self.load_weights(folder, model)
        load_zero_partitions(folder, optimizer, acc.num_processes, acc.process_index)
