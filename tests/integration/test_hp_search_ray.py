"""hyperparameter_search(backend="ray") with a real local Ray on 2 CPU workers (ray.init(num_cpus=2): real worker
processes): the same search through transformers.Trainer and stoker.Trainer finds the same best trial, ASHA prunes
through the reported objective, a trial a scheduler paused resumes from its stoker checkpoint and ends as the same
trial never paused, a failing trial is reported beside the others; W&B sweeps are refused before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import ray_tune_worker as w  # Ray's workers import model_init by this name

# the trials of the search (BasicVariantGenerator's points_to_evaluate, in this order: the same trials for both
# trainers): 1.0 learns fastest, 0.05 and 0.005 are worse than 0.2 and 1.0 at the first evaluation
RATES = (0.2, 1.0, 0.05, 0.005)


def search(framework: str, out: Path, storage: Path, rates, scheduler, settings=None, **kwargs):
    """One search of `rates` (a dict per trial) through `framework`'s Trainer; returns its BestRun."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    trainer = w.trainer(framework, str(out), **(settings or {}))
    return trainer.hyperparameter_search(
        hp_space=kwargs.pop("hp_space", w.hp_space), compute_objective=w.objective, n_trials=len(rates),
        direction="minimize", backend="ray", scheduler=scheduler,
        search_alg=BasicVariantGenerator(points_to_evaluate=list(rates)), storage_path=str(storage), verbose=0,
        reuse_actors=True, **kwargs)


def iterations(trial) -> int:
    return trial.last_result["training_iteration"]


def asha_pausing(rate: float | None):
    """ASHA (stop a trial whose first, second or fourth objective is below the median of those reported there
    before it) that also pauses the trial of learning rate `rate` once, after its second result (as HyperBand
    pauses a trial at a rung), and writes down every result it sees."""
    from ray.tune.schedulers import ASHAScheduler

    class Scheduler(ASHAScheduler):
        def __init__(self):
            super().__init__(metric="objective", mode="min", max_t=4, grace_period=1, reduction_factor=2)
            self.paused, self.results = [], []

        def on_trial_result(self, tune_controller, trial, result):
            self.results.append((trial.trial_id, result["training_iteration"], result["iterations_since_restore"]))
            decision = super().on_trial_result(tune_controller, trial, result)
            if (decision == self.CONTINUE and trial.config["learning_rate"] == rate and not self.paused
                    and result["training_iteration"] == 2):
                self.paused.append(trial.trial_id)
                return self.PAUSE
            return decision

    return Scheduler()


@pytest.mark.slow
@pytest.mark.distributed
def test_search_with_pruning_a_pause_and_a_failure_finds_transformers_best_trial(local_ray, tmp_path, capsys):
    from safetensors.torch import load_file

    # the four rates, and a trial whose model_init raises ("fail": no TrainingArguments field, model_init's alone);
    # transformers' search is told not to raise at the end for it (stoker's default)
    trials = [{"learning_rate": r, "fail": False} for r in RATES] + [{"learning_rate": 0.5, "fail": True}]
    hf = search("hf", tmp_path / "hf", tmp_path / "ray_hf", trials, asha_pausing(None),
                hp_space=w.hp_space_with_failure, raise_on_failed_trial=False)
    scheduler = asha_pausing(1.0)
    # with async_save: each report waits for its checkpoint's background write to be committed
    best = search("stoker", tmp_path / "out", tmp_path / "ray", trials, scheduler, {"async_save": True},
                  hp_space=w.hp_space_with_failure)

    assert best.hyperparameters == hf.hyperparameters == {"learning_rate": 1.0, "fail": False}
    assert best.objective == pytest.approx(hf.objective, rel=1e-6)
    *ran, failed = best.run_summary.trials
    ran.sort(key=lambda t: RATES.index(t.config["learning_rate"]))
    assert best.run_id == ran[1].trial_id and best.objective == ran[1].last_result["objective"]
    # ASHA stopped both slow learners at their first evaluation, from the objective reported there; the best ran
    # its 4 evaluations (0.2 is stopped or not depending on which of the first two reported first)
    assert [iterations(t) for t in ran[1:]] == [4, 1, 1]
    assert [t.status for t in ran] == ["TERMINATED"] * 4
    # the failing trial is reported (Ray's error file, named in the search's warning) and the others ran on
    assert failed.status == "ERROR" and [t.status for t in hf.run_summary.trials][-1] == "ERROR"
    with open(os.path.join(failed.local_path, "error.txt")) as f:
        assert "model_init refuses the config" in f.read()
    assert f"[stoker] warning: hyperparameter_search: trial {failed.trial_id} failed" in capsys.readouterr().err

    # each trial trained in a Ray worker process into output_dir/run-<trial id>, a stoker checkpoint per
    # evaluation, and Ray holds the last one reported: stoker's files, no pickle
    for t in ran:
        run = tmp_path / "out" / f"run-{t.trial_id}"
        assert sorted(os.listdir(run)) == [f"checkpoint-{s}" for s in range(1, iterations(t) + 1)] + ["metrics.jsonl"]
        assert t.last_result["pid"] != os.getpid()
        with t.checkpoint.as_directory() as folder:
            files = sorted(os.listdir(folder))
            assert "model.safetensors" in files and "trainer_state.json" in files
            assert not [f for f in files if f.endswith((".pt", ".pth", ".bin", ".pkl"))]
            with open(os.path.join(folder, "trainer_state.json")) as f:
                assert json.load(f)["global_step"] == iterations(t)

    # the best trial was paused after its second evaluation and restarted from its step-2 checkpoint (its third
    # result is the first since the restore) ...
    winner = ran[1]
    assert scheduler.paused == [winner.trial_id]
    assert [(i, since) for tid, i, since in scheduler.results if tid == winner.trial_id] == [(1, 1), (2, 2), (3, 1),
                                                                                          (4, 2)]
    # ... and ended as transformers' trial never paused (its objective, above) and as the same trial trained in one
    # go here, on one thread as the workers: the same weights and logged losses, no step trained twice
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = w.trainer("stoker", str(tmp_path / "reference"), learning_rate=1.0)
        reference.train()
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "out" / f"run-{winner.trial_id}"
    weights = load_file(run / "checkpoint-4" / "model.safetensors")
    assert weights.keys() == reference.model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in reference.model.state_dict().items())
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    assert [r.get("loss", r.get("eval_loss")) for r in state["log_history"]] == \
        [r.get("loss", r.get("eval_loss")) for r in reference.state.log_history[:8]]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2, 2, 3, 3, 4, 4]  # ASHA stops every trial at max_t: no end-of-run record


