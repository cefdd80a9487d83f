"""Loop parity with transformers.Trainer: the event sequence (with the final evaluation when max_steps is not a
multiple of eval_steps), plateau schedules, the logged learning rate, drop_last for evaluation; and a resumed
run that logs what the uninterrupted run logged."""

from __future__ import annotations

import pytest

from tests.parity.oracle import assert_logs_close, flatten, run


@pytest.mark.parametrize("overrides", [
    dict(num_train_epochs=1, max_steps=3, eval_steps=2, logging_steps=2, save_steps=2),
    dict(num_train_epochs=3, eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch"),
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, eval_steps=2, save_steps=2),
], ids=["max_steps_not_a_multiple_of_eval_steps", "epoch_strategies", "accumulation"])
def test_event_sequence_checkpoints_and_state_equal_transformers(tmp_path, overrides):
    hf = run("hf", "llama", str(tmp_path / "hf"), **overrides)
    ours = run("stoker", "llama", str(tmp_path / "ours"), **overrides)
    assert ours["events"] == hf["events"]
    assert ours["folders"] == hf["folders"]
    assert ours["state"] == pytest.approx(hf["state"])
    assert_logs_close(ours["logs"], hf["logs"])
    if "max_steps" in overrides:  # evaluated at step 2 and, as transformers does, at the final step 3
        assert [r["step"] for r in ours["logs"] if "eval_loss" in r] == [2, 3]


def test_reduce_lr_on_plateau_steps_on_the_metric_after_each_evaluation_as_transformers(tmp_path):
    settings = dict(lr_scheduler_type="reduce_lr_on_plateau", learning_rate=8.0, num_train_epochs=5,
                    lr_scheduler_kwargs={"patience": 0, "factor": 0.5})
    hf = run("hf", "llama", str(tmp_path / "hf"), **settings)
    ours = run("stoker", "llama", str(tmp_path / "ours"), **settings)
    rates = [r["learning_rate"] for r in ours["logs"] if "learning_rate" in r]
    assert rates == [r["learning_rate"] for r in hf["logs"] if "learning_rate" in r]
    assert rates[0] == 8.0 and min(rates) < 8.0  # the schedule did act on the metric
    assert_logs_close(ours["logs"], hf["logs"])


def test_dataloader_drop_last_applies_to_evaluation_as_transformers(tmp_path):
    settings = dict(dataloader_drop_last=True, per_device_eval_batch_size=4, max_steps=1)
    hf = run("hf", "bert_sequence", str(tmp_path / "hf"), **settings)
    ours = run("stoker", "bert_sequence", str(tmp_path / "ours"), **settings)
    assert [a.shape for a in flatten(ours["predictions"])] == [a.shape for a in flatten(hf["predictions"])]
    assert flatten(ours["predictions"])[0].shape[0] == 4  # 6 rows, batches of 4: the short one is dropped
    assert ours["test_loss"] == pytest.approx(hf["test_loss"], rel=1e-5)


def resumable_run(tmp_path, name: str, resume_from: str | None = None, **kw):
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    settings = dict(per_device_train_batch_size=2, num_train_epochs=2, logging_steps=3, save_strategy="steps",
                    save_steps=5, lr_scheduler_type="linear", max_grad_norm=1.0)
    trainer = Trainer(llama(), args(tmp_path / name, **{**settings, **kw}), train_dataset=rows(14, seed=3))
    output = trainer.train(resume_from_checkpoint=resume_from)
    return trainer, output


def test_resumed_run_logs_and_reports_what_the_uninterrupted_run_did(tmp_path):
    whole, whole_out = resumable_run(tmp_path, "whole")
    # 7 micro-batches an epoch, 14 steps: checkpoint-5 is mid-epoch, between two logs
    folder = tmp_path / "whole" / "out" / "checkpoint-5"
    resumed, resumed_out = resumable_run(tmp_path, "whole", resume_from=str(folder))
    assert resumed_out.training_loss == pytest.approx(whole_out.training_loss, rel=1e-6)
    assert resumed.state.num_train_epochs == whole.state.num_train_epochs == 2
    keep = ("loss", "grad_norm", "learning_rate", "epoch", "step", "train_loss")
    logs = [[{k: r[k] for k in keep if k in r} for r in t.state.log_history] for t in (whole, resumed)]
    assert logs[0] == logs[1]


def test_best_checkpoint_is_tracked_when_evaluation_lands_on_an_already_saved_step(tmp_path):
    """eval_strategy='epoch' with step checkpoints at every epoch's last step: each evaluation comes after its
    step's checkpoint was written, and the best one is still the folder named for it."""
    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    trainer = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, num_train_epochs=3,
                                    eval_strategy="epoch", save_strategy="steps", save_steps=2,
                                    metric_for_best_model="eval_loss", learning_rate=0.05),
                      train_dataset=rows(8, seed=1), eval_dataset=rows(4, seed=2))
    trainer.train()
    s = trainer.state
    evals = {r["step"]: r["eval_loss"] for r in s.log_history if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6]
    assert s.best_global_step == min(evals, key=evals.get)
    assert s.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{s.best_global_step}")
    assert (tmp_path / "out" / f"checkpoint-{s.best_global_step}").is_dir()


def test_a_given_plateau_scheduler_steps_after_evaluation_and_is_checkpointed(tmp_path):
    import torch

    from stoker import Trainer
    from tests.helpers.tiny_jobs import args, llama, rows

    def run(name, resume=None):
        model = llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=8.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        trainer = Trainer(model, args(tmp_path / name, per_device_train_batch_size=4, num_train_epochs=4,
                                      eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=3),
                          train_dataset=rows(8, seed=1), eval_dataset=rows(4, seed=2), optimizers=(optimizer, plateau))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run("a")
    rates = [r["learning_rate"] for r in whole.state.log_history if "learning_rate" in r]
    evals = [r["eval_loss"] for r in whole.state.log_history if "eval_loss" in r]
    expected, lr, best = [], 8.0, float("inf")
    for loss in evals:  # patience 0: every evaluation that is not a new best halves the rate of the next step
        expected.append(lr)
        lr, best = (lr, loss) if loss < best * (1 - 1e-4) else (lr * 0.5, best)
    assert rates == expected[:len(rates)] and min(rates) < 8.0
    resumed = run("a", resume=str(tmp_path / "a" / "out" / "checkpoint-3"))
    assert [r["learning_rate"] for r in resumed.state.log_history if "learning_rate" in r] == rates
