"""The callback list as transformers.Trainer builds it: DEFAULT_CALLBACKS, the callbacks given at init, then
ProgressCallback (PrinterCallback with disable_tqdm=True); stoker's own trackers (metrics.jsonl) sit where
transformers puts its trackers, right after the defaults."""

from __future__ import annotations

import ast

import pytest
import transformers

import stoker
import stoker.callbacks
from tests.integration.test_trainer import Regressor, regression_rows

STOKERS_OWN = ("JsonlLoggerCallback",)


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
    assert ours[1:1 + len(STOKERS_OWN)] == list(STOKERS_OWN)
    assert [n for n in ours if n not in STOKERS_OWN] == hf
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
