"""What the trials of tests/integration/test_hp_search_ray.py run in Ray's worker processes (a module of its own, so
that the workers import it by name: with the repository on PYTHONPATH, as the test's runtime_env sets): the
model_init, search space and objective given to both trainers' hyperparameter_search."""

from __future__ import annotations

ROWS = 8
# one optimizer step over every row (the sampler's order cannot matter), evaluated and saved at every step, so that
# each step is a result a scheduler acts on and a checkpoint a paused trial resumes from
SETTINGS = dict(optim="sgd", lr_scheduler_type="constant", per_device_train_batch_size=ROWS,
                per_device_eval_batch_size=ROWS, max_steps=4, logging_steps=1, eval_strategy="steps",
                eval_steps=1, save_strategy="steps", save_steps=1, report_to="none", disable_tqdm=True, seed=7,
                dataloader_num_workers=0)


def model_init(trial=None):
    """The tiny Llama of the parity tests, the same weights for every trial; a config with "fail" set raises."""
    from tests.parity.families import FAMILIES

    if trial is not None and trial.get("fail"):
        raise RuntimeError(f"model_init refuses the config {trial}")
    return FAMILIES["llama"](0)


def hp_space(trial):
    """A Ray search space: the learning rate, log-uniform."""
    from ray import tune

    return {"learning_rate": tune.loguniform(1e-3, 1.0)}


def hp_space_with_failure(trial):
    """The learning rate, and whether model_init fails (a key that is no TrainingArguments field: it goes to
    model_init(trial) only)."""
    from ray import tune

    return {"learning_rate": tune.loguniform(1e-3, 1.0), "fail": False}


def objective(metrics: dict) -> float:
    """The trial's objective: its evaluation loss."""
    return metrics["eval_loss"]


def trainer(framework: str, out: str, **overrides):
    """A Trainer of `framework` ("hf" or "stoker") for the search: model_init, the parity rows, stoker's padding
    collator (transformers' default one cannot pad)."""
    from stoker.data import PaddingCollator
    from tests.parity.families import rows

    if framework == "hf":
        from transformers import Trainer, TrainingArguments
    else:
        from stoker import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=out, **{"learning_rate": 0.1, **SETTINGS, **overrides})
    train = rows("llama", ROWS, 1)
    # evaluated on its own rows: the loss falls step by step, faster the larger the rate (up to 1.0), so that the
    # search has a clear best trial and a scheduler clear losers
    return Trainer(args=args, model_init=model_init, train_dataset=train, eval_dataset=train,
                   data_collator=PaddingCollator())
