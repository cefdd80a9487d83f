"""transformers.Trainer's public surface on stoker's Trainer: the methods scripts call, model_init, override
points that change what the loop does, the TrainingArguments fields it honours, and running twice."""

from __future__ import annotations

import json
import logging
import math
import os
import random

import pytest
import torch

from stoker import Trainer, TrainerCallback
from stoker.errors import CheckpointError
from tests.helpers.tiny_jobs import Scalar


def rows(n: int, seed: int = 0, length: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1, 64) for _ in range(length or rng.randint(4, 12))]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_params(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------
# metrics and state files, model card, process checks


def test_metrics_and_state_files_are_transformers_files(tiny_llama, make_args, tmp_path, capsys):
    from transformers import TrainerState as HFState
    from transformers.trainer_pt_utils import metrics_format

    t = Trainer(tiny_llama(), make_args(max_steps=2), train_dataset=rows(8), eval_dataset=rows(4, seed=1))
    train = t.train().metrics
    t.log_metrics("train", train)
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "train_loss" in printed
    assert t.metrics_format(train) == metrics_format(train)
    t.save_metrics("train", train)
    evaluated = t.evaluate()
    t.save_metrics("eval", evaluated)
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text()) == pytest.approx(train)
    assert json.loads((out / "all_results.json").read_text()) == pytest.approx({**train, **evaluated})
    t.save_state()
    hf = HFState.load_from_json(str(out / "trainer_state.json"))
    assert hf.global_step == 2 and hf.log_history == t.state.log_history
    assert t.is_world_process_zero() and t.is_local_process_zero()


def test_create_model_card_writes_a_local_readme(tiny_llama, make_args, tmp_path):
    t = Trainer(tiny_llama(), make_args(max_steps=2, eval_strategy="steps", eval_steps=1), train_dataset=rows(8),
                eval_dataset=rows(4, seed=1))
    t.train()
    t.create_model_card(model_name="tiny-llama", language="en")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# tiny-llama" in card and "generated_from_trainer" in card
    assert f"- Loss: {t.state.log_history[-2]['eval_loss']:.4f}" in card  # the last evaluation
    assert "- learning_rate: 0.001" in card and "- lr_scheduler_type: linear" in card
    assert t.args.lr_scheduler_type == "linear"


def test_push_to_hub_is_one_clear_error(tiny_llama, make_args):
    from stoker import ConfigError

    t = Trainer(tiny_llama(), make_args())
    with pytest.raises(RuntimeError, match="does not upload to the Hugging Face Hub.*hf upload"):
        t.push_to_hub()
    with pytest.raises(ConfigError, match="push_to_hub=True: stoker does not push"):
        make_args(push_to_hub=True)


def test_hyperparameter_search_without_optuna_is_one_clear_error(tiny_llama, make_args, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "optuna", None)  # as if it were not installed
    t = Trainer(args=make_args(), model_init=lambda: tiny_llama(), train_dataset=rows(8), eval_dataset=rows(4))
    with pytest.raises(ImportError, match="hyperparameter_search needs Optuna.*pip install optuna"):
        t.hyperparameter_search(n_trials=1)


def checkpoints(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.startswith("checkpoint-")) if os.path.isdir(folder) else []


