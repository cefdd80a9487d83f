"""Callbacks: the documented event list, how often each event fires, steering through TrainerControl, and the
built-in callbacks (early stopping, progress lines, TensorBoard, metrics.jsonl)."""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter

import pytest

import stoker.callbacks
from stoker import EarlyStoppingCallback, Trainer, TrainerCallback, TrainerControl, TrainerState
from stoker.callbacks import EVENTS, PrinterCallback, ProgressCallback


class Recorder(TrainerCallback):
    """Counts every event and remembers the global step at which it fired."""

    def __init__(self):
        self.counts = Counter()
        self.steps: dict[str, list[int]] = {}
        self.logs: list[dict] = []
        self.metrics: list[dict] = []


def _recording(event):
    def method(self, args, state, control, **kwargs):
        self.counts[event] += 1
        self.steps.setdefault(event, []).append(state.global_step)
        if event == "on_log":
            self.logs.append(dict(kwargs["logs"]))
        if event == "on_evaluate":
            self.metrics.append(dict(kwargs["metrics"]))

    method.__name__ = event
    return method


for _event in EVENTS:
    setattr(Recorder, _event, _recording(_event))


class StopAt(TrainerCallback):
    """Sets one control flag in on_step_end at the given global steps: on the control it is given, or (returned)
    on a new TrainerControl it returns, which transformers' contract lets replace the Trainer's."""

    def __init__(self, flag: str, steps, returned: bool = False):
        self.flag, self.steps, self.returned = flag, set(steps), returned

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            if self.returned:
                return TrainerControl(**{self.flag: True})
            setattr(control, self.flag, True)


# ---------------------------------------------------------------------------------------------------
# the event list


def test_docstring_events_equal_base_class_methods_and_events():
    named = re.findall(r"\bon_[a-z_]+", stoker.callbacks.__doc__)
    documented = set(named)
    methods = {m for m in vars(TrainerCallback) if m.startswith("on_") and callable(getattr(TrainerCallback, m))}
    assert documented == methods == set(EVENTS)
    assert len(EVENTS) == len(set(EVENTS))
    assert list(dict.fromkeys(named)) == list(EVENTS)  # the docstring lists them in the order the loop fires them


# ---------------------------------------------------------------------------------------------------
# how often each event fires


def test_event_counts_in_a_known_run(tiny_llama, clm_rows, make_args):
    # 24 rows / batch 4 = 6 micro-batches per epoch; accumulation 2 -> 3 optimizer steps per epoch, 6 in all
    args = make_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
                     logging_steps=2, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4)
    rec = Recorder()
    trainer = Trainer(tiny_llama(), args, train_dataset=clm_rows(24), eval_dataset=clm_rows(8, seed=1),
                      callbacks=[rec])
    out = trainer.train()
    assert out.global_step == 6
    expected = {
        "on_init_end": 1, "on_train_begin": 1, "on_epoch_begin": 2, "on_epoch_end": 2,
        "on_step_begin": 6, "on_step_end": 6, "on_pre_optimizer_step": 6, "on_optimizer_step": 6,
        "on_substep_end": 6,        # one per window of 2: after its first micro-batch
        "on_evaluate": 2,           # steps 3 and 6
        "on_prediction_step": 4,    # 8 eval rows / batch 4 = 2 batches, x 2 evaluations
        "on_log": 6,                # train logs at 2, 4, 6 + 2 eval logs + the final train metrics
        "on_train_end": 1,
        "on_save": 0, "on_predict": 0,
    }
    assert {e: rec.counts[e] for e in EVENTS} == expected
    assert rec.steps["on_evaluate"] == [3, 6]
    assert rec.steps["on_log"] == [2, 3, 4, 6, 6, 6]
    assert rec.steps["on_epoch_begin"] == [0, 3]
    assert rec.steps["on_step_end"] == [1, 2, 3, 4, 5, 6]
    kinds = ["loss" if "loss" in logs else "eval" if "eval_loss" in logs else "train" for logs in rec.logs]
    assert kinds == ["loss", "eval", "loss", "loss", "eval", "train"]
    assert "train_loss" in rec.logs[-1]
    assert all("eval_loss" in m for m in rec.metrics)


