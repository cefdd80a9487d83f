"""Ray Tune as hyperparameter_search's backend: each trial a Trainer in a Ray worker process, built by model_init
with the arguments of the trial's config, reporting its objective after every evaluation in training (so that a
scheduler such as ASHA can stop it) with the checkpoint of that step when it saved one, and resumed from that
checkpoint when a scheduler paused it (HyperBand, PBT) or its worker was lost.

transformers' `run_hp_search_ray` cannot run a stoker Trainer unchanged: it reads `trainer._memory_tracker` as an
attribute (stoker's is a method), pops transformers' own TensorBoard callback class, hands a trial's checkpoint to
Ray as pickles (`torch.save` of the optimizer and schedule), and with Ray's default `raise_on_failed_trial=True`
one failed trial makes the whole search raise once every trial has run. This module keeps its shape (the same
kwargs to `ray.tune.run`, the same defaults, the same `BestRun`) with stoker's checkpoints (safetensors and JSON,
exact resume) and a failed trial reported beside the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import checkpoint_format as ckpt
from .errors import ConfigError
from .log import logger

# the schedulers that act on results reported during a trial: without evaluations in training they see only the
# final one, and would neither stop nor pause anything (transformers refuses them there too)
INTERMEDIATE_SCHEDULERS = ("ASHAScheduler", "AsyncHyperBandScheduler", "HyperBandScheduler", "HyperBandForBOHB",
                           "MedianStoppingRule", "PopulationBasedTraining", "PB2")


def search_problems(trainer, n_trials: int, direction, kwargs: dict[str, Any]) -> list[str]:
    """What makes a Ray Tune search impossible, found before Ray starts (every problem, each naming its field)."""
    problems = []
    if not isinstance(direction, str) or direction not in ("minimize", "maximize"):
        problems.append(f"direction={direction!r}: a Ray Tune search has one objective; pass 'minimize' or "
                        "'maximize' (several objectives: backend='optuna')")
    if not isinstance(n_trials, int) or n_trials < 1:
        problems.append(f"n_trials={n_trials!r}: the number of trials to run, an int of at least 1")
    scheduler = kwargs.get("scheduler")
    scheduler_name = type(scheduler).__name__
    if scheduler is not None and scheduler_name in INTERMEDIATE_SCHEDULERS and trainer.args.eval_strategy == "no":
        problems.append(f"eval_strategy='no': the scheduler {scheduler_name} acts on the objective reported after "
                        "each evaluation in training, and there is none; set eval_strategy='steps' (or 'epoch')")
    resources = kwargs.get("resources_per_trial")
    if resources is not None and not (isinstance(resources, dict) or hasattr(resources, "required_resources")):
        problems.append(f"resources_per_trial={resources!r}: a dict such as {{'cpu': 1, 'gpu': 0}} or a "
                        "tune.PlacementGroupFactory")
    if trainer.args.world_size > 1:
        problems.append(f"world_size={trainer.args.world_size}: a Ray Tune search runs its trials in Ray's "
                        "workers, one process each; start the script as one process (not under torchrun)")
    return problems


def run_hp_search_ray(trainer, n_trials: int, direction: str, **kwargs):
    """Run the search through `ray.tune.run` (kwargs are its parameters) and return the best trial as transformers'
    BestRun(run_id=trial id, objective, hyperparameters=config, run_summary=ExperimentAnalysis). Defaults as
    transformers sets them: resources_per_trial {"cpu": 1} (and one GPU where CUDA is available), a CLIReporter of the
    objective; and stoker's: raise_on_failed_trial=False (a failed trial is logged and listed in run_summary, the
    others go on), storage_path output_dir/ray_results (the search's files beside its trials' run folders)."""
    import ray.tune
    import torch
    from transformers.trainer_utils import BestRun

    problems = search_problems(trainer, n_trials, direction, kwargs)
    if problems:
        raise ConfigError(problems, "hyperparameter_search(backend='ray')")
    if "resources_per_trial" not in kwargs:
        kwargs["resources_per_trial"] = {"cpu": 1, **({"gpu": 1} if torch.cuda.is_available() else {})}
    if "progress_reporter" not in kwargs:
        kwargs["progress_reporter"] = ray.tune.CLIReporter(metric_columns=["objective"])
    kwargs.setdefault("raise_on_failed_trial", False)
    kwargs.setdefault("storage_path", os.path.join(os.path.abspath(trainer.args.output_dir), "ray_results"))
    # the trainer goes to every worker through Ray's object store (tune.with_parameters, which pickles it now);
    # its model is left out, as transformers leaves it out: each trial builds its own from model_init, and a model
    # can be gigabytes. So is what holds the model or a process's resources (an earlier train()'s optimizer and
    # loaders, the memory tracker's process handle): a trial builds them anew
    handler = trainer.callback_handler
    held = [(trainer, "model"), (trainer, "model_wrapped"), (trainer, "optimizer"), (trainer, "lr_scheduler"),
            (trainer, "_memory"), (handler, "model"), (handler, "optimizer"), (handler, "lr_scheduler"),
            (handler, "train_dataloader"), (handler, "eval_dataloader")]
    kept, loaders = [getattr(o, name, None) for o, name in held], trainer._eval_dataloaders
    for o, name in held:
        setattr(o, name, None)
    trainer._eval_dataloaders = {}
    try:
        trainable = ray.tune.with_parameters(run_trial, trainer=trainer)
    finally:
        for (o, name), value in zip(held, kept, strict=True):
            setattr(o, name, value)
        trainer._eval_dataloaders = loaders
    analysis = ray.tune.run(trainable, config=trainer.hp_space(None), num_samples=n_trials, **kwargs)
    failed = [t for t in analysis.trials if t.status == "ERROR"]
    for t in failed:
        logger.warning(f"hyperparameter_search: trial {t.trial_id} failed (config {t.config}); the search went on. "
                       f"Its error: {t.error_file}")
    best = analysis.get_best_trial(metric="objective", mode=direction[:3], scope=os.getenv("RAY_SCOPE", "last"))
    if best is None:
        raise RuntimeError(f"hyperparameter_search: no trial of {len(analysis.trials)} reported an objective "
                           f"({len(failed)} failed; their errors are in {[t.error_file for t in failed]})")
    return BestRun(best.trial_id, best.last_result["objective"], best.config, analysis)


def trial_checkpoint(folder: str) -> str:
    """The stoker checkpoint inside a folder Ray restored: the folder itself (as this module reports them), or the
    one checkpoint-<step> in it (transformers' layout)."""
    inner = sorted(Path(folder).glob("checkpoint-*"))
    return inner[0].as_posix() if len(inner) == 1 and inner[0].is_dir() else folder


def run_trial(config: dict, trainer) -> None:
    """What each Ray worker runs for one trial: train from model_init with the config's arguments (from the trial's
    stoker checkpoint when Ray holds one: the trial was paused or its worker lost), the objective reported after
    each evaluation (Trainer._report_to_ray); a trial without evaluations in training is evaluated once at the
    end and reports that, with the newest checkpoint of its run."""
    import ray.tune

    trainer.objective = None
    checkpoint = ray.tune.get_checkpoint()
    if checkpoint is not None:
        # as transformers: a resumed trial whose last report came from its last step has nothing left to
        # report; the objective is set so that the end below adds no second final result
        trainer.objective = "objective"
        with checkpoint.as_directory() as folder:
            trainer.train(resume_from_checkpoint=trial_checkpoint(folder), trial=config)
    else:
        trainer.train(trial=config)
    if trainer.objective is None:  # no evaluation in training
        metrics = trainer.evaluate()
        trainer.objective = trainer.compute_objective(dict(metrics))
        metrics.update({"objective": trainer.objective, "done": True})
        saved = [c for c in ckpt.list_checkpoints(trainer.args.output_dir) if ckpt.verify(c, hashes=False) is None]
        ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(saved[-1]) if saved else None)