def test_hyperparameter_search_with_optuna(tiny_llama, make_args, tmp_path):
    import optuna
    from transformers.trainer_utils import BestRun

    seen, made = [], []

    class Look(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append({"lr": args.learning_rate, "params": state.trial_params, "name": state.trial_name,
                         "search": state.is_hyper_param_search, "out": args.output_dir})

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen[-1]["eval_loss"] = metrics["eval_loss"]

    def model_init(trial):
        made.append(None if trial is None else trial.number)
        return tiny_llama()

    storage = optuna.storages.InMemoryStorage()
    t = Trainer(args=make_args(max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2),
                model_init=model_init, train_dataset=rows(8), eval_dataset=rows(4, seed=1), callbacks=[Look()])
    best = t.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)},
        compute_objective=lambda metrics: metrics["eval_loss"], n_trials=3, direction="minimize",
        backend="optuna", storage=storage, study_name="lr", sampler=optuna.samplers.RandomSampler(seed=0))
    study = optuna.load_study(study_name="lr", storage=storage)
    assert made == [None, 0, 1, 2]  # __init__'s model, then a fresh one per trial, handed the trial
    assert [s["params"] for s in seen] == [{"learning_rate": tr.params["learning_rate"]} for tr in study.trials]
    assert [s["lr"] for s in seen] == [tr.params["learning_rate"] for tr in study.trials]
    assert [s["name"] for s in seen] == ["0", "1", "2"] and all(s["search"] for s in seen)
    # each trial's objective is its last evaluation (at step 4), reported to Optuna at every evaluation
    assert [tr.value for tr in study.trials] == [s["eval_loss"] for s in seen]
    assert [sorted(tr.intermediate_values) for tr in study.trials] == [[2, 4]] * 3
    assert isinstance(best, BestRun) and best.run_id == str(study.best_trial.number)
    assert best.objective == min(s["eval_loss"] for s in seen) and best.hyperparameters == study.best_trial.params
    for n in range(3):  # transformers' folders: output_dir/run-<trial number>/checkpoint-<step>
        assert checkpoints(tmp_path / "out" / f"run-{n}") == ["checkpoint-2", "checkpoint-4"]
    assert t.args.output_dir == str(tmp_path / "out") and t.args.learning_rate == 1e-3  # the search's again


def test_hyperparameter_search_reports_a_bad_trial_and_prunes(tiny_llama, make_args, tmp_path, caplog):
    import optuna

    class PruneTrialTwo(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 2

    ended = []

    class Look(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            ended.append(state.trial_name)

    def space(trial):
        lr = trial.suggest_float("learning_rate", 1e-3, 1e-2)
        return {"learning_rate": lr, "warmup_ratio": 0.5, "warmup_steps": 2} if trial.number == 0 \
            else {"learning_rate": lr}

    storage = optuna.storages.InMemoryStorage()
    t = Trainer(args=make_args(max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2),
                model_init=lambda: tiny_llama(), train_dataset=rows(8), eval_dataset=rows(4, seed=1),
                callbacks=[Look()])
    best = t.hyperparameter_search(hp_space=space, n_trials=3, storage=storage, study_name="s",
                                   pruner=PruneTrialTwo())
    states = [tr.state for tr in optuna.load_study(study_name="s", storage=storage).trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED]
    failed = [r.getMessage() for r in caplog.records if r.name.startswith("optuna") and "Trial 0 failed" in r.msg]
    assert any("warmup_steps=2 and warmup_ratio=0.5: set only one" in m for m in failed)  # Optuna's report
    assert best.run_id == "1"
    assert ended == ["1", "2"]  # the pruned trial ends its run (trackers close) before it stops
    assert checkpoints(tmp_path / "out" / "run-0") == []  # refused before any work
    assert checkpoints(tmp_path / "out" / "run-2") == []  # pruned at its first evaluation, before saving


# ---------------------------------------------------------------------------------------------------
# optimizer, parameters, data, FLOPs


def test_optimizer_and_parameter_helpers_match_transformers(tiny_llama, make_args):
    import transformers

    model = tiny_llama()
    args = make_args(max_steps=1, optim="adamw_torch", weight_decay=0.1)
    # transformers' arguments reset Accelerate's state when built: built before stoker's Trainer
    hf_args = transformers.TrainingArguments(optim="adamw_torch", learning_rate=args.learning_rate)
    t = Trainer(model, args, train_dataset=rows(8), eval_dataset=rows(5))
    hf_names = transformers.Trainer.get_decay_parameter_names(None, model)
    assert sorted(t.get_decay_parameter_names(model)) == sorted(hf_names)
    cls, kwargs = t.get_optimizer_cls_and_kwargs(args)
    hf_cls, hf_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(hf_args)
    assert cls is hf_cls and {k: kwargs[k] for k in ("lr", "betas", "eps")} == {k: hf_kwargs[k] for k in
                                                                                  ("lr", "betas", "eps")}
    assert t.get_num_trainable_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="no optimizer yet"):
        t.get_learning_rates()
    t.train()
    assert t.get_learning_rates() == [g["lr"] for g in t.optimizer.param_groups] and len(t.get_learning_rates()) == 2
    norm = model.model.norm.weight
    assert t.get_optimizer_group(norm)["weight_decay"] == 0.0
    assert len(t.get_optimizer_group()) == 2
    loader = t.get_test_dataloader(rows(5))
    assert t.num_examples(loader) == 5 and [len(b["input_ids"]) for b in loader] == [4, 1]


def test_total_flos_counts_six_parameters_per_token(tiny_llama, make_args):
    model = tiny_llama()
    # with the progress bar: with disable_tqdm=True, PrinterCallback takes total_flos out of the train metrics, as
    # transformers' does (log() hands the callbacks the metrics dict itself)
    t = Trainer(model, make_args(num_train_epochs=2, disable_tqdm=False), train_dataset=rows(8, length=10))
    out = t.train()
    tokens = 8 * 10 * 2
    assert t.state.total_flos == 6 * tokens * model.num_parameters(exclude_embeddings=True)
    assert out.metrics["total_flos"] == t.state.total_flos


# ---------------------------------------------------------------------------------------------------
# model_init, a second train(), and a second run into the same output_dir


def test_model_init_trains_a_fresh_model_each_time(tiny_llama, make_args):
    made = []

    def model_init():
        made.append(tiny_llama())
        return made[-1]

    t = Trainer(args=make_args(max_steps=2), model_init=model_init, train_dataset=rows(8))
    first = t.train()
    trained = params(t.model)
    second = t.train()
    assert len(made) == 3  # one for __init__, one per train()
    assert t.model is made[-1] and first.training_loss == second.training_loss
    assert same_params(trained, params(t.model))


def test_second_train_on_the_same_trainer_continues_the_model(tiny_llama, make_args):
    t = Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=1), train_dataset=rows(8))
    first = t.train()
    second = t.train()
    assert second.global_step == 2 and second.training_loss < first.training_loss  # the same data, a trained model
    assert sorted(os.listdir(t.args.output_dir)) == ["checkpoint-1", "checkpoint-2", "metrics.jsonl"]