def test_short_last_window_fires_no_substep_end(tiny_llama, clm_rows, make_args):
    # 20 rows / batch 4 = 5 micro-batches per epoch: windows of 2, 2, 1 -> 3 steps, 2 substep_ends per epoch
    args = make_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
                     logging_steps=100)
    rec = Recorder()
    out = Trainer(tiny_llama(), args, train_dataset=clm_rows(20), callbacks=[rec]).train()
    assert out.global_step == 6
    assert rec.counts["on_substep_end"] == 4
    assert rec.counts["on_step_begin"] == rec.counts["on_step_end"] == 6
    assert rec.steps["on_epoch_end"] == [3, 6]
    # the substep_ends belong to steps 1, 2 (not 3) and 4, 5 (not 6): global_step is the last finished step
    assert rec.steps["on_substep_end"] == [0, 1, 3, 4]


# ---------------------------------------------------------------------------------------------------
# registering callbacks


def test_misspelled_hook_is_rejected(tiny_llama, clm_rows, make_args):
    class Typo(TrainerCallback):
        def on_stepend(self, args, state, control, **kwargs): ...

    with pytest.raises(ValueError, match="'on_step_end'"):
        Trainer(tiny_llama(), make_args(), train_dataset=clm_rows(8), callbacks=[Typo()])
    trainer = Trainer(tiny_llama(), make_args(), train_dataset=clm_rows(8))
    with pytest.raises(ValueError, match="on_stepend"):
        trainer.add_callback(Typo)


def test_callback_classes_are_instantiated(tiny_llama, clm_rows, make_args):
    trainer = Trainer(tiny_llama(), make_args(), train_dataset=clm_rows(8), callbacks=[Recorder])
    recorders = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder)]
    assert len(recorders) == 1
    assert recorders[0].counts["on_init_end"] == 1