def test_search_backends_refused_before_any_work(tiny_llama, make_args):
    from stoker import ConfigError, Trainer

    made = []

    def model_init():
        made.append(1)
        return tiny_llama()

    t = Trainer(args=make_args(), model_init=model_init)
    made.clear()
    with pytest.raises(ConfigError, match=r"backend='wandb': a W&B sweep is driven by the W&B service.*stoker never "
                                          r"uses; accepted: 'optuna', 'ray' or None") as e:
        t.hyperparameter_search(backend="wandb", n_trials=1)
    assert len(e.value.problems) == 1
    from transformers.trainer_utils import HPSearchBackend

    with pytest.raises(ConfigError, match="backend='wandb'"):
        t.hyperparameter_search(backend=HPSearchBackend.WANDB, n_trials=1)
    with pytest.raises(ConfigError, match=r"backend='sigopt': not a search backend; accepted: 'optuna', 'ray' or "
                                          r"None"):
        t.hyperparameter_search(backend="sigopt", n_trials=1)
    assert made == [] and t.args.output_dir == make_args().output_dir


def test_ray_search_problems_refused_before_ray_starts(tiny_llama, make_args, monkeypatch):
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler

    from stoker import ConfigError, Trainer, TrainingArguments

    t = Trainer(args=make_args(), model_init=lambda: tiny_llama())
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))  # as under torchrun
    monkeypatch.setattr(ray.tune, "run", lambda *a, **k: pytest.fail("the search started"))
    with pytest.raises(ConfigError) as e:
        t.hyperparameter_search(backend="ray", direction=["minimize", "maximize"], n_trials=0,
                                scheduler=ASHAScheduler(metric="objective", mode="min"))
    assert e.value.problems == [
        "direction=['minimize', 'maximize']: a Ray Tune search has one objective; pass 'minimize' or 'maximize' "
        "(several objectives: backend='optuna')",
        "n_trials=0: the number of trials to run, an int of at least 1",
        "eval_strategy='no': the scheduler AsyncHyperBandScheduler acts on the objective reported after each "
        "evaluation in training, and there is none; set eval_strategy='steps' (or 'epoch')",
        "world_size=2: a Ray Tune search runs its trials in Ray's workers, one process each; start the script as "
        "one process (not under torchrun)"]
    assert t.hp_search_backend is None and not os.path.exists(os.path.join(t.args.output_dir, "ray_results"))


