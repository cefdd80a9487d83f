"""The callback list as transformers.Trainer builds it: DEFAULT_CALLBACKS, the callbacks given at init, then
ProgressCallback (PrinterCallback with disable_tqdm=True); stoker's metrics.jsonl writer is kept outside that
list. The warnings about callbacks come on transformers' loggers, in its words. And transformers'
question-answering example's Trainer subclass, which fires events through self.callback_handler itself."""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import random

import numpy as np
import pytest
import torch
import transformers

import stoker
import stoker.callbacks
from stoker.callbacks import EVENTS
from tests.helpers.tiny_jobs import Regressor, regression_rows


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


# ---------------------------------------------------------------------------------------------------
# transformers' question-answering example: a Trainer subclass that runs evaluation_loop itself and fires
# on_evaluate / on_predict through self.callback_handler

QA_TRAIN_ROWS, QA_EVAL_ROWS, QA_EVAL_BATCH = 8, 6, 3
TIMING = ("_runtime", "_per_second", "_model_preparation_time")  # wall-clock figures, different in every run


def question_answering_trainer(base: type) -> type:
    """transformers 5.24's examples/pytorch/question-answering/trainer_qa.py, on `base` (either Trainer)."""
    import math
    import time

    from transformers.trainer_utils import PredictionOutput, speed_metrics

    class QuestionAnsweringTrainer(base):
        def __init__(self, *args, eval_examples=None, post_process_function=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.eval_examples = eval_examples
            self.post_process_function = post_process_function

        def evaluate(self, eval_dataset=None, eval_examples=None, ignore_keys=None, metric_key_prefix="eval"):
            eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            eval_dataloader = self.get_eval_dataloader(eval_dataset)
            eval_examples = self.eval_examples if eval_examples is None else eval_examples
            # Temporarily disable metric computation, we will do it in the loop here.
            compute_metrics = self.compute_metrics
            self.compute_metrics = None
            start_time = time.time()
            try:
                output = self.evaluation_loop(eval_dataloader, description="Evaluation",
                                              prediction_loss_only=True if compute_metrics is None else None,
                                              ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            finally:
                self.compute_metrics = compute_metrics
            total_batch_size = self.args.eval_batch_size * self.args.world_size
            output.metrics.update(speed_metrics(metric_key_prefix, start_time, num_samples=output.num_samples,
                                                num_steps=math.ceil(output.num_samples / total_batch_size)))
            if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
                eval_preds = self.post_process_function(eval_examples, eval_dataset, output.predictions)
                metrics = self.compute_metrics(eval_preds)
                for key in list(metrics.keys()):
                    if not key.startswith(f"{metric_key_prefix}_"):
                        metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
                metrics.update(output.metrics)
            else:
                metrics = output.metrics
            if self.args.should_log:
                self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

        def predict(self, predict_dataset, predict_examples, ignore_keys=None, metric_key_prefix="test"):
            predict_dataloader = self.get_test_dataloader(predict_dataset)
            compute_metrics = self.compute_metrics
            self.compute_metrics = None
            start_time = time.time()
            try:
                output = self.evaluation_loop(predict_dataloader, description="Prediction",
                                              prediction_loss_only=True if compute_metrics is None else None,
                                              ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            finally:
                self.compute_metrics = compute_metrics
            total_batch_size = self.args.eval_batch_size * self.args.world_size
            output.metrics.update(speed_metrics(metric_key_prefix, start_time, num_samples=output.num_samples,
                                                num_steps=math.ceil(output.num_samples / total_batch_size)))
            if self.post_process_function is None or self.compute_metrics is None:
                return output
            predictions = self.post_process_function(predict_examples, predict_dataset, output.predictions, "predict")
            metrics = self.compute_metrics(predictions)
            for key in list(metrics.keys()):
                if not key.startswith(f"{metric_key_prefix}_"):
                    metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
            metrics.update(output.metrics)
            self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
            return PredictionOutput(predictions=predictions.predictions, label_ids=predictions.label_ids,
                                    metrics=metrics)

    return QuestionAnsweringTrainer


def qa_model():
    """A tiny BERT for extractive question answering with dropout on (0.1 everywhere)."""
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    return BertForQuestionAnswering(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def qa_rows(n: int, seed: int) -> list[dict]:
    """Features of n questions, 12 tokens each, the answer a span inside."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(1, 10)
        out.append({"input_ids": [rng.randint(3, 63) for _ in range(12)], "start_positions": start,
                    "end_positions": start + rng.randrange(0, 2)})
    return out


def post_process(examples, features, predictions, stage="eval"):
    """Best start and end of each feature, as the example's post-processing picks an answer span."""
    from transformers import EvalPrediction

    start_logits, end_logits = predictions
    chosen = np.stack([start_logits.argmax(-1), end_logits.argmax(-1)], 1)
    answers = np.array([[e["start_positions"], e["end_positions"]] for e in examples])
    return EvalPrediction(predictions=chosen, label_ids=answers)


def span_metrics(prediction):
    hit = prediction.predictions == prediction.label_ids
    return {"exact_match": float(hit.all(1).mean()), "start_accuracy": float(hit[:, 0].mean())}


def event_recorder(base: type):
    """A callback on `base` that writes down every event with the names of the kwargs it got (without stoker's
    `diagnostics` beside on_log's logs) and the metrics of on_evaluate / on_predict."""
    def hook(event):
        def method(self, args, state, control, **kwargs):
            self.events.append((event, sorted(k for k in kwargs if k != "diagnostics")))
            if "metrics" in kwargs:
                self.metrics.append((event, dict(kwargs["metrics"])))
            if event == "on_evaluate":
                self.eval_loaders.append(kwargs["eval_dataloader"])
        return method

    cb = type("Recorder", (base,), {e: hook(e) for e in EVENTS})()
    cb.events, cb.metrics, cb.eval_loaders = [], [], []
    return cb


def dropout_off_in_steps(base: type):
    """A callback on `base` that turns the model's dropout off for the optimizer steps only: the two frameworks
    draw their dropout masks from different random streams (transformers' sampler draws its seed from the global
    generator), so training with dropout is not comparable; every evaluation still runs with dropout 0.1 set,
    which only eval mode turns off."""
    def set_dropout(p):
        def method(self, args, state, control, model=None, **kwargs):
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = p
        return method

    return type("DropoutOffInSteps", (base,), {"on_step_begin": set_dropout(0.0), "on_step_end": set_dropout(0.1)})()


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING)}


def run_question_answering(module, out) -> dict:
    from stoker.data import PaddingCollator

    rec = event_recorder(module.TrainerCallback)
    eval_rows = qa_rows(QA_EVAL_ROWS, 2)
    args = module.TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, use_cpu=True,
                                    save_strategy="no", optim="sgd", learning_rate=0.5,
                                    lr_scheduler_type="constant", seed=7,
                                    per_device_train_batch_size=QA_TRAIN_ROWS,
                                    per_device_eval_batch_size=QA_EVAL_BATCH, max_steps=2, logging_steps=1,
                                    eval_strategy="steps", eval_steps=1)
    trainer = question_answering_trainer(module.Trainer)(
        model=qa_model(), args=args, train_dataset=qa_rows(QA_TRAIN_ROWS, 1), eval_dataset=eval_rows,
        eval_examples=eval_rows, data_collator=PaddingCollator(), compute_metrics=span_metrics,
        post_process_function=post_process, callbacks=[dropout_off_in_steps(module.TrainerCallback), rec])
    before = trainer.evaluate()
    trained = trainer.train()
    after = trainer.evaluate()
    predicted = trainer.predict(eval_rows, eval_rows)
    return {"before": before, "train": trained.metrics, "after": after, "predicted": predicted, "rec": rec,
            "logs": [without_timing(r) for r in trainer.state.log_history],
            "training": trainer.model.training}


def test_question_answering_trainer_subclass_as_transformers(tmp_path):
    """trainer_qa.py's QuestionAnsweringTrainer runs on stoker as on transformers: its evaluate() and predict()
    call evaluation_loop and fire on_evaluate / on_predict through self.callback_handler (an AttributeError
    before), evaluation runs in eval mode although the model has dropout (the same metrics), and the callbacks
    see the same events with the same kwargs, the evaluation loader among them."""
    hf = run_question_answering(transformers, tmp_path / "hf")
    ours = run_question_answering(stoker, tmp_path / "ours")
    for key in ("before", "after"):
        assert sorted(without_timing(ours[key])) == sorted(without_timing(hf[key]))
        assert without_timing(ours[key]) == pytest.approx(without_timing(hf[key]), rel=1e-5, abs=1e-6)
        assert "eval_exact_match" in ours[key] and "epoch" in ours[key]
    assert ours["train"]["train_loss"] == pytest.approx(hf["train"]["train_loss"], rel=1e-5)
    assert without_timing(ours["predicted"].metrics) == pytest.approx(without_timing(hf["predicted"].metrics),
                                                                       rel=1e-5, abs=1e-6)
    np.testing.assert_array_equal(ours["predicted"].predictions, hf["predicted"].predictions)
    assert ours["rec"].events == hf["rec"].events
    assert [e for e, _ in ours["rec"].events].count("on_evaluate") == 4  # before, after steps 1 and 2, after
    assert [e for e, _ in ours["rec"].metrics] == [e for e, _ in hf["rec"].metrics]
    for (_, mine), (_, theirs) in zip(ours["rec"].metrics, hf["rec"].metrics, strict=True):
        assert without_timing(mine) == pytest.approx(without_timing(theirs), rel=1e-5, abs=1e-6)
    assert all(loader is not None for loader in ours["rec"].eval_loaders)
    assert len(ours["logs"]) == len(hf["logs"])
    for mine, theirs in zip(ours["logs"], hf["logs"], strict=True):
        assert sorted(mine) == sorted(theirs) and mine == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert ours["training"] is hf["training"] is False  # the final evaluation left it in eval mode


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
        transformers.logging.set_verbosity_warning()  # transformers' default, whatever ran before
        with captured("transformers.trainer") as log:
            trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        messages[name] = log.getvalue()
    assert "Checkpoint included callbacks not included in current configuration. Ignoring. (Counter)" \
        in messages["hf"]
    assert messages["stoker"] == messages["hf"]