def test_hugging_face_callbacks_work(tiny_llama, clm_rows, make_args):
    import transformers

    class HFLogs(transformers.TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    cb = HFLogs()
    Trainer(tiny_llama(), make_args(max_steps=2, logging_steps=1), train_dataset=clm_rows(8),
            callbacks=[cb]).train()
    assert [("loss" in logs) for logs in cb.logs] == [True, True, False]
    assert "train_loss" in cb.logs[-1]


def test_add_remove_pop_callback(tiny_llama, clm_rows, make_args):
    trainer = Trainer(tiny_llama(), make_args(max_steps=1), train_dataset=clm_rows(8))
    kept, removed, popped = Recorder(), Recorder(), Recorder()
    for cb in (kept, removed, popped):
        trainer.add_callback(cb)
    callbacks = trainer.callback_handler.callbacks
    assert all(any(c is cb for c in callbacks) for cb in (kept, removed, popped))

    trainer.remove_callback(removed)
    assert trainer.pop_callback(popped) is popped
    assert not any(c is removed or c is popped for c in callbacks)
    default_printer = trainer.pop_callback(PrinterCallback)  # by class (disable_tqdm=True's progress display)
    assert isinstance(default_printer, PrinterCallback)
    assert not any(isinstance(c, PrinterCallback) for c in callbacks)
    assert trainer.pop_callback(PrinterCallback) is None

    trainer.train()
    assert kept.counts["on_step_end"] == 1
    assert removed.counts["on_step_end"] == popped.counts["on_step_end"] == 0


# ---------------------------------------------------------------------------------------------------
# steering through TrainerControl


@pytest.mark.parametrize("returned", [False, True], ids=["set-in-place", "returned"])
def test_should_training_stop(tiny_llama, clm_rows, make_args, returned):
    rec = Recorder()
    out = Trainer(tiny_llama(), make_args(max_steps=6), train_dataset=clm_rows(24),
                  callbacks=[StopAt("should_training_stop", {2}, returned), rec]).train()
    assert out.global_step == 2
    assert rec.counts["on_step_end"] == 2
    assert rec.counts["on_train_end"] == 1


def test_a_returned_control_keeps_max_steps_as_transformers_does(tiny_llama, clm_rows, make_args):
    # a callback returning a new TrainerControl at step 2 replaces the Trainer's: the stop that max_steps sets
    # at step 5 must land on the object the loop reads (one epoch of 24 rows / 4 is 6 steps)
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArguments

    from stoker.data import PaddingCollator

    rows = clm_rows(24)
    ours = Trainer(tiny_llama(), make_args(max_steps=5), train_dataset=rows,
                   callbacks=[StopAt("should_log", {2}, returned=True)]).train()
    hf_args = HFArguments(output_dir=make_args().output_dir, max_steps=5, per_device_train_batch_size=4,
                          report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    theirs = HFTrainer(tiny_llama(), hf_args, train_dataset=rows, data_collator=PaddingCollator(0),
                       callbacks=[StopAt("should_log", {2}, returned=True)]).train()
    assert ours.global_step == theirs.global_step == 5


@pytest.mark.parametrize("returned", [False, True], ids=["set-in-place", "returned"])
def test_should_epoch_stop_moves_to_the_next_epoch(tiny_llama, clm_rows, make_args, returned):
    # 12 rows / batch 4 = 3 steps per epoch, 2 epochs; epoch 0 is cut after its first step
    rec = Recorder()
    out = Trainer(tiny_llama(), make_args(num_train_epochs=2), train_dataset=clm_rows(12),
                  callbacks=[StopAt("should_epoch_stop", {1}, returned), rec]).train()
    assert rec.steps["on_epoch_begin"] == [0, 1]
    assert rec.steps["on_epoch_end"] == [1, 4]
    assert out.global_step == 4


@pytest.mark.parametrize("returned", [False, True], ids=["set-in-place", "returned"])
def test_should_evaluate_and_should_log_from_a_callback(tiny_llama, clm_rows, make_args, returned):
    rec = Recorder()
    args = make_args(max_steps=4, logging_steps=0, logging_strategy="no", eval_strategy="no")
    Trainer(tiny_llama(), args, train_dataset=clm_rows(16), eval_dataset=clm_rows(4, seed=1),
            callbacks=[StopAt("should_evaluate", {2}, returned), StopAt("should_log", {3}, returned), rec]).train()
    assert rec.steps["on_evaluate"] == [2]
    assert [step for step, log in zip(rec.steps["on_log"], rec.logs, strict=True) if "loss" in log] == [3]


def test_a_stop_request_does_not_carry_into_the_next_train_call(tiny_llama, clm_rows, make_args):
    # as in transformers, each train() is a run of its own: a should_training_stop set in the previous run
    # (by early stopping, say) must not end the next one after its first step
    stop = StopAt("should_training_stop", {2})
    trainer = Trainer(tiny_llama(), make_args(num_train_epochs=2), train_dataset=clm_rows(12), callbacks=[stop])
    assert trainer.train().global_step == 2
    trainer.remove_callback(stop)
    rec = Recorder()
    trainer.add_callback(rec)
    out = trainer.train()
    assert rec.counts["on_step_end"] == 6
    assert out.global_step == 6


@pytest.mark.parametrize("returned", [False, True], ids=["set-in-place", "returned"])
def test_should_save_from_a_callback(tiny_llama, clm_rows, make_args, tmp_path, returned):
    args = make_args(max_steps=2, save_strategy="no", output_dir=str(tmp_path / "run"))
    rec = Recorder()
    Trainer(tiny_llama(), args, train_dataset=clm_rows(8),
            callbacks=[StopAt("should_save", {1}, returned), rec]).train()
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1"]
    assert (tmp_path / "run" / "checkpoint-1" / "manifest.json").is_file()
    assert rec.steps.get("on_save") == [1]


# ---------------------------------------------------------------------------------------------------
# EarlyStoppingCallback


def test_early_stopping_stops_after_patience_evaluations(tiny_llama, clm_rows, make_args):
    # learning_rate=0: the weights never change, so the eval loss never improves (threshold 0, lower is better)
    args = make_args(learning_rate=0.0, max_steps=10, eval_strategy="steps", eval_steps=1,
                     metric_for_best_model="loss")
    assert args.greater_is_better is False
    early, rec = EarlyStoppingCallback(early_stopping_patience=2), Recorder()
    out = Trainer(tiny_llama(), args, train_dataset=clm_rows(16), eval_dataset=clm_rows(4, seed=1),
                  callbacks=[early, rec]).train()
    assert rec.counts["on_evaluate"] == 1 + 2
    assert out.global_step == 3
    assert early.early_stopping_patience_counter == 2
    losses = [m["eval_loss"] for m in rec.metrics]
    assert losses[0] == losses[1] == losses[2]


def test_early_stopping_counter_resets_on_improvement(make_args):
    args = make_args(eval_strategy="steps", metric_for_best_model="eval_loss")
    cb, state, control = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.01), \
        TrainerState(), TrainerControl()
    for value, counter in ((1.0, 0), (0.995, 1), (0.9, 0), (0.9, 1)):
        cb.on_evaluate(args, state, control, metrics={"eval_loss": value})
        assert cb.early_stopping_patience_counter == counter
        assert control.should_training_stop is False
        state.best_metric = value if state.best_metric is None else min(state.best_metric, value)
    cb.on_evaluate(args, state, control, metrics={"eval_loss": 0.95})
    assert cb.early_stopping_patience_counter == 2 and control.should_training_stop is True


def test_early_stopping_state_is_transformers_exportable_state():
    from transformers import EarlyStoppingCallback as HFEarlyStopping

    cb = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=0.5)
    cb.early_stopping_patience_counter = 2
    hf = HFEarlyStopping(early_stopping_patience=3, early_stopping_threshold=0.5)
    hf.early_stopping_patience_counter = 2
    assert cb.state() == hf.state()
    assert json.loads(json.dumps(cb.state())) == cb.state()


