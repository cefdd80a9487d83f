"""Behaviours transformers' own Trainer tests rely on, run through transformers.Trainer and stoker.Trainer: the
error for a resume_from_checkpoint that is no checkpoint, eval rows checked when evaluation starts (not when the
Trainer is built), a one-argument log() override, accelerator_config's dispatch_batches left None and
sync_each_batch, the data collator called exactly as transformers calls it (no probe of its own), and an epoch
that yields no batch ending the run."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import stoker
from stoker.errors import CheckpointError, ConfigError
from tests.helpers.tiny_jobs import Regressor, regression_rows
from tests.parity.families import FAMILIES, rows
from tests.parity.test_parity_conventions import both, tokenizer

FRAMEWORKS = {"hf": transformers, "stoker": stoker}


def quiet(module, out, **kw):
    values = dict(output_dir=str(out), report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                  optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", seed=3)
    values.update(kw)
    return module.TrainingArguments(**values)


# --- resume_from_checkpoint that is no checkpoint ---------------------------------------------------


@pytest.mark.parametrize("where", ["missing", "empty_folder", "not_a_checkpoint"])
def test_resuming_from_no_checkpoint_raises_transformers_value_error(tmp_path, where):
    """transformers raises ValueError("Can't find a valid checkpoint at <path>"); scripts and its own test match the
    words. stoker's error is a ValueError with the same words, its own reason after them, and still a
    CheckpointError."""
    folder = tmp_path / "bogus"
    if where != "missing":
        folder.mkdir()
    if where == "not_a_checkpoint":
        (folder / "notes.txt").write_text("no checkpoint here")
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, max_steps=1),
                                 train_dataset=regression_rows(4))
        with pytest.raises(ValueError, match=f"Can't find a valid checkpoint at {folder}") as raised:
            trainer.train(resume_from_checkpoint=str(folder))
        if name == "stoker":
            assert isinstance(raised.value, CheckpointError)
            assert ("no such folder" if where == "missing" else "not a stoker checkpoint") in str(raised.value)


# --- eval rows checked when evaluation starts ---------------------------------------------------------


class NeedsX(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


def feature_rows(n: int) -> list[dict]:
    return [{"features": r["x"], "labels": r["labels"]} for r in regression_rows(n)]


@pytest.mark.parametrize("persistent", [False, True], ids=["plain", "persistent_workers"])
def test_eval_rows_the_model_cannot_take_build_their_dataloader_and_are_refused_when_evaluation_starts(
        tmp_path, persistent):
    """A script that only builds its dataloaders works as with transformers; evaluate() and predict() refuse the
    rows before the model sees them, naming the set and what forward needs."""
    kw = dict(dataloader_num_workers=1, dataloader_persistent_workers=True) if persistent else {}
    kw["remove_unused_columns"] = False  # transformers would drop the column forward does not take
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(NeedsX(), quiet(module, tmp_path / name, per_device_eval_batch_size=2, **kw),
                                 eval_dataset=feature_rows(4))
        batch = next(iter(trainer.get_eval_dataloader()))
        assert sorted(batch) == ["features", "labels"]
        if persistent:
            assert trainer.get_eval_dataloader() is trainer.get_eval_dataloader()  # built once, as transformers
    with pytest.raises(ConfigError, match=r"eval_dataset: batches have columns \['features', 'labels'\]; "
                                          r"NeedsX.forward needs \['x'\]"):
        trainer.evaluate()
    with pytest.raises(ConfigError, match=r"test_dataset: .*NeedsX.forward needs \['x'\]"):
        trainer.predict(feature_rows(4))


def test_eval_rows_are_checked_at_the_first_evaluation_of_training(tmp_path):
    """eval_on_start: the eval rows are refused before training starts, the weights untouched."""
    trainer = stoker.Trainer(NeedsX(), quiet(stoker, tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1,
                                             eval_on_start=True, remove_unused_columns=False),
                             train_dataset=[{"x": r["x"], "labels": r["labels"]} for r in regression_rows(4)],
                             eval_dataset=feature_rows(4))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ConfigError, match="eval_dataset: .*needs"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert trainer.state.global_step == 0


# --- log(self, logs) ---------------------------------------------------------------------------------


def test_a_one_argument_log_override_is_called_with_the_logs_alone(tmp_path):
    """transformers' plateau test overrides log(self, logs); its logs at evaluation and at the end of training are
    called with the logs alone. stoker calls every override with the arguments its signature takes."""
    history = {}
    for name, module in FRAMEWORKS.items():
        class WithLRLogs(module.Trainer):
            def log(self, logs):
                logs["learning_rate"] = self.optimizer.param_groups[0]["lr"] if self.optimizer else None
                super().log(logs)

        trainer = WithLRLogs(Regressor(as_dict=True), quiet(module, tmp_path / name, num_train_epochs=2,
                                                             per_device_train_batch_size=4, eval_strategy="epoch",
                                                             lr_scheduler_type="reduce_lr_on_plateau",
                                                             logging_steps=500),
                             train_dataset=regression_rows(8), eval_dataset=regression_rows(4))
        trainer.train()
        history[name] = [sorted(k for k in r if not k.endswith("model_preparation_time"))
                         for r in trainer.state.log_history]
    assert history["stoker"] == history["hf"]
    assert all("learning_rate" in keys for keys in history["stoker"])


def test_log_overrides_of_every_shape_get_what_they_take(tmp_path):
    seen = []

    class Keyword(stoker.Trainer):
        def log(self, logs, *, start_time=None, diagnostics=None):
            seen.append(("keyword", start_time is not None or "train_loss" in logs, diagnostics is not None))
            super().log(logs, start_time, diagnostics=diagnostics)

    class DiagnosticsOnly(stoker.Trainer):
        def log(self, logs, diagnostics=None):
            seen.append(("diagnostics", diagnostics is not None))
            super().log(logs, diagnostics=diagnostics)

    class Anything(stoker.Trainer):
        def log(self, logs, *args, **kwargs):
            seen.append(("anything", len(args), sorted(kwargs)))
            super().log(logs, *args, **kwargs)

    for cls in (Keyword, DiagnosticsOnly, Anything):
        cls(Regressor(as_dict=True), quiet(stoker, tmp_path / cls.__name__, max_steps=1, logging_steps=1),
            train_dataset=regression_rows(4)).train()
    assert seen == [("keyword", True, True), ("keyword", True, True), ("diagnostics", True), ("diagnostics", True),
                    ("anything", 1, ["diagnostics"]), ("anything", 1, ["diagnostics"])]


# --- accelerator_config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [{}, {"even_batches": False}, None], ids=["empty", "partial", "none"])
def test_dispatch_batches_left_none_reads_back_none_and_each_process_still_reads_its_share(tmp_path, value):
    """transformers' test_accelerator_config_empty: the Accelerator's dispatch_batches is None. stoker prepares
    its loaders with None as with False (README's differences table): an IterableDataset is read by every process
    for its own share, never concatenated by the main one."""
    from accelerate.data_loader import DataLoaderDispatcher

    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, accelerator_config=value),
                                 train_dataset=regression_rows(4))
        assert trainer.accelerator.dispatch_batches is None
        assert trainer.args.accelerator_config.dispatch_batches is None
    loader = trainer.get_train_dataloader()
    assert not isinstance(loader, DataLoaderDispatcher)
    assert trainer.accelerator.dispatch_batches is None  # put back after preparing
    dispatched = stoker.Trainer(Regressor(as_dict=True), quiet(stoker, tmp_path / "d", accelerator_config={
        "dispatch_batches": True}), train_dataset=regression_rows(4)).get_train_dataloader()
    assert isinstance(dispatched, DataLoaderDispatcher)


def test_sync_each_batch_gives_the_same_update_without_a_no_sync_window(tmp_path):
    """gradient_accumulation_kwargs={"sync_each_batch": True}, as transformers hands it to Accelerate: gradients
    synchronised at every micro-batch (the backend never enters accelerator.no_sync), and the update of the loop's
    exact normalisation unchanged (batch 2 x accumulation 3 over rows of different target counts)."""
    data = rows("llama", 12, 3)
    results = {}
    for sync in (False, True):
        args = quiet(stoker, tmp_path / str(sync), max_steps=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=3, logging_steps=1,
                     accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync}})
        trainer = stoker.Trainer(FAMILIES["llama"](0), args, train_dataset=data,
                                 data_collator=stoker.data.PaddingCollator())
        entered, no_sync = [], trainer.accelerator.no_sync
        trainer.accelerator.no_sync = lambda model, f=no_sync, seen=entered: seen.append(1) or f(model)
        trainer.train()
        results[sync] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, len(entered),
                         [r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert results[False][1] == 4 and results[True][1] == 0  # 2 of each window's 3 micro-batches, or none
    for name, p in results[False][0].items():
        torch.testing.assert_close(results[True][0][name], p, rtol=0, atol=1e-6)
    assert results[True][2] == pytest.approx(results[False][2], rel=1e-6)


def test_gradient_accumulation_kwargs_refusals_name_the_key():
    with pytest.raises(ConfigError) as raised:
        stoker.TrainingArguments(output_dir="x", accelerator_config={"gradient_accumulation_kwargs": {
            "num_steps": 2, "sync_each_bach": True, "adjust_scheduler": False}})
    text = str(raised.value)
    assert "num_steps=2: set gradient_accumulation_steps instead" in text
    assert "unknown key 'sync_each_bach' (did you mean 'sync_each_batch'?)" in text
    assert "adjust_scheduler=False" in text
    assert stoker.TrainingArguments(output_dir="x", accelerator_config={"gradient_accumulation_kwargs": {
        "sync_each_batch": True}}).accelerator_config.syncs_each_batch()


# --- the data collator is called as transformers calls it -----------------------------------------------


class Counting:
    """A collator that writes down the rows of every call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, features):
        self.calls.append(len(features))
        return self.inner(features)