def test_a_ray_trials_config_sets_the_fields_and_the_rest_is_model_inits(tiny_llama, make_args):
    """What a Ray trial's config does to its Trainer (the worker's part, called here without Ray): fields set,
    cast to the field's type as transformers casts them, the rest left to a model_init that takes the trial and
    refused with one that does not."""
    from stoker import ConfigError, Trainer

    def prepare(model_init):
        t = Trainer(args=make_args(), model_init=model_init)
        t.hp_search_backend, t._hp_search_args, t.hp_name = "ray", t.args, lambda trial: "run-x"
        return t

    t = prepare(lambda trial: tiny_llama())
    old = t.accelerator
    t._hp_search_setup({"learning_rate": 0.01, "seed": 3.7, "num_train_epochs": 2, "dropout": 0.1, "wandb": {}})
    assert (t.args.learning_rate, t.args.seed, t.args.num_train_epochs) == (0.01, 3, 2.0)
    assert type(t.args.seed) is int
    assert t.args.output_dir == os.path.join(make_args().output_dir, "run-x")
    assert t.accelerator is not old  # built again for the trial's arguments, in the trial's process

    t = prepare(lambda: tiny_llama())
    with pytest.raises(ConfigError, match="dropout: not a TrainingArguments field, and model_init takes no trial"):
        t._hp_search_setup({"learning_rate": 0.01, "dropout": 0.1})


class FakeSession:
    """Ray Tune's session functions as a trial's worker sees them, recorded in this process: the trial id, the
    checkpoint Ray restores (None: a fresh trial), and every report with the folder of its checkpoint."""

    def __init__(self, monkeypatch, restore: str | None = None):
        import ray.tune

        self.reports = []
        context = type("Context", (), {"get_trial_id": lambda _: "t0"})()
        monkeypatch.setattr(ray.tune, "get_context", lambda: context)
        monkeypatch.setattr(ray.tune, "get_checkpoint",
                            lambda: ray.tune.Checkpoint.from_directory(restore) if restore else None)
        monkeypatch.setattr(ray.tune, "report", lambda metrics, checkpoint=None: self.reports.append(
            (dict(metrics), checkpoint and os.path.basename(checkpoint.path))))


def searching(trainer):
    """The trainer as hyperparameter_search(backend="ray") hands it to a worker."""
    trainer.hp_search_backend, trainer._hp_search_args, trainer.hp_name = "ray", trainer.args, None
    trainer.hp_space, trainer.compute_objective = w.hp_space, w.objective
    return trainer


def test_a_trial_reports_each_evaluation_with_its_steps_checkpoint(tmp_path, monkeypatch):
    from stoker.hp_search import run_trial

    session = FakeSession(monkeypatch)
    run_trial({"learning_rate": 0.5}, searching(w.trainer("stoker", str(tmp_path), eval_steps=2, save_steps=4,
                                                          eval_on_start=True)))
    assert [(m["objective"], c) for m, c in session.reports] == [(m["eval_loss"], c) for m, c in session.reports]
    # before the first step, at step 2 (evaluated, saved nothing), at step 4 with its checkpoint
    assert [c for _, c in session.reports] == [None, None, "checkpoint-4"]
    assert session.reports[0][0]["eval_loss"] > session.reports[1][0]["eval_loss"] > session.reports[2][0]["eval_loss"]
    assert sorted(os.listdir(tmp_path / "run-t0")) == ["checkpoint-4", "metrics.jsonl"]


def test_a_trial_without_evaluations_reports_a_final_one(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from stoker.hp_search import run_trial

    session = FakeSession(monkeypatch)
    trainer = searching(w.trainer("stoker", str(tmp_path), eval_strategy="no", save_steps=3))
    run_trial({"learning_rate": 0.5}, trainer)
    [(metrics, checkpoint)] = session.reports
    assert metrics["done"] is True and metrics["objective"] == metrics["eval_loss"] == trainer.evaluate()["eval_loss"]
    assert checkpoint == "checkpoint-4"  # the newest the trial saved: its last step's

    # restored by Ray from an earlier checkpoint (a lost worker): the rest of the run, the same weights at its
    # end, and the final evaluation is not reported a second time (as transformers)
    restored = FakeSession(monkeypatch, restore=str(tmp_path / "run-t0" / "checkpoint-3"))
    again = tmp_path / "again"
    run_trial({"learning_rate": 0.5}, searching(w.trainer("stoker", str(again), eval_strategy="no", save_steps=3)))
    assert restored.reports == []
    assert {json.loads(line)["step"] for line in (again / "run-t0" / "metrics.jsonl").read_text().splitlines()} == {4}
    weights = [load_file(folder / "run-t0" / "checkpoint-4" / "model.safetensors") for folder in (tmp_path, again)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