def test_check_metric_value_counts_as_transformers_does(make_args):
    from transformers import EarlyStoppingCallback as HFEarlyStopping

    state = TrainerState()
    for greater in (False, True):
        args = make_args(eval_strategy="steps", metric_for_best_model="accuracy", greater_is_better=greater)
        ours, theirs = EarlyStoppingCallback(3, 0.1), HFEarlyStopping(3, 0.1)
        for best, value in ((None, 1.0), (1.0, 1.05), (1.0, 1.2), (1.0, 0.8), (1.0, 0.95), (1.0, 1.0)):
            state.best_metric = best
            ours.check_metric_value(args, state, TrainerControl(), value)
            theirs.check_metric_value(args, state, TrainerControl(), value)
            assert ours.early_stopping_patience_counter == theirs.early_stopping_patience_counter, (greater, value)


def test_early_stopping_needs_a_metric(tiny_llama, clm_rows, make_args):
    trainer = Trainer(tiny_llama(), make_args(max_steps=1), train_dataset=clm_rows(8),
                      callbacks=[EarlyStoppingCallback()])
    with pytest.raises(ValueError, match="metric_for_best_model"):
        trainer.train()
    with pytest.raises(ValueError):
        EarlyStoppingCallback(early_stopping_patience=0)


# ---------------------------------------------------------------------------------------------------
# built-in reporting callbacks


def test_progress_lines_on_a_non_tty_stream(tiny_llama, clm_rows, make_args):
    # 8 rows / batch 2 = 4 steps per epoch, 40 steps: a line every 5% = every 2 steps
    stream = io.StringIO()
    args = make_args(per_device_train_batch_size=2, max_steps=40, logging_steps=20, disable_tqdm=False)
    trainer = Trainer(tiny_llama(), args, train_dataset=clm_rows(8))
    trainer.pop_callback(ProgressCallback)
    trainer.add_callback(ProgressCallback(stream=stream))
    trainer.train()
    text = stream.getvalue()
    progress = [int(k) for k in re.findall(r"^\[stoker\] step (\d+)/40 ", text, flags=re.M)]
    assert progress == list(range(2, 41, 2))
    logged = [int(k) for k in re.findall(r"^\[stoker\] step (\d+): loss=", text, flags=re.M)]
    assert logged == [20, 40]
    assert "\r" not in text  # no progress bar
    lines = re.findall(r"^\[stoker\] step \d+/40 .* elapsed ([\d.]+)s, left ([\d.]+)s$", text, flags=re.M)
    assert len(lines) == 20 and float(lines[-1][1]) == 0.0