@pytest.mark.parametrize("evaluates", [False, True], ids=["train", "train_and_evaluate"])
def test_the_data_collator_sees_the_calls_transformers_makes(tmp_path, evaluates):
    calls = {}
    for name, module in FRAMEWORKS.items():
        collator = Counting(stoker.data.PaddingCollator())
        extra = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4) if evaluates else {}
        trainer = module.Trainer(FAMILIES["llama"](0), quiet(module, tmp_path / name, max_steps=2,
                                                             per_device_train_batch_size=3, **extra),
                                 train_dataset=rows("llama", 6, 1), eval_dataset=rows("llama", 4, 2) if evaluates
                                 else None, data_collator=collator)
        trainer.train()
        calls[name] = collator.calls
    assert calls["stoker"] == calls["hf"] == [3, 3] + ([4] if evaluates else [])


class RecordingMasks:
    """DataCollatorForLanguageModeling, writing down which positions each call masked (labels != -100)."""

    def __init__(self, tok):
        from transformers import DataCollatorForLanguageModeling

        self.inner, self.masks = DataCollatorForLanguageModeling(tok, mlm_probability=0.5), []

    def __call__(self, features):
        batch = self.inner(features)
        self.masks.append((batch["labels"] != -100).tolist())
        return batch


def test_masked_lm_masking_draws_as_with_transformers(tmp_path):
    """The masks drawn from the global RNG are transformers': same masked positions, same losses, same weights."""
    tok = tokenizer()
    data = [{"input_ids": r["input_ids"]} for r in rows("bert_mlm", 8, 6)]
    collators = []

    def collator(model):
        collators.append(RecordingMasks(tok))
        return collators[-1]

    hf, ours = both("bert_mlm", tmp_path, data, collator)
    assert collators[1].masks == collators[0].masks and len(collators[0].masks) == 2
    assert [r["loss"] for r in ours["logs"] if "loss" in r] == pytest.approx(
        [r["loss"] for r in hf["logs"] if "loss" in r], rel=1e-5)
    for name, p in hf["params"].items():
        torch.testing.assert_close(ours["params"][name], p, atol=1e-5, rtol=0)