def test_create_accelerator_and_postprocess_rebuilds_what_hangs_on_the_accelerator(tiny_llama, make_args):
    """transformers' name for building the Accelerator anew: the backend and the background checkpoint writer are
    built on the new one too (a backend left on the old Accelerator would prepare and save through it)."""
    t = Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=1, async_save=True),
                train_dataset=rows(8))
    old = t.accelerator
    t.create_accelerator_and_postprocess()
    assert t.accelerator is not old
    assert t._backend.accelerator is t.accelerator and t._checkpoint_writer.accelerator is t.accelerator
    assert t.train().global_step == 2
    assert sorted(os.listdir(t.args.output_dir)) == ["checkpoint-1", "checkpoint-2", "metrics.jsonl"]


def _run_id(folder) -> str:
    return json.loads((folder / "loop_state.json").read_text())["run_id"]


def test_the_same_command_into_a_finished_output_dir_trains_again(tiny_llama, make_args, tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    Trainer(tiny_llama(), make_args(**kw), train_dataset=rows(8)).train()
    first = _run_id(out / "checkpoint-4")
    again = Trainer(tiny_llama(), make_args(**kw), train_dataset=rows(8))
    assert again.train().global_step == 4
    assert _run_id(out / "checkpoint-2") == _run_id(out / "checkpoint-4") != first  # replaced, step by step
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    # transformers' example scripts resume from the last checkpoint: a finished run has nothing left to do
    resumed = Trainer(tiny_llama(), make_args(**kw), train_dataset=rows(8))
    assert resumed.train(resume_from_checkpoint=get_last_checkpoint(str(out))).global_step == 4
    assert resumed.state.log_history[-1]["step"] == 4


def test_resuming_a_folder_of_two_runs_must_name_the_checkpoint(tiny_llama, make_args, tmp_path):
    out = tmp_path / "out"
    Trainer(tiny_llama(), make_args(max_steps=4, save_strategy="steps", save_steps=2), train_dataset=rows(8)).train()
    Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1),
            train_dataset=rows(8)).train()
    # the second run's limit counts its own checkpoints only; the first run's checkpoint-4 stays
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert _run_id(out / "checkpoint-2") != _run_id(out / "checkpoint-4")
    t = Trainer(tiny_llama(), make_args(max_steps=4, save_strategy="steps", save_steps=2), train_dataset=rows(8))
    with pytest.raises(CheckpointError, match=r"2 different runs \(checkpoint-4; checkpoint-2\).*"
                                              r"resume_from_checkpoint='<path>'"):
        t.train(resume_from_checkpoint=True)
    assert t.train(resume_from_checkpoint=str(out / "checkpoint-2")).global_step == 4