def test_progress_lines_give_the_time_left_at_this_calls_pace(monkeypatch):
    """Resumed at step 10 of 30, 2 s a step since: 18 steps left at step 12 take 36 s (the steps before the
    checkpoint, which took no time of this call, do not make it look faster)."""
    import types

    now = [100.0]
    monkeypatch.setattr(stoker.callbacks, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    stream, args = io.StringIO(), types.SimpleNamespace(disable_tqdm=True)
    state = TrainerState(global_step=10, max_steps=30, epoch=1.0)
    progress = ProgressCallback(stream=stream)
    progress.on_train_begin(args, state, TrainerControl())
    for step in (11, 12, 30):
        now[0] += 2 if step < 30 else 36
        state.global_step = step
        progress.on_step_end(args, state, TrainerControl())
    assert stream.getvalue().splitlines() == [
        "[stoker] step 11/30 (37%) epoch 1.00 elapsed 2.0s, left 38.0s",
        "[stoker] step 12/30 (40%) epoch 1.00 elapsed 4.0s, left 36.0s",
        "[stoker] step 30/30 (100%) epoch 1.00 elapsed 40.0s, left 0.0s"]


def test_tensorboard_event_files(tiny_llama, clm_rows, make_args, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    args = make_args(max_steps=3, logging_steps=1, report_to="tensorboard", logging_dir=str(logdir))
    Trainer(tiny_llama(), args, train_dataset=clm_rows(12)).train()
    events = list(logdir.glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def tensorboard_folders(monkeypatch, tmp_path, env: str | None, **state) -> tuple[str, str]:
    """The folder transformers' TensorBoardCallback and stoker's pick for the same output_dir, environment and
    state (on_train_begin on the main process, each with its own arguments class; neither writer is kept)."""
    from transformers import TrainerControl as HFControl
    from transformers import TrainerState as HFState
    from transformers import TrainingArguments as HFArgs
    from transformers.integrations import TensorBoardCallback as HFTensorBoard

    from stoker import TrainingArguments

    if env is None:
        monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    else:
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", env)
    out = str(tmp_path / "out")
    folders = []
    for callback, args, st, control in (
            (HFTensorBoard(), HFArgs(output_dir=out, report_to="none"), HFState(**state), HFControl()),
            (stoker.callbacks.TensorBoardCallback(), TrainingArguments(output_dir=out, report_to="none"),
             TrainerState(**state), TrainerControl())):
        callback.on_train_begin(args, st, control)
        callback.on_train_end(args, st, control)
        folders.append(callback.logging_dir)
    return folders[0], folders[1]


def test_tensorboard_folder_is_transformers_one(monkeypatch, tmp_path):
    """TENSORBOARD_LOGGING_DIR (~ expanded) when set, else output_dir/runs/<date>_<host> (the date to the second:
    compared without it), and a trial's folder under runs/: where transformers 5.24's callback writes."""
    import socket

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    theirs, ours = tensorboard_folders(monkeypatch, tmp_path, "~/tb")
    assert ours == theirs == str(tmp_path / "home" / "tb")
    assert list((tmp_path / "home" / "tb").glob("events.out.tfevents.*"))
    theirs, ours = tensorboard_folders(monkeypatch, tmp_path, None)
    runs = str(tmp_path / "out" / "runs")
    for folder in (theirs, ours):
        assert os.path.dirname(folder) == runs and folder.endswith(f"_{socket.gethostname()}"), folder
    theirs, ours = tensorboard_folders(monkeypatch, tmp_path, str(tmp_path / "tb"), is_hyper_param_search=True,
                                       trial_name="3")
    for folder in (theirs, ours):  # a trial ignores the variable
        assert os.path.dirname(os.path.dirname(folder)) == runs and os.path.basename(folder) == "3", folder
    # logging_dir, transformers 4's field, counts when the variable is unset
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    callback = stoker.callbacks.TensorBoardCallback()
    args = make_tb_args(tmp_path, logging_dir=str(tmp_path / "mine"))
    callback.on_train_begin(args, TrainerState(), TrainerControl())
    callback.on_train_end(args, TrainerState(), TrainerControl())
    assert callback.logging_dir == str(tmp_path / "mine")


def make_tb_args(tmp_path, **kw):
    from stoker import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kw)


def test_tensorboard_writes_with_tensorboardx_when_torch_writer_cannot(tiny_llama, clm_rows, make_args, tmp_path,
                                                                         monkeypatch):
    """Without the tensorboard package torch's SummaryWriter cannot be imported; transformers then writes with
    tensorboardX's, and so does stoker."""
    import sys

    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without tensorboard
    assert stoker.callbacks.summary_writer_class().__module__.startswith("tensorboardX")
    logdir = tmp_path / "tbx"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    Trainer(tiny_llama(), make_args(max_steps=2, logging_steps=1, report_to="tensorboard"),
            train_dataset=clm_rows(8)).train()
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


def test_metrics_jsonl_has_one_object_per_log(tiny_llama, clm_rows, make_args, tmp_path):
    args = make_args(max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2,
                     output_dir=str(tmp_path / "run"))
    rec = Recorder()
    trainer = Trainer(tiny_llama(), args, train_dataset=clm_rows(16), eval_dataset=clm_rows(4, seed=1),
                      callbacks=[rec])
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == rec.counts["on_log"] == len(trainer.state.log_history) == 5
    assert all(isinstance(r, dict) for r in records)
    train_logs = [r for r in records if not any(k.startswith(("eval_", "train_")) for k in r)]
    assert [r["step"] for r in train_logs] == [2, 4]
    assert all(isinstance(r["loss"], float) for r in train_logs)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]


# ---------------------------------------------------------------------------------------------------
# transformers' state, controls and callbacks


def test_trainer_state_json_and_compute_steps_as_transformers(make_args, tmp_path):
    from transformers import TrainerState as HFState

    state = TrainerState(global_step=7, log_history=[{"loss": 1.5, "step": 7}], best_metric=0.25,
                         stateful_callbacks={"EarlyStoppingCallback": {"args": {}, "attributes": {"x": 1}}})
    state.save_to_json(str(tmp_path / "ours.json"))
    theirs = HFState.load_from_json(str(tmp_path / "ours.json"))
    assert (theirs.global_step, theirs.log_history, theirs.best_metric) == (7, state.log_history, 0.25)
    theirs.save_to_json(str(tmp_path / "theirs.json"))
    assert TrainerState.load_from_json(str(tmp_path / "theirs.json")) == state
    args = make_args(logging_steps=0.1, eval_strategy="steps", eval_steps=3, save_steps=0.25)
    ours, hf = TrainerState(), HFState()
    ours.compute_steps(args, 50)
    hf.compute_steps(args, 50)
    assert (ours.logging_steps, ours.eval_steps, ours.save_steps) == (hf.logging_steps, hf.eval_steps,
                                                                       hf.save_steps) == (5, 3, 13)


def test_trainer_control_state_as_transformers():
    from transformers import TrainerControl as HFControl

    ours, theirs = TrainerControl(should_save=True, should_log=True), HFControl(should_save=True, should_log=True)
    assert ours.state() == theirs.state()


def test_stateful_callbacks_are_keyed_as_transformers_keys_them(tiny_llama, clm_rows, make_args, tmp_path):
    class Counter(TrainerCallback):
        def __init__(self, start: int = 0):
            self.start, self.seen = start, 0

        def on_step_end(self, args, state, control, **kwargs):
            self.seen += 1

        def state(self):
            return {"args": {"start": self.start}, "attributes": {"seen": self.seen}}

    args = make_args(max_steps=2, save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))
    Trainer(tiny_llama(), args, train_dataset=clm_rows(8), callbacks=[Counter(1), Counter(5)]).train()
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["Counter"] == [{"args": {"start": 1}, "attributes": {"seen": 2}},
                                {"args": {"start": 5}, "attributes": {"seen": 2}}]
    assert saved["TrainerControl"]["args"]["should_training_stop"] is True
    restored = [Counter(), Counter()]
    resumed = make_args(max_steps=3, restore_callback_states_from_checkpoint=True, output_dir=str(tmp_path / "run"))
    Trainer(tiny_llama(), resumed, train_dataset=clm_rows(8), callbacks=restored).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert [(c.start, c.seen) for c in restored] == [(1, 3), (5, 3)]  # restored, then one more step each


