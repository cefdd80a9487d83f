"""Callbacks: the events of the training loop, the state they see and the controls they steer with.

The events, in the order the loop fires them; docs/architecture.md, "The step", outlines the loop itself
(`Trainer.train` down to `_optimizer_step`) with each event in its place::

    on_init_end            once, at the end of Trainer.__init__
    on_train_begin         once per train(), when the run is set up (state, loader, prepared model, checkpoint
                           restored), before the first epoch
    on_epoch_begin         at the start of every epoch
    on_step_begin          at the start of every optimizer step, before its window's first micro-batch
    on_substep_end         after every micro-batch's forward and backward but the window's last
    on_pre_optimizer_step  before the update: the gradients are final and clipped (not fired for an update that a
                           synchronous check skips as non-finite)
    on_optimizer_step      after the update (a deferred check may have skipped it on the device)
    on_step_end            after zero_grad and global_step += 1; DefaultFlowCallback sets should_log /
                           should_evaluate / should_save here, which the loop then acts on
    on_log                 for every log: a training window's, an evaluation's, the run's final metrics
    on_prediction_step     after every batch of an evaluation or of predict()
    on_evaluate            after every evaluation, with its metrics
    on_save                after every checkpoint's save (with async_save, its write may still be under way)
    on_epoch_end           at the end of every epoch, its last step's verdict read; epoch strategies log /
                           evaluate / save right after it
    on_train_end           once per train(), last: the run's metrics logged, the best model loaded
    on_predict             at the end of predict(), with its metrics

Callbacks receive `(args, state, control, **kwargs)` as in transformers (kwargs: model, optimizer,
lr_scheduler, train_dataloader, eval_dataloader, metrics, logs, ...), so an existing Hugging Face callback
keeps working. They observe and steer through `TrainerControl`; they never reach into the loop's locals.
The Trainer fires every event through `CallbackHandler.fire`; a Trainer subclass may fire one itself through the
handler's method of that name (`self.callback_handler.on_evaluate(args, state, control, metrics)`), as with
transformers' handler: the same callbacks, kwargs and cleared flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .arguments import suggest
from .log import logger

# Events in the order they are documented above. `TrainerCallback` has exactly these methods (tested).
EVENTS = (
    "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
    "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step",
    "on_evaluate", "on_save", "on_epoch_end", "on_train_end", "on_predict",
)
# Hooks that Hugging Face callbacks define but that have no meaning here; tolerated, never called.
FOREIGN_EVENTS = ("on_push_begin",)


@dataclass
class TrainerState:
    """What the loop knows about the run; saved as JSON with every checkpoint."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int = 0           # per-device micro-batch actually used
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    # transformers' format: class name -> {"args": ..., "attributes": ...} (a list when several of a class)
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def to_json_string(self) -> str:
        """Every field as indented JSON with sorted keys and a final newline (trainer_state.json's format)."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path: str) -> None:
        """Write to_json_string() to json_path, replacing the file."""
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def load_from_json(cls, json_path: str) -> TrainerState:
        """The state saved in json_path (by stoker or transformers); keys that are not fields are ignored."""
        with open(json_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerState:
        """A state from a dict of field values; keys that are not fields are ignored, missing fields default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def compute_steps(self, args, max_steps: int) -> None:
        """logging_steps, eval_steps and save_steps in steps: a value < 1 is a fraction of max_steps."""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * value) if value < 1 else int(value))


@dataclass
class TrainerControl:
    """Flags that callbacks set to steer the loop. The loop resets each flag once it has acted on it."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def state(self) -> dict[str, Any]:
        """The flags as transformers' ExportableState: {"args": every flag, "attributes": {}}; saved with a
        checkpoint, never restored (the run they steered has ended)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


def callback_states(callbacks, control: TrainerControl) -> dict[str, Any]:
    """The state of every stateful callback (one with a `state()` method, as transformers' ExportableState) and
    of the controls, keyed by class name as transformers keys them: a list when several share a class."""
    out: dict[str, Any] = {}
    for cb in [*callbacks, control]:
        if not callable(getattr(cb, "state", None)):
            continue
        name, values = type(cb).__name__, cb.state()
        if name not in out:
            out[name] = values
        else:
            out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [values]
    return out