def test_a_stream_that_can_be_read_once_is_not_read_ahead(tmp_path):
    """The first batch is checked as the loop runs it: nothing reads the train set before (a probe of its own
    would use up transformers' FiniteIterableDataset, and the run would train on nothing)."""
    from tests.helpers.dist_worker import ReadOnce

    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, max_steps=1,
                                                                per_device_train_batch_size=2),
                                 train_dataset=ReadOnce(regression_rows(2)))
        assert trainer.train().global_step == 1


# --- an epoch that yields no batch --------------------------------------------------------------------


def test_an_epoch_without_a_batch_ends_training_with_a_warning_as_transformers(tmp_path, caplog):
    """A stream used up after its first epoch, max_steps beyond it: transformers stops with a warning at the step
    it reached; so does stoker (it used to loop on empty epochs for ever)."""
    from tests.helpers.dist_worker import ReadOnce, short_data_runs

    steps = {}
    for name, module in FRAMEWORKS.items():
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, max_steps=5,
                                                                per_device_train_batch_size=2,
                                                                accelerator_config={"dispatch_batches": False}),
                                 train_dataset=ReadOnce(regression_rows(4)))
        with caplog.at_level(logging.WARNING):
            steps[name] = trainer.train().global_step
    assert steps["stoker"] == steps["hf"] == 2
    assert "There seems not to be a single sample in your epoch_iterator" in caplog.text
    assert "stopping training at step 2 of max_steps=5" in caplog.text
    # the scenarios of the 2-process test, on one process: each ends with the steps its data allows
    seen = short_data_runs(str(tmp_path / "short"), 1)
    assert {k: v["global_step"] for k, v in seen.items()} == {"hf_test": 1, "used_up": 1, "uneven_map": 2,
                                                              "dropped": 0}