def test_transformers_printer_and_early_stopping_callbacks(tiny_llama, clm_rows, make_args, capsys):
    import transformers

    # disable_tqdm=False: stoker's progress display, on stderr, instead of its own PrinterCallback on stdout
    args = make_args(learning_rate=0.0, max_steps=10, eval_strategy="steps", eval_steps=1, disable_tqdm=False,
                     metric_for_best_model="loss", load_best_model_at_end=True, save_strategy="steps", save_steps=1)
    hf_early = transformers.EarlyStoppingCallback(early_stopping_patience=2)
    out = Trainer(tiny_llama(), args, train_dataset=clm_rows(16), eval_dataset=clm_rows(4, seed=1),
                  callbacks=[hf_early, transformers.PrinterCallback]).train()
    assert out.global_step == 3 and hf_early.early_stopping_patience_counter == 2  # as stoker's own callback
    printed = capsys.readouterr().out
    assert printed.count("'eval_loss'") == 3 and "'train_loss'" in printed  # PrinterCallback prints every log


# ---------------------------------------------------------------------------------------------------
# the CallbackHandler's surface, which Trainer subclasses call as transformers' does


def test_handler_has_transformers_handler_methods_and_attributes():
    from transformers.trainer_callback import CallbackHandler as HFHandler

    from stoker.callbacks import FOREIGN_EVENTS, CallbackHandler

    theirs = {m for m in vars(HFHandler) if m.startswith("on_")}
    ours = {m for m in vars(CallbackHandler) if m.startswith("on_")}
    assert ours == theirs == set(EVENTS) | set(FOREIGN_EVENTS)
    for name in ("add_callback", "pop_callback", "remove_callback", "callback_list", "callbacks"):
        assert hasattr(CallbackHandler([]), name)