def restore_callback_states(callbacks, stored: dict[str, Any]) -> list[str]:
    """Put saved states back into the callbacks of the same class, in order (transformers rebuilds them from
    "args" and sets "attributes"; here both are set on the callbacks the user holds). Returns the stored names
    no callback matched. The controls are not restored: the run they steered has ended."""
    missing = []
    for name, values in stored.items():
        if name == "TrainerControl":
            continue
        matching = [cb for cb in callbacks if type(cb).__name__ == name]
        if not matching:
            missing.append(name)
        for cb, one in zip(matching, values if isinstance(values, list) else [values], strict=False):
            for attribute, value in {**one.get("args", {}), **one.get("attributes", {})}.items():
                setattr(cb, attribute, value)
    return missing


class TrainerCallback:
    """Base class: one no-op method per event. Subclass it and override the events you need.

    A callback that keeps state across a resume (early stopping, say) implements `state()` returning
    {"args": its constructor's arguments, "attributes": what it has counted}, as transformers' ExportableState;
    the Trainer saves it with each checkpoint and, with restore_callback_states_from_checkpoint, restores it.
    """

    def on_init_end(self, args, state, control, **kwargs):
        """At the end of Trainer.__init__, once every callback is registered; nothing has run yet."""

    def on_train_begin(self, args, state, control, **kwargs):
        """At the start of train(), once max_steps and the step intervals are in `state` and a resumed run's
        state is loaded, before the first epoch (kwargs: train_dataloader). A callback may refuse the run by
        raising here, as EarlyStoppingCallback does."""

    def on_epoch_begin(self, args, state, control, **kwargs):
        """At the start of every epoch, a resumed one included, before its first window is read."""

    def on_step_begin(self, args, state, control, **kwargs):
        """Before the first forward of each optimizer step's window of gradient_accumulation_steps micro-batches;
        state.global_step is still the previous step's."""

    def on_substep_end(self, args, state, control, **kwargs):
        """After the backward of every micro-batch of a window but its last, while gradients still accumulate
        (unsynchronised across processes)."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Before optimizer.step(), with the window's gradients final, synchronised and clipped. Not fired for a
        step whose loss or gradient norm is non-finite: that update is skipped."""

    def on_optimizer_step(self, args, state, control, **kwargs):
        """Right after optimizer.step(), before the scheduler steps and the gradients are zeroed. Fired exactly
        when on_pre_optimizer_step was."""

    def on_step_end(self, args, state, control, **kwargs):
        """After every optimizer step (also one whose non-finite update was skipped), with state.global_step and
        state.epoch counting it. The place to steer: set control.should_log / should_evaluate / should_save /
        should_training_stop / should_epoch_stop, which the loop acts on right after."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Each time Trainer.log records `logs` (training logs, evaluation metrics, the final train metrics),
        after they are appended to state.log_history. Fired on every process; write once by checking
        state.is_world_process_zero."""

    def on_prediction_step(self, args, state, control, **kwargs):
        """After each batch of evaluate() or predict() (every process, every batch)."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """After evaluate() has computed and logged `metrics` (prefixed eval_ by default; once per set for a dict
        of eval sets), in training or called directly. state.best_metric still holds the previous best here. A
        callback may set should_training_stop."""

    def on_save(self, args, state, control, **kwargs):
        """After a checkpoint is completely written and committed by every process (and old ones rotated)."""

    def on_epoch_end(self, args, state, control, **kwargs):
        """At the end of every epoch (also one cut short by should_epoch_stop or should_training_stop), before
        the epoch-strategy log / evaluate / save; a callback may set those flags here."""

    def on_train_end(self, args, state, control, **kwargs):
        """At the end of train(), after the run's metrics are logged and the best model is loaded (with
        load_best_model_at_end); control flags set here are not acted on."""

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        """At the end of predict(), with its `metrics` (prefixed test_ by default); not fired by evaluate()."""


# The flags transformers' CallbackHandler clears before it calls the callbacks of an event: what the event is
# about to act on, or a new run / epoch / step. The loop and a subclass calling an on_<event> method get the same.
CLEARED_BY = {
    "on_train_begin": ("should_training_stop",),
    "on_epoch_begin": ("should_epoch_stop",),
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_log": ("should_log",),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
}


# transformers' own logger names, on which its warnings about callbacks are emitted: a script (or a test) that
# watches them sees the same records from stoker. logging.getLogger is the logger transformers' get_logger
# returns, without importing transformers.
hf_callback_logger = logging.getLogger("transformers.trainer_callback")


# each event's no-op method of the base class, which the handler skips
_NO_OPS = {event: getattr(TrainerCallback, event) for event in EVENTS}


class CallbackHandler:
    """Calls every callback for an event, in order; a callback may return a new TrainerControl.

    The surface of transformers' CallbackHandler, which Trainer subclasses call (transformers' question-answering
    example fires `self.callback_handler.on_evaluate(args, state, control, metrics)` from its own evaluate()):
    one on_<event> method per event, each the same `fire` the loop uses, returning the control; `callbacks`,
    `callback_list`, add_callback / pop_callback / remove_callback; and the objects every callback receives as
    kwargs: `model`, `processing_class`, `optimizer`, `lr_scheduler`, `train_dataloader`, `eval_dataloader`
    (the Trainer sets them: at construction, when train() has prepared the run, when an evaluation starts).

    `callbacks` is the list a script sees and edits (as transformers'); `writers` are stoker's own record
    writers (metrics.jsonl), fired before it on every event but kept out of it, so that the list is
    transformers' list and removing or popping a callback by class never removes them.
    """

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None, writers=()):
        self.callbacks: list = []
        self.writers: list = list(writers)
        for cb in callbacks:
            self.add_callback(cb)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = self.eval_dataloader = None

    def add_callback(self, callback):
        """Register a callback (an instance, or a class to instantiate); a second one of a class is added with
        transformers' warning, and one defining an unknown on_ method is refused."""
        cb = callback() if isinstance(callback, type) else callback
        hooks = [m for m in dir(cb) if m.startswith("on_") and callable(getattr(cb, m))]
        unknown = [m for m in hooks if m not in EVENTS + FOREIGN_EVENTS]
        if unknown:
            # A misspelled hook would otherwise never fire and nobody would notice.
            raise ValueError(f"callback {type(cb).__name__} defines unknown event(s) "
                             + ", ".join(f"{m}{suggest(m, EVENTS)}" for m in unknown)
                             + f"; events are: {', '.join(EVENTS)}")
        cb_class = callback if isinstance(callback, type) else type(callback)
        if cb_class in [type(c) for c in self.callbacks]:
            # transformers' words (its missing spaces included), on its logger
            hf_callback_logger.warning(
                f"You are adding a {cb_class} to the callbacks of this Trainer, but there is already one. The current"
                + "list of callbacks is\n:" + self.callback_list)
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        """Unregister and return the callback (the instance, or the first of a class); None if not registered."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        """Unregister the callback (the instance, or the first of a class), as transformers: an instance that is
        not registered raises ValueError."""
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"{callback!r} is not a registered callback")

    @property
    def callback_list(self) -> str:
        """The class names of the callbacks, one a line (what transformers' warnings print)."""
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def fire(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs) -> TrainerControl:
        """Call `event` on every callback that has it, with the handler's objects and `kwargs`; returns the
        control (the last one a callback returned, else the one given, with the CLEARED_BY flags of the event
        cleared first)."""
        for flag in CLEARED_BY.get(event, ()):
            setattr(control, flag, False)
        kwargs = {"model": self.model, "processing_class": self.processing_class, "optimizer": self.optimizer,
                  "lr_scheduler": self.lr_scheduler, "train_dataloader": self.train_dataloader,
                  "eval_dataloader": self.eval_dataloader, **kwargs}
        for cb in [*self.writers, *self.callbacks]:
            method = getattr(cb, event, None)
            # TrainerCallback's own no-op is not called: a step fires four events through every callback
            if method is None or getattr(method, "__func__", None) is _NO_OPS.get(event):
                continue
            result = method(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control

    # transformers' one method per event: each is fire(event), with the arguments transformers names
    def on_init_end(self, args, state, control, **kwargs):
        return self.fire("on_init_end", args, state, control, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        return self.fire("on_train_begin", args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        return self.fire("on_epoch_begin", args, state, control, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        return self.fire("on_step_begin", args, state, control, **kwargs)

    def on_substep_end(self, args, state, control, **kwargs):
        return self.fire("on_substep_end", args, state, control, **kwargs)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        return self.fire("on_pre_optimizer_step", args, state, control, **kwargs)

    def on_optimizer_step(self, args, state, control, **kwargs):
        return self.fire("on_optimizer_step", args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        return self.fire("on_step_end", args, state, control, **kwargs)

    def on_log(self, args, state, control, logs, **kwargs):
        return self.fire("on_log", args, state, control, logs=logs, **kwargs)

    def on_prediction_step(self, args, state, control, **kwargs):
        return self.fire("on_prediction_step", args, state, control, **kwargs)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        return self.fire("on_evaluate", args, state, control, metrics=metrics, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        return self.fire("on_save", args, state, control, **kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self.fire("on_epoch_end", args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        return self.fire("on_train_end", args, state, control, **kwargs)

    def on_predict(self, args, state, control, metrics, **kwargs):
        return self.fire("on_predict", args, state, control, metrics=metrics, **kwargs)

    def on_push_begin(self, args, state, control, **kwargs):
        """transformers' event before a push to the Hub; stoker never pushes, so only a subclass fires it."""
        return self.fire("on_push_begin", args, state, control, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Built-in callbacks


def _is_due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class DefaultFlowCallback(TrainerCallback):
    """Turns the logging / evaluation / saving strategies into TrainerControl flags."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        log_due, eval_due, save_due = (every > 0 and step % every == 0
                                       for every in (state.logging_steps, state.eval_steps, state.save_steps))
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and log_due:
            control.should_log = True
        if args.eval_strategy == "steps" and eval_due and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and save_due:
            control.should_save = True
        if step >= state.max_steps:  # as transformers: the loss of steps after the last log goes into train_loss
            control.should_training_stop = True
            if args.eval_strategy == "steps" and not eval_due:
                control.should_evaluate = True  # always end with the metrics of the final model
            if args.save_strategy == "steps":
                control.should_save = True  # always end with a checkpoint of the final step
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def format_logs(logs: dict[str, Any]) -> str:
    parts = []
    for k, v in logs.items():
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


class ProgressCallback(TrainerCallback):
    """A live tqdm bar on a terminal; elsewhere (CI, log files) a progress line every 5% of the run, with the time
    left at the pace of this train() call's own steps (a resumed run's steps before its checkpoint took no time
    of it)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar = None
        self.started = 0.0
        self.first_step = 0  # the step this train() call started from

    def _live(self, args) -> bool:
        return not args.disable_tqdm and getattr(self.stream, "isatty", lambda: False)()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.first_step = time.perf_counter(), state.global_step
        if state.is_world_process_zero and self._live(args):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, file=self.stream, dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
        elif _is_due(state.global_step, max(1, state.max_steps // 20)) or state.global_step == state.max_steps:
            elapsed = time.perf_counter() - self.started
            done = state.global_step - self.first_step
            left = elapsed / done * (state.max_steps - state.global_step) if done > 0 else math.nan
            print(f"[stoker] step {state.global_step}/{state.max_steps} "
                  f"({100 * state.global_step / state.max_steps:.0f}%) epoch {state.epoch:.2f} "
                  f"elapsed {elapsed:.1f}s, left {left:.1f}s", file=self.stream, flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = f"[stoker] step {state.global_step}: {format_logs(logs)}"
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """What transformers shows with disable_tqdm=True instead of a progress bar: each log as a dict on stdout
    (floats to 4 significant digits, total_flos left out of what the later callbacks see, as in transformers),
    on the local main process."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        logs.pop("total_flos", None)
        if state.is_local_process_zero:
            print({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items()}, flush=True)


# transformers' default callbacks, before the progress callback (ProgressCallback, or PrinterCallback with
# disable_tqdm=True) that the Trainer adds after the callbacks it is given
DEFAULT_CALLBACKS = [DefaultFlowCallback]


class JsonlLoggerCallback(TrainerCallback):
    """Appends every log record to output_dir/metrics.jsonl (one JSON object per line, main process only), with
    stoker's diagnostics of the record (throughput, data waiting, MFU, peak memory), which log_history leaves
    out as transformers does, and the id of the run (`run_id`, which checkpoints carry too: a resumed run goes on
    with its checkpoint's), which the Trainer sets when a run starts."""

    run_id: str | None = None

    def on_log(self, args, state, control, logs=None, diagnostics=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        import os

        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, **logs, "epoch": round(state.epoch, 4), **(diagnostics or {})}
        if self.run_id is not None:
            record["run_id"] = self.run_id
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


TENSORBOARD_DIR = "TENSORBOARD_LOGGING_DIR"


def summary_writer_class():
    """torch's SummaryWriter (it needs the tensorboard package), else tensorboardX's, as transformers chooses."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from tensorboardX import SummaryWriter
    return SummaryWriter


class TensorBoardCallback(TrainerCallback):
    """Writes every numeric log value as a TensorBoard scalar, with torch's writer or tensorboardX's, into
    transformers 5's folder: TENSORBOARD_LOGGING_DIR (read when the callback is made, `~` expanded) when set,
    else logging_dir (transformers 4's field, kept; its default is transformers' output_dir/runs/<date>_<host>);
    a hyperparameter-search trial writes into logging_dir/<trial name>, as transformers ignores the variable there."""

    def __init__(self):
        self.writer = None
        self.logging_dir = os.getenv(TENSORBOARD_DIR)
        if self.logging_dir is not None:
            self.logging_dir = os.path.expanduser(self.logging_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if state.is_hyper_param_search and state.trial_name is not None:
            self.logging_dir = os.path.join(args.logging_dir, state.trial_name)
        elif self.logging_dir is None:
            self.logging_dir = args.logging_dir
        if self.writer is None:
            self.writer = summary_writer_class()(log_dir=self.logging_dir)
            self.writer.add_text("args", args.to_json_string())

    def on_log(self, args, state, control, logs=None, diagnostics=None, **kwargs):
        if self.writer is None or not logs:
            return
        for k, v in {**logs, **(diagnostics or {})}.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                tag = k.replace("eval_", "eval/", 1) if k.startswith("eval_") else f"train/{k}"
                self.writer.add_scalar(tag, v, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def integration_callbacks(report_to: list[str]) -> list:
    """One callback per tracker of a resolved report_to (stoker.tracking): TensorBoardCallback for tensorboard,
    transformers' own for the others, whose module (seconds to import) is imported only when one is named."""
    out = [TensorBoardCallback()] if "tensorboard" in report_to else []
    others = [name for name in report_to if name != "tensorboard"]
    if others:
        from transformers.integrations import get_reporting_integration_callbacks

        out += [cls() for cls in get_reporting_integration_callbacks(others)]
    return out


class EarlyStoppingCallback(TrainerCallback):
    """Stops training when metric_for_best_model has not improved by more than `early_stopping_threshold`
    for `early_stopping_patience` evaluations in a row. Its counter is a stateful callback's attribute."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0):
        if early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience={early_stopping_patience!r}: must be >= 1")
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement

    def on_train_begin(self, args, state, control, **kwargs):
        """Raises ValueError unless metric_for_best_model is set and eval_strategy is not 'no'."""
        if args.metric_for_best_model is None or args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs metric_for_best_model and an eval_strategy other than 'no'")

    def check_metric_value(self, args, state, control, metric_value) -> None:
        """Reset the counter if metric_value beats state.best_metric by more than the threshold, else count."""
        best = state.best_metric
        sign = 1 if args.greater_is_better else -1
        # state.best_metric is updated after on_evaluate, so it still holds the previous best here
        if best is None or sign * (metric_value - best) > self.early_stopping_threshold:
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Count this evaluation against patience and set should_training_stop once it is used up. Raises
        KeyError if metric_for_best_model (with or without its eval_ prefix) is not among the metrics."""
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            raise KeyError(f"EarlyStoppingCallback: metric_for_best_model={name!r} is not among the evaluation "
                           f"metrics {sorted(metrics or {})}")
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
            if state.is_world_process_zero:
                logger.info(f"early stopping at step {state.global_step}: {key}={value:.4g} has not improved on "
                            f"{state.best_metric} for {self.early_stopping_patience} evaluation(s)")

    def state(self) -> dict[str, Any]:
        """{"args": patience and threshold, "attributes": the counter}, saved with each checkpoint so that a
        resumed run keeps counting (with restore_callback_states_from_checkpoint)."""
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}
