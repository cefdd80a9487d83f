"""Dataloaders as transformers.Trainer hands them out: prepared by Accelerate, the evaluation loader kept with
persistent workers (for each named set too), a subclass's own train loader with no train_dataset, and a loader
of the user's own without set_epoch."""

from __future__ import annotations

import pytest
import torch
import transformers

import stoker
from tests.helpers.tiny_jobs import Regressor, regression_rows

FRAMEWORKS = {"hf": transformers, "stoker": stoker}


def trainer(framework, tmp_path, cls=None, **kw):
    module = FRAMEWORKS[framework]
    settings = dict(output_dir=str(tmp_path / framework), report_to="none", disable_tqdm=True, optim="sgd",
                    learning_rate=0.1, lr_scheduler_type="constant", per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, per_device_eval_batch_size=3, save_strategy="no",
                    use_cpu=True)
    settings.update(kw.pop("args", {}))
    data = {"train_dataset": regression_rows(8), "eval_dataset": regression_rows(6), **kw}
    return (cls or module.Trainer)(Regressor(as_dict=True), module.TrainingArguments(**settings), **data)


@pytest.mark.parametrize("framework", ["hf", "stoker"])
def test_loaders_are_prepared_by_accelerate(tmp_path, framework):
    from accelerate.data_loader import DataLoaderShard

    t = trainer(framework, tmp_path)
    train, evaluation = t.get_train_dataloader(), t.get_eval_dataloader()
    assert isinstance(train, DataLoaderShard) and isinstance(evaluation, DataLoaderShard)
    assert (train.total_batch_size, evaluation.total_batch_size, len(train), len(evaluation)) == (2, 3, 4, 2)


def test_prepared_loaders_equal_transformers(tmp_path):
    shapes = {}
    for framework in FRAMEWORKS:
        t = trainer(framework, tmp_path)
        shapes[framework] = [(type(t.get_train_dataloader()).__name__, t.get_train_dataloader().total_batch_size,
                              t.get_eval_dataloader().total_batch_size, len(t.get_eval_dataloader()))]
    assert shapes["stoker"] == shapes["hf"]


@pytest.mark.parametrize("framework", ["hf", "stoker"])
def test_persistent_workers_keep_the_evaluation_loader(tmp_path, framework):
    persistent = dict(dataloader_num_workers=1, dataloader_persistent_workers=True)
    t = trainer(framework, tmp_path, args=persistent,
                eval_dataset={"a": regression_rows(6), "b": regression_rows(3)})
    a, b = t.get_eval_dataloader("a"), t.get_eval_dataloader("b")
    assert a is t.get_eval_dataloader("a") and b is t.get_eval_dataloader("b") and a is not b
    metrics = t.evaluate()  # the dict's sets, each through its kept loader
    assert {"eval_a_loss", "eval_b_loss"} <= set(metrics)
    assert t.get_eval_dataloader("a") is a
    single = trainer(framework, tmp_path, args=persistent)
    kept = single.get_eval_dataloader()
    assert single.get_eval_dataloader() is kept and len(kept.dataset) == 6
    other = single.get_eval_dataloader(regression_rows(3))
    # transformers hands out the kept loader of its own set for any set passed; stoker a loader of that set
    assert len(other.dataset) == (6 if framework == "hf" else 3)
    fresh = trainer(framework, tmp_path)
    assert fresh.get_eval_dataloader() is not fresh.get_eval_dataloader()


def test_predict_never_reads_a_kept_evaluation_loader(tmp_path):
    t = trainer("stoker", tmp_path, args=dict(dataloader_num_workers=1, dataloader_persistent_workers=True))
    kept = t.evaluate()["eval_loss"]
    five = regression_rows(12)[7:]
    predicted = t.predict(five).metrics["test_loss"]
    assert predicted != pytest.approx(kept) and predicted == pytest.approx(t.evaluate(five)["eval_loss"])


class EvenOdd:
    """A loader of the user's own: two loaders read in turn; no set_epoch, no generator."""

    def __init__(self, *loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for batches in zip(*self.loaders, strict=True):
            yield from batches


def own_loader_trainer(base):
    class OwnLoader(base):
        def get_train_dataloader(self):
            rows = regression_rows(8)
            collate = torch.utils.data.default_collate
            loaders = [torch.utils.data.DataLoader(rows[i::2], batch_size=2, collate_fn=collate) for i in (0, 1)]
            return EvenOdd(*loaders)

    return OwnLoader


def test_a_subclass_with_its_own_loader_trains_without_train_dataset_as_transformers(tmp_path):
    results = {}
    for framework, module in FRAMEWORKS.items():
        t = trainer(framework, tmp_path, cls=own_loader_trainer(module.Trainer), train_dataset=None,
                    args=dict(num_train_epochs=2, logging_steps=1))
        out = t.train()
        results[framework] = (out.global_step, [r["loss"] for r in t.state.log_history if "loss" in r],
                              [p.detach().clone() for p in t.model.parameters()])
    assert results["stoker"][0] == results["hf"][0] == 4
    assert results["stoker"][1] == pytest.approx(results["hf"][1], rel=1e-5)
    for mine, theirs in zip(results["stoker"][2], results["hf"][2], strict=True):
        torch.testing.assert_close(mine, theirs)


def test_training_without_train_dataset_or_own_loader_says_so(tmp_path):
    t = trainer("stoker", tmp_path, train_dataset=None)
    with pytest.raises(ValueError, match="requires a train_dataset"):
        t.train()