@pytest.mark.parametrize("event", EVENTS)
def test_handler_event_clears_the_flags_and_passes_the_kwargs_transformers_does(event):
    """Each on_<event> of the handler clears the flags transformers' clears, hands every callback the handler's
    objects, and returns the control a callback returned."""
    from transformers.trainer_callback import CallbackHandler as HFHandler
    from transformers.trainer_callback import TrainerCallback as HFCallback
    from transformers.trainer_callback import TrainerControl as HFControl

    from stoker.callbacks import CallbackHandler

    outcome = {}
    for name, handler_cls, callback_cls, control_cls in (("hf", HFHandler, HFCallback, HFControl),
                                                         ("stoker", CallbackHandler, TrainerCallback, TrainerControl)):
        seen = {}

        def hook(self, args, state, control, seen=seen, **kwargs):
            seen.update(flags=dict(vars(control)), kwargs=sorted(kwargs), model=kwargs["model"])

        handler = handler_cls([type("Seeing", (callback_cls,), {event: hook})()], "the model", "the tokenizer",
                              "the optimizer", "the schedule")
        control = control_cls(**{f: True for f in vars(control_cls())})
        extra = {"logs": {}} if event == "on_log" else {"metrics": {}} if event in ("on_evaluate", "on_predict") else {}
        returned = getattr(handler, event)(None, TrainerState(), control, **extra)
        outcome[name] = (seen["flags"], seen["kwargs"], seen["model"], returned is control)
    assert outcome["stoker"] == outcome["hf"]


def test_a_subclass_firing_through_the_handler_reaches_the_callbacks_with_the_trainers_objects(
        tiny_llama, clm_rows, make_args):
    rec, got = Recorder(), {}

    class Seeing(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            got.update(kwargs)

    trainer = Trainer(tiny_llama(), make_args(max_steps=1), train_dataset=clm_rows(4), callbacks=[rec, Seeing()])
    trainer.train()
    handler = trainer.callback_handler
    control = handler.on_evaluate(trainer.args, trainer.state, trainer.control, {"eval_x": 1.0})
    assert control is trainer.control
    assert rec.metrics == [{"eval_x": 1.0}]
    assert got["model"] is trainer.model and got["optimizer"] is trainer.optimizer
    assert got["lr_scheduler"] is trainer.lr_scheduler and got["train_dataloader"] is not None
    assert "Recorder" in handler.callback_list.splitlines()
    with pytest.raises(ValueError):
        handler.remove_callback(Recorder())  # not registered: transformers' list.remove raises too
    handler.remove_callback(Recorder)
    assert rec not in handler.callbacks
