"""One train() call, and the one owner of its state.

`Run` is built by `Trainer._start_run` before the first step, passed down through the loop and gone when train()
returns. What a run *is* is one list, `Run.parts()`: the model as trained, the optimizer, the schedule, the fp16
scaler, the TrainerState's progress, the callbacks' states and the controls, where the loop stands in the data, the
log's sums since the last log, the spike rollback's quarantine and recent losses, and the random streams. Each part
has `state_dict()` / `load_state_dict()` (torch's `Stateful` shape), and so has the run: `Run.state_dict()` is
every part's state, `Run.load_state_dict()` puts each one back, in the list's order (the random streams last, so
that nothing draws from them after they are restored).

Everything that keeps or moves a run reads it through that one list:

    a checkpoint       stoker.checkpointer writes every part (the model and optimizer through the backend, in its
                       layout) and a resume hands the parts it read back to `load_state_dict`
    the spike rollback stoker.rollback copies `state_dict()` to host memory and puts it back the same way
    an elastic resume  the checkpointer regroups the per-process parts (the log's sums, the random streams) for
                       another number of processes or another parallel layout before loading them (the ranks of a
                       tensor-parallel group hold the same ones)

A part added to the list is carried by all three, as `tests/unit/test_run.py` checks with a part of its own. The
Trainer keeps transformers' attributes (`state`, `control`, `optimizer`, `lr_scheduler`, `model_wrapped`) for
scripts and callbacks; the run holds the same objects, and restores them in place.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from .callbacks import TrainerControl, TrainerState, callback_states, restore_callback_states
from .checkpointer import Checkpointer, rng_state, set_rng_state
from .goodput import Ledger
from .rollback import SpikeRollback
from .step import LogSums, LoopPosition, MicroBatchHalver, NonFinitePolicy, PreemptionSignals, StepCheck


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own part: an FSDP2 DTensor's shard on this process, else the tensor."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def _inner(optimizer):
    """The torch optimizer under Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


class TrainedWeights:
    """What an update changes in the model: its trainable parameters and every buffer (frozen weights, a LoRA run's
    base or a QLoRA run's 4-bit ones, never change), each as this process's own part. A checkpoint writes the model
    through its backend instead, in the backend's layout."""

    def __init__(self, model):
        self.model = model

    def _tensors(self) -> list[torch.Tensor]:
        return [*(p for p in self.model.parameters() if p.requires_grad), *self.model.buffers()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): local(t) for i, t in enumerate(self._tensors())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, t in enumerate(self._tensors()):
                local(t).copy_(state[str(i)], non_blocking=True)


class OptimizerState:
    """The optimizer's per-parameter state (its tensors this process's own part) and its groups' hyperparameters,
    keyed by the parameter's position in the groups. Loading copies into the live state tensors in place (a sharded
    one stays sharded) and drops the state of parameters that had none when it was taken."""

    def __init__(self, optimizer):
        self.optimizer = _inner(optimizer)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state
        return {"state": {str(i): {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in state[p].items()}
                          for i, p in enumerate(self._params()) if p in state},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.optimizer.state
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                if str(i) not in saved["state"]:
                    state.pop(p, None)  # its first update came later
                    continue
                live = state.get(p, {})
                for k, v in saved["state"][str(i)].items():
                    if not isinstance(v, torch.Tensor):
                        live[k] = v
                    elif isinstance(live.get(k), torch.Tensor) and local(live[k]).shape == v.shape:
                        local(live[k]).copy_(v, non_blocking=True)
                    else:
                        live[k] = v.to(p.device, copy=True)
                state[p] = live
        for group, values in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            group.update(values)


class Progress:
    """The TrainerState's fields that training moves on (the rest is the run's configuration, set at its start)."""

    FIELDS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
              "best_global_step", "best_model_checkpoint")

    def __init__(self, state: TrainerState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name) for name in self.FIELDS}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name in self.FIELDS:
            setattr(self.state, name, saved[name])


class CallbackStates:
    """The stateful callbacks' states (transformers' ExportableState) and the controls; loading puts the callbacks'
    states back and clears the controls' flags (the steps that raised them are undone)."""

    def __init__(self, callbacks: list, control: TrainerControl):
        self.callbacks, self.control = callbacks, control

    def state_dict(self) -> dict[str, Any]:
        return callback_states(self.callbacks, self.control)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        missing = restore_callback_states(self.callbacks, saved)
        if missing:  # transformers' words, on its trainer's logger
            logging.getLogger("transformers.trainer").warning(
                "Checkpoint included callbacks not included in current configuration. Ignoring. "
                f"({', '.join(missing)})")
        for name in vars(self.control):
            if name.startswith("should_"):
                setattr(self.control, name, False)


class RandomStreams:
    """This process's random number generators: Python's, numpy's, torch's CPU and CUDA ones (the checkpointer's
    own reading and setting of them)."""

    state_dict = staticmethod(rng_state)
    load_state_dict = staticmethod(set_rng_state)


@dataclasses.dataclass
class Run:
    """One train() call: the objects it trains and the pieces of its loop. The Trainer itself keeps transformers'
    attributes (the same model, optimizer, schedule, state and controls) and its configuration only."""

    model: Any  # as trained: wrapped by DDP, FSDP or DeepSpeed, compiled
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any  # its fp16 scaler, if any, is part of the run
    state: TrainerState
    control: TrainerControl
    callbacks: list
    position: LoopPosition
    log: LogSums
    checkpointer: Checkpointer
    train_dataloader: Any  # prepared; rebuilt at the same sample when the micro-batch is halved
    steps_per_epoch: int | None  # None for a dataset without a length
    halver: MicroBatchHalver
    nonfinite: NonFinitePolicy
    check: StepCheck  # the step's one check: deferred to the next step where the update skips on the device
    schedule_per_step: bool  # False for a schedule that steps on an evaluation metric (ReduceLROnPlateau)
    signals: PreemptionSignals
    resumed: bool
    rollback: SpikeRollback | None = None  # spike_rollback, or rows a resumed run keeps skipping
    ignore_keys_for_eval: list[str] | None = None
    rows_checked: bool = False  # the first training batch has been checked against the model (trainer_checks)
    started: float = dataclasses.field(default_factory=time.time)  # wall clock, as transformers' speed metrics
    ledger: Ledger = dataclasses.field(default_factory=Ledger)  # where the call's wall time goes (stoker.goodput)

    def parts(self) -> dict[str, Any]:
        """What a run is, in the order it is put back: each part has state_dict() and load_state_dict()."""
        parts = {"model": TrainedWeights(self.model), "optimizer": OptimizerState(self.optimizer),
                 "scheduler": self.lr_scheduler}
        if self.accelerator.scaler is not None:
            parts["scaler"] = self.accelerator.scaler
        parts.update(trainer_state=Progress(self.state), callbacks=CallbackStates(self.callbacks, self.control),
                     position=self.position, log=self.log)
        if self.rollback is not None:
            parts["spike"] = self.rollback
        parts["rng"] = RandomStreams()
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Every part's state, its tensors the live ones (copy them to keep them)."""
        return {name: part.state_dict() for name, part in self.parts().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back the parts `state` holds (a checkpoint loads the model and optimizer through its backend, and
        leaves out what it does not restore), in the list's order."""
        for name, part in self.parts().items():
            if name in state:
                part.load_state_dict(state[name])
        self.state.train_batch_size = self.position.micro_batch