def test_too_few_rows_for_one_batch_of_an_epoch_run_is_refused_before_work(tmp_path):
    args = quiet(stoker, tmp_path, per_device_train_batch_size=4, dataloader_drop_last=True)
    with pytest.raises(ValueError, match="yields no full micro-batch"):
        stoker.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(3)).train()


# --- transformers' own Trainer tests: resume_from_checkpoint=True with no checkpoint, the kept evaluation loader,
# skip_logits in a loss-only evaluation with use_liger_kernel ----------------------------------------------------


def test_resume_true_without_a_checkpoint_raises_as_transformers_and_last_starts_fresh(tmp_path):
    """transformers' test_can_resume_training: train(resume_from_checkpoint=True) into an output_dir without a
    checkpoint raises "No valid checkpoint found in output directory" (a mistyped output_dir must not retrain from
    scratch); stoker raises the same words, before any step. 'last' is a requeued job's first start: the newest
    checkpoint, or a new run where there is none; its second start resumes."""
    for name, module in FRAMEWORKS.items():
        out = tmp_path / name
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, out, max_steps=2),
                                 train_dataset=regression_rows(4))
        with pytest.raises(ValueError, match=rf"No valid checkpoint found in output directory \({out}\)"):
            trainer.train(resume_from_checkpoint=True)
        assert trainer.state.global_step == 0
    out = tmp_path / "requeued"
    first = stoker.Trainer(Regressor(as_dict=True), quiet(stoker, out, max_steps=2, save_strategy="steps",
                                                          save_steps=2), train_dataset=regression_rows(4))
    assert first.train(resume_from_checkpoint="last").global_step == 2
    again = stoker.Trainer(Regressor(as_dict=True), quiet(stoker, out, max_steps=3, logging_steps=1),
                           train_dataset=regression_rows(4))
    again.train(resume_from_checkpoint="last")
    assert [r["step"] for r in again.state.log_history if "loss" in r] == [3]  # steps 1-2 came from checkpoint-2