def test_overwrite_output_dir_removes_the_earlier_runs_checkpoints_after_the_first_save(tiny_llama, make_args,
                                                                                        tmp_path):
    out = tmp_path / "out"
    Trainer(tiny_llama(), make_args(max_steps=4, save_strategy="steps", save_steps=1), train_dataset=rows(8)).train()
    seen = []

    class Look(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(p.name for p in out.glob("checkpoint-*")))

    Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=2, overwrite_output_dir=True),
            train_dataset=rows(8), callbacks=[Look()]).train()
    assert seen == [["checkpoint-2"]]


def test_save_only_model_checkpoints_hold_the_model_and_are_not_resumed(tiny_llama, make_args, tmp_path):
    out = tmp_path / "out"
    Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True),
            train_dataset=rows(8)).train()
    files = set(os.listdir(out / "checkpoint-2"))
    assert "model.safetensors" in files
    assert not files & {"optimizer.safetensors", "scheduler.safetensors", "process_0.safetensors"}
    t = Trainer(tiny_llama(), make_args(max_steps=4), train_dataset=rows(8))
    with pytest.raises(CheckpointError, match="save_only_model=True: it holds the model only"):
        t.train(resume_from_checkpoint=str(out / "checkpoint-2"))


# ---------------------------------------------------------------------------------------------------
# override points: a subclass changes what the loop does


def test_training_step_override_is_called_per_micro_batch_and_stays_exact(tiny_llama, make_args):
    class Counting(Trainer):
        calls = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            Counting.calls += 1
            return super().training_step(model, inputs, num_items_in_batch)

    base, counted = tiny_llama(), tiny_llama()
    args = make_args(max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    Trainer(base, args, train_dataset=rows(8)).train()
    Counting(counted, args, train_dataset=rows(8)).train()
    assert Counting.calls == 4 and same_params(params(base), params(counted))

    class NoBackward(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.zeros(())

    frozen = tiny_llama()
    before = params(frozen)
    NoBackward(frozen, make_args(max_steps=2, max_grad_norm=0), train_dataset=rows(8)).train()
    assert same_params(before, params(frozen))


def test_compute_loss_override_is_the_loss_trained_on(tiny_llama, make_args):
    class HalfLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return (out[0] / 2, out[1]) if return_outputs else out / 2

    plain = Trainer(tiny_llama(), make_args(max_steps=1, learning_rate=0.0), train_dataset=rows(8))
    half = HalfLoss(tiny_llama(), make_args(max_steps=1, learning_rate=0.0), train_dataset=rows(8))
    assert half.train().training_loss == pytest.approx(plain.train().training_loss / 2)


def test_prediction_step_override_feeds_predictions_and_metrics(tiny_llama, make_args):
    class Constant(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return loss, torch.full(logits.shape[:2], 7.0), labels

    seen = []
    t = Constant(tiny_llama(), make_args(), eval_dataset=rows(6),
                 compute_metrics=lambda p: seen.append(p.predictions) or {
                     "mean": float(p.predictions[p.predictions != -100].mean())})  # -100: padding between batches
    metrics = t.evaluate()
    assert metrics["eval_mean"] == 7.0 and seen[0].shape[0] == 6
    assert t.predict(rows(3)).predictions.shape[0] == 3


def test_evaluation_loop_override_is_what_evaluate_reports(tiny_llama, make_args):
    from transformers.trainer_utils import EvalLoopOutput

    class Fixed(Trainer):
        def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                            metric_key_prefix="eval"):
            return EvalLoopOutput(predictions=None, label_ids=None, metrics={f"{metric_key_prefix}_custom": 1.5},
                                  num_samples=self.num_examples(dataloader))

    metrics = Fixed(tiny_llama(), make_args(), eval_dataset=rows(6)).evaluate()
    assert metrics["eval_custom"] == 1.5 and "eval_loss" not in metrics and "eval_runtime" in metrics


def test_get_train_dataloader_override_is_what_trains(tiny_llama, make_args):
    from torch.utils.data import DataLoader

    class FirstFour(Trainer):
        def get_train_dataloader(self):
            return DataLoader(self.train_dataset[:4], batch_size=2, collate_fn=self.data_collator)

    out = FirstFour(tiny_llama(), make_args(num_train_epochs=3), train_dataset=rows(16)).train()
    assert out.global_step == 3 * 2


def test_create_optimizer_override_builds_the_optimizer(tiny_llama, make_args):
    class WithSGD(Trainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.args.learning_rate)
            return self.optimizer

    t = WithSGD(tiny_llama(), make_args(max_steps=1), train_dataset=rows(8))
    t.train()
    assert isinstance(t.optimizer.optimizer, torch.optim.SGD)


def test_optimizer_cls_and_kwargs_argument(tiny_llama, make_args):
    t = Trainer(tiny_llama(), make_args(max_steps=1), train_dataset=rows(8),
                optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}))
    t.train()
    assert isinstance(t.optimizer.optimizer, torch.optim.SGD) and t.optimizer.param_groups[0]["momentum"] == 0.9


