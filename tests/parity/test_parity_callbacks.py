"""The callback list as transformers.Trainer builds it: DEFAULT_CALLBACKS, the callbacks given at init, then
ProgressCallback (PrinterCallback with disable_tqdm=True); stoker's metrics.jsonl writer is kept outside that
list. The warnings about callbacks come on transformers' loggers, in its words."""

from __future__ import annotations

import ast
import contextlib
import io
import logging

import pytest
import transformers

import stoker
import stoker.callbacks
from tests.integration.test_trainer import Regressor, regression_rows


def callback_names(module, callbacks_module, tmp_path, **kw):
    class Mine(callbacks_module.TrainerCallback):
        pass

    given = kw.pop("given", False)
    args = module.TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    trainer = module.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(4),
                             callbacks=[Mine] if given else None)
    trainer.add_callback(type("Later", (callbacks_module.TrainerCallback,), {}))
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


@pytest.mark.parametrize("settings", [dict(), dict(given=True), dict(disable_tqdm=True),
                                      dict(disable_tqdm=True, given=True)],
                         ids=["default", "given", "disable_tqdm", "disable_tqdm_given"])
def test_callback_list_is_transformers(tmp_path, settings):
    hf = callback_names(transformers, transformers.trainer_callback, tmp_path / "hf", **dict(settings))
    ours = callback_names(stoker, stoker.callbacks, tmp_path / "ours", **dict(settings))
    assert ours == hf
    progress = "PrinterCallback" if settings.get("disable_tqdm") else "ProgressCallback"
    assert hf == ["DefaultFlowCallback"] + (["Mine"] if settings.get("given") else []) + [progress, "Later"]


def test_default_callbacks_is_transformers_list():
    from transformers.trainer import DEFAULT_CALLBACKS

    assert [c.__name__ for c in stoker.callbacks.DEFAULT_CALLBACKS] == [c.__name__ for c in DEFAULT_CALLBACKS]


def test_removing_the_progress_callback_as_a_transformers_script_does(tmp_path):
    trainer = stoker.Trainer(Regressor(as_dict=True), stoker.TrainingArguments(output_dir=str(tmp_path),
                             report_to="none"), train_dataset=regression_rows(4))
    trainer.remove_callback(stoker.callbacks.ProgressCallback)
    assert "ProgressCallback" not in [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


def test_printer_callback_prints_the_logs_transformers_prints(tmp_path, capsys):
    printed = {}
    for name, module in (("hf", transformers), ("stoker", stoker)):
        args = module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none", disable_tqdm=True,
                                        logging_steps=1, max_steps=2, save_strategy="no", use_cpu=True)
        module.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(16)).train()
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        printed[name] = [ast.literal_eval(line) for line in lines]
    assert [sorted(d) for d in printed["stoker"]] == [sorted(d) for d in printed["hf"]]
    assert [d["loss"] for d in printed["stoker"][:2]] == [d["loss"] for d in printed["hf"][:2]]
    assert "total_flos" not in printed["stoker"][-1]


@contextlib.contextmanager
def captured(logger_name):
    """What is logged on `logger_name` (transformers' loggers do not propagate to the root, where caplog
    listens: as transformers' own CaptureLogger, a handler on the logger itself)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def test_metrics_jsonl_is_written_with_transformers_callback_list_and_survives_its_edits(tmp_path):
    from stoker.callbacks import ProgressCallback

    args = stoker.TrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=2, logging_steps=1,
                                    save_strategy="no", use_cpu=True)
    trainer = stoker.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(8))
    trainer.remove_callback(ProgressCallback)
    trainer.pop_callback(stoker.callbacks.DefaultFlowCallback)
    trainer.add_callback(stoker.callbacks.DefaultFlowCallback)
    assert "JsonlLoggerCallback" not in trainer.callback_handler.callback_list
    trainer.train()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # two steps and the run's metrics


def test_adding_a_second_callback_of_a_class_warns_as_transformers(tmp_path):
    messages = {}
    for name, module, callbacks_module in (("hf", transformers, transformers.trainer_callback),
                                           ("stoker", stoker, stoker.callbacks)):
        args = module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none")
        trainer = module.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(4))
        with captured("transformers.trainer_callback") as log:
            trainer.add_callback(callbacks_module.DefaultFlowCallback)
        messages[name] = log.getvalue()
    assert "You are adding a" in messages["hf"] and "but there is already one" in messages["hf"]
    # the class's repr names its module: stoker's DefaultFlowCallback, in the same sentence and list
    assert messages["stoker"] == messages["hf"].replace("transformers.trainer_callback", "stoker.callbacks")


def test_resuming_without_a_stateful_callback_warns_as_transformers(tmp_path):
    from transformers.trainer_callback import ExportableState

    class HFCounter(transformers.TrainerCallback, ExportableState):
        def state(self):
            return {"args": {}, "attributes": {}}

    class StokerCounter(stoker.TrainerCallback):
        def state(self):
            return {"args": {}, "attributes": {}}

    messages = {}
    for name, module, counter in (("hf", transformers, HFCounter), ("stoker", stoker, StokerCounter)):
        counter.__name__ = "Counter"
        settings = dict(output_dir=str(tmp_path / name), report_to="none", max_steps=2, save_steps=1,
                        restore_callback_states_from_checkpoint=True, use_cpu=True)
        module.Trainer(Regressor(as_dict=True), module.TrainingArguments(**settings),
                       train_dataset=regression_rows(8), callbacks=[counter()]).train()
        trainer = module.Trainer(Regressor(as_dict=True), module.TrainingArguments(**{**settings, "max_steps": 3}),
                                 train_dataset=regression_rows(8))
        with captured("transformers.trainer") as log:
            trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        messages[name] = log.getvalue()
    assert "Checkpoint included callbacks not included in current configuration. Ignoring. (Counter)" \
        in messages["hf"]
    assert messages["stoker"] == messages["hf"]