def test_a_recipe_asked_to_resume_from_an_empty_output_dir_is_refused_before_any_work(tmp_path):
    """`stoker train --resume_from_checkpoint true` into an output_dir without a checkpoint is refused with the
    recipe's other input problems (before the model or data load), naming 'last' for a requeued job."""
    from stoker.recipes.args import input_problems

    def problems(resume):
        args = stoker.TrainingArguments(output_dir=str(tmp_path / "run"), report_to="none",
                                        resume_from_checkpoint=resume)
        return input_problems({stoker.TrainingArguments: args}, checks=("output",))

    (refused,) = problems("true")
    assert refused.startswith("resume_from_checkpoint=true: ") and "holds no checkpoint" in refused
    assert "accepted: 'last'" in refused
    assert problems("last") == []


def test_the_trainers_own_eval_set_passed_in_gets_the_kept_loader_with_persistent_workers(tmp_path):
    """transformers' test_get_eval_dataloader_with_persistent_workers (prepare mocked out, as there):
    get_eval_dataloader() and get_eval_dataloader(the Trainer's own set) are one loader, and so are two calls
    for each named set."""
    persistent = dict(dataloader_persistent_workers=True, dataloader_num_workers=2)
    for name, module in FRAMEWORKS.items():
        own = regression_rows(6)
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, **persistent),
                                 train_dataset=regression_rows(4), eval_dataset=own)
        trainer.accelerator.prepare = lambda x: x
        default, passed = trainer.get_eval_dataloader(), trainer.get_eval_dataloader(own)
        assert default.dataset is own and passed is default, name
        first, second = regression_rows(6), regression_rows(3)
        trainer = module.Trainer(Regressor(as_dict=True), quiet(module, tmp_path / name, **persistent),
                                 train_dataset=regression_rows(4), eval_dataset={"first": first, "second": second})
        trainer.accelerator.prepare = lambda x: x
        loaders = [trainer.get_eval_dataloader(k) for k in ("first", "first", "second", "second")]
        assert loaders[0] is loaders[1] and loaders[2] is loaders[3] and loaders[0] is not loaders[2], name
        assert loaders[0].dataset is first and loaders[2].dataset is second


class ModelWithSkipLogits(torch.nn.Module):
    """transformers' test model: every forward asserts that it was handed skip_logits=True."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input_ids=None, labels=None, skip_logits=None, **kwargs):
        assert skip_logits is True
        self.calls += 1
        return {"loss": torch.tensor(0.0)}


class TinyRows(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i, i + 1, i + 2]), "labels": torch.tensor([1])}


def test_a_loss_only_evaluation_with_liger_hands_every_forward_skip_logits(tmp_path):
    """transformers' test_trainer_sets_skip_logits_for_loss_only_eval_when_liger_enabled: an evaluation-only
    Trainer of a plain module whose forward takes skip_logits; stoker's one-off loss-convention probes at the first
    evaluation call the model as the evaluation does (before, they called it without the flag and the model's
    assertion failed). liger-kernel is not needed: evaluation patches nothing."""
    for name, module in FRAMEWORKS.items():
        model = ModelWithSkipLogits()
        args = quiet(module, tmp_path / name, per_device_eval_batch_size=2, do_train=False, do_eval=True,
                     prediction_loss_only=True, use_liger_kernel=True)
        metrics = module.Trainer(model=model, args=args, eval_dataset=TinyRows()).evaluate()
        assert metrics["eval_loss"] == 0.0 and model.calls >= 2, name