def test_log_override_sees_and_changes_every_record(tiny_llama, make_args):
    class Tagged(Trainer):
        def log(self, logs, start_time=None):
            super().log({**logs, "tag": 1}, start_time)

    seen = []

    class Look(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(logs)

    t = Tagged(tiny_llama(), make_args(max_steps=2), train_dataset=rows(8), callbacks=[Look()])
    t.train()
    assert len(t.state.log_history) == 3 and all(r["tag"] == 1 for r in t.state.log_history)
    assert all(logs["tag"] == 1 for logs in seen)


# ---------------------------------------------------------------------------------------------------
# TrainingArguments fields the Trainer honours


def test_label_smoothing_is_transformers_label_smoother_and_exact_under_accumulation(tiny_llama, make_args):
    from transformers.trainer_pt_utils import LabelSmoother

    data = rows(6, seed=3)
    t = Trainer(tiny_llama(), make_args(label_smoothing_factor=0.2, per_device_eval_batch_size=6), eval_dataset=data)
    batch = t.data_collator(data)
    with torch.no_grad():
        expected = LabelSmoother(0.2)(t.model(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"]), batch["labels"],
                                      shift_labels=True)
    assert t.evaluate()["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)
    plain = Trainer(tiny_llama(), make_args(per_device_eval_batch_size=6), eval_dataset=data).evaluate()
    assert plain["eval_loss"] < t.evaluate()["eval_loss"]
    one, split = tiny_llama(), tiny_llama()
    Trainer(one, make_args(max_steps=1, label_smoothing_factor=0.2, per_device_train_batch_size=8),
            train_dataset=rows(8)).train()
    Trainer(split, make_args(max_steps=1, label_smoothing_factor=0.2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=4), train_dataset=rows(8)).train()
    for k, v in params(one).items():
        torch.testing.assert_close(v, params(split)[k], atol=1e-6, rtol=0)


def test_neftune_noise_is_added_in_training_only(tiny_llama, make_args):
    plain, noisy = tiny_llama(), tiny_llama()
    Trainer(plain, make_args(max_steps=1), train_dataset=rows(8)).train()
    t = Trainer(noisy, make_args(max_steps=1, neftune_noise_alpha=5.0), train_dataset=rows(8))
    t.train()
    assert not same_params(params(plain), params(noisy))
    embeddings = noisy.get_input_embeddings()
    assert not embeddings._forward_hooks  # removed when training ends
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(embeddings(ids), noisy.model.embed_tokens.weight[ids])


def test_prediction_loss_only_include_for_metrics_and_concatenation(tiny_llama, make_args):
    data = rows(6, seed=2)
    loss_only = Trainer(tiny_llama(), make_args(prediction_loss_only=True), eval_dataset=data).predict(data)
    assert loss_only.predictions is None and "test_loss" in loss_only.metrics
    seen = {}

    def metrics(p):
        seen.update(inputs=p.inputs, losses=p.losses)
        return {}

    Trainer(tiny_llama(), make_args(include_for_metrics=["inputs", "loss"]), eval_dataset=data,
            compute_metrics=metrics).evaluate()
    assert seen["inputs"].shape[0] == 6 and seen["inputs"][0, 0] == data[0]["input_ids"][0]
    assert seen["losses"].shape == (6,)
    kept = Trainer(tiny_llama(), make_args(eval_do_concat_batches=False), eval_dataset=data).predict(data)
    assert isinstance(kept.predictions, list) and [p.shape[0] for p in kept.predictions] == [4, 2]


def test_batch_eval_metrics_are_computed_per_batch(tiny_llama, make_args):
    calls = []

    def metrics(p, compute_result):
        calls.append((p.predictions.shape[0], compute_result))
        return {"batches": len(calls)} if compute_result else {}

    out = Trainer(tiny_llama(), make_args(batch_eval_metrics=True), eval_dataset=rows(10),
                  compute_metrics=metrics).evaluate()
    assert calls == [(4, False), (4, False), (2, True)] and out["eval_batches"] == 3


def test_eval_delay_skips_early_evaluations(tiny_llama, make_args):
    t = Trainer(tiny_llama(), make_args(max_steps=4, eval_strategy="steps", eval_steps=1, eval_delay=3),
                train_dataset=rows(16), eval_dataset=rows(4))
    t.train()
    assert [r["step"] for r in t.state.log_history if "eval_loss" in r] == [3, 4]


def test_torch_empty_cache_steps(tiny_llama, make_args, monkeypatch):
    import stoker.trainer

    calls = []
    monkeypatch.setattr(stoker.trainer, "clear_device_cache", lambda *a, **k: calls.append(1))
    Trainer(tiny_llama(), make_args(max_steps=4, torch_empty_cache_steps=2), train_dataset=rows(16)).train()
    assert len(calls) == 2  # as transformers: before the micro-batches of steps 0 and 2 (global_step % 2 == 0)


def test_memory_metrics_when_not_skipped(tiny_llama, make_args):
    out = Trainer(tiny_llama(), make_args(max_steps=1, skip_memory_metrics=False), train_dataset=rows(8),
                  eval_dataset=rows(4))
    metrics = out.train().metrics
    assert {"train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"} <= set(metrics)
    assert "eval_mem_cpu_alloc_delta" in out.evaluate()


def test_log_levels_set_the_loggers(tiny_llama, make_args):
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity(), logging.getLogger("stoker").level
    try:
        Trainer(tiny_llama(), make_args(log_level="error"))
        assert hf_logging.get_verbosity() == logging.ERROR and logging.getLogger("stoker").level == logging.ERROR
    finally:
        hf_logging.set_verbosity(before[0])
        logging.getLogger("stoker").setLevel(before[1])


def test_logging_nan_inf_filter(make_args):
    data = [{"x": 999.0}, {"x": 1.0}]
    filtered = Trainer(Scalar(), make_args(max_steps=2, logging_steps=2, per_device_train_batch_size=1,
                                           train_sampling_strategy="sequential"), train_dataset=data)
    filtered.train()
    assert filtered.state.log_history[0]["loss"] == pytest.approx(1.0)  # the finite step only
    shown = Trainer(Scalar(), make_args(max_steps=2, logging_steps=2, per_device_train_batch_size=1,
                                        train_sampling_strategy="sequential", logging_nan_inf_filter=False),
                    train_dataset=data)
    shown.train()
    assert math.isnan(shown.state.log_history[0]["loss"])
    assert shown.model.w.item() == filtered.model.w.item()  # the update is skipped either way


def test_sequential_sampling_ignore_data_skip_and_loader_options(tiny_llama, make_args, tmp_path):
    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["input_ids"][0, 0].item())
            return super().training_step(model, inputs, num_items_in_batch)

    data = rows(16)
    kw = dict(train_sampling_strategy="sequential", save_strategy="steps", save_steps=2, max_steps=4)
    Recording(tiny_llama(), make_args(**kw), train_dataset=data).train()
    firsts = [data[i]["input_ids"][0] for i in (0, 4, 8, 12)]
    assert seen == firsts
    seen.clear()
    Recording(tiny_llama(), make_args(**kw), train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert seen == firsts[2:]  # the batches after the checkpoint
    seen.clear()
    Recording(tiny_llama(), make_args(ignore_data_skip=True, **kw), train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert seen == firsts[:2]  # the epoch from its start
    loader = Trainer(tiny_llama(), make_args(dataloader_num_workers=1, dataloader_in_order=False,
                                             dataloader_multiprocessing_context="spawn"),
                     train_dataset=data).get_train_dataloader()
    assert loader.in_order is False and loader.multiprocessing_context.get_start_method() == "spawn"


def test_full_determinism_bf16_full_eval_static_graph_and_checkpointing(tiny_llama, make_args):
    model = tiny_llama()
    t = Trainer(model, make_args(max_steps=1, full_determinism=True, bf16_full_eval=True, ddp_static_graph=True,
                                 activation_checkpointing=True), train_dataset=rows(8), eval_dataset=rows(4))
    try:
        t.train()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert model.is_gradient_checkpointing and t.args.gradient_checkpointing is True
    assert t.accelerator.ddp_handler.static_graph is True
    assert next(model.parameters()).dtype == torch.float32  # evaluation inside train() keeps the precision
    t.evaluate()
    assert next(model.parameters()).dtype == torch.bfloat16


def test_use_cache_and_debug_underflow_overflow(tiny_llama, make_args):
    calls = []
    model = tiny_llama()
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.get("use_cache")),
                                    with_kwargs=True)
    Trainer(model, make_args(max_steps=1, use_cache=True), train_dataset=rows(4)).train()
    assert calls and set(calls) == {True}
    debugged = tiny_llama()
    Trainer(debugged, make_args(debug="underflow_overflow"))
    assert debugged.model.layers[0].mlp._forward_hooks  # transformers' DebugUnderflowOverflow watches every module


def test_save_on_each_node_is_refused_with_several_nodes(tiny_llama, make_args, monkeypatch):
    from stoker import ConfigError
    from stoker.distributed.launch import check_save_on_each_node

    Trainer(tiny_llama(), make_args(save_on_each_node=True))  # one node: the same as writing once
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="save_on_each_node=True: this run has 2 nodes"):
        check_save_on_each_node(True, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_save_on_each_node(True, 4)


def test_a_dict_of_evaluation_sets(tiny_llama, make_args):
    from stoker import ConfigError

    sets = {"short": rows(4, seed=1), "long": rows(6, seed=2)}
    t = Trainer(tiny_llama(), make_args(max_steps=2, eval_strategy="steps", eval_steps=1,
                                        metric_for_best_model="eval_long_loss"), train_dataset=rows(8),
                eval_dataset=sets)
    t.train()
    during = [(r["step"], r["eval_long_loss"]) for r in t.state.log_history if "eval_long_loss" in r]
    assert [step for step, _ in during] == [1, 2] and t.state.best_metric == min(v for _, v in during)
    metrics = t.evaluate()
    assert metrics["eval_short_loss"] == t.evaluate(sets["short"])["eval_loss"]
    assert metrics["eval_long_loss"] == t.evaluate("long")["eval_loss"] == during[-1][1]
    assert t.num_examples(t.get_eval_dataloader("long")) == 6
    with pytest.raises(ConfigError, match=r"eval_dataset\['empty'\]: is empty"):
        Trainer(tiny_llama(), make_args(), eval_dataset={"empty": [], "fine": rows(2)})
