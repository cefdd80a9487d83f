"""The loop: exact accumulation, loss sources, optimizers and schedules, checkpointing, evaluation, saving."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from stoker import ConfigError, Trainer, TrainerCallback, TrainingArguments
from stoker.data import IGNORE_INDEX
from tests.helpers.tiny_jobs import GradRecorder, Regressor, args, llama, losses, regression_rows, rows


def train(model, tmp_path, data, **kw):
    rec = GradRecorder()
    trainer = Trainer(model, args(tmp_path, **kw), train_dataset=data, callbacks=[rec])
    trainer.train()
    return trainer, rec


def assert_close_params(a: nn.Module, b: nn.Module, atol: float):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


# logged losses are rounded to 6 decimals: two that differ by float32 summation order (1e-8) may round one unit
# apart (4.1637475 -> 4.163747 and 4.163748, seen on an AVX2 CPU)
LOGGED_LOSS_ABS = 1.5e-6


# --- invariant 1: exact accumulation --------------------------------------------------------------


def test_accumulation_equals_one_big_batch(tmp_path):
    data = rows(8)
    big, rec_big = train(llama(), tmp_path / "a", data, per_device_train_batch_size=8, max_steps=1)
    small, rec_small = train(llama(), tmp_path / "b", data, per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, max_steps=1)
    for name, g in rec_big.grads[0].items():
        torch.testing.assert_close(rec_small.grads[0][name], g, atol=1e-6, rtol=0)
    assert_close_params(big.model, small.model, atol=1e-6)
    assert losses(big) == pytest.approx(losses(small), abs=LOGGED_LOSS_ABS)


def test_the_model_is_put_in_training_mode_only_when_its_mode_changed(tmp_path, monkeypatch):
    """model.train() walks every module (8.8 ms for a LoRA Llama of 32 layers): the loop calls it when training
    starts and after each evaluation left the model in eval mode, never per micro-batch (transformers calls it in
    every training_step). 4 steps x 2 micro-batches with an evaluation after step 2: two calls, and the forwards
    after the evaluation still run in training mode."""
    calls, modes = [], []
    train_mode = nn.Module.train

    def counted(module, mode=True):
        if module is trainer.model_wrapped:
            calls.append(mode)
        return train_mode(module, mode)

    monkeypatch.setattr(nn.Module, "train", counted)

    class Modes(TrainerCallback):
        def on_substep_end(self, args, state, control, model=None, **kw):
            modes.append(model.training)

    trainer = Trainer(llama(), args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                    max_steps=4, eval_strategy="steps", eval_steps=2),
                      train_dataset=rows(16), eval_dataset=rows(4), callbacks=[Modes()])
    trainer.train()
    assert [mode for mode in calls if mode] == [True, True] and modes == [True] * 4  # eval() is train(False)


def test_accumulation_with_a_short_last_window(tmp_path):
    data = rows(10, seed=3)  # batch 2 x accumulation 4: windows of 4 and 1 micro-batches per epoch
    big, _ = train(llama(), tmp_path / "a", data, per_device_train_batch_size=8, num_train_epochs=1)
    small, _ = train(llama(), tmp_path / "b", data, per_device_train_batch_size=2,
                     gradient_accumulation_steps=4, num_train_epochs=1)
    assert big.state.global_step == small.state.global_step == 2
    assert_close_params(big.model, small.model, atol=1e-6)
    assert losses(big) == pytest.approx(losses(small), abs=LOGGED_LOSS_ABS)


def test_naive_mean_of_micro_batch_means_would_differ(tmp_path):
    """The data above is uneven enough that averaging per-micro-batch means is measurably wrong."""
    from stoker.data import PaddingCollator

    model, batch = llama(), PaddingCollator()(rows(8))
    exact = model(**batch).loss
    naive = sum(model(**{k: v[i:i + 2] for k, v in batch.items()}).loss for i in range(0, 8, 2)) / 4
    assert abs(exact.item() - naive.item()) > 1e-3


def test_window_sizes():
    from stoker.trainer import window_sizes

    assert window_sizes(10, 4) == [4, 4, 2]
    assert window_sizes(8, 4) == [4, 4]
    assert window_sizes(3, 4) == [3]
    assert window_sizes(5, 1) == [1] * 5


# --- loss sources ----------------------------------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True])
def test_plain_module_loss_is_exact_under_accumulation(tmp_path, as_dict):
    data = regression_rows(12)  # batch 8 x accumulation 2 ... vs batch 4 x accumulation 4: a short window
    a, _ = train(Regressor(as_dict), tmp_path / "a", data, per_device_train_batch_size=12, max_steps=1,
                 learning_rate=0.1)
    b, _ = train(Regressor(as_dict), tmp_path / "b", data, per_device_train_batch_size=4,
                 gradient_accumulation_steps=3, max_steps=1, learning_rate=0.1)
    assert_close_params(a.model, b.model, atol=1e-6)
    before = Regressor()
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(a.model.parameters(), before.parameters(), strict=True))


class LogitsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 64)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.out(self.emb(input_ids))}


def test_compute_loss_func_receives_window_token_count(tmp_path):
    seen = []

    def token_loss(outputs, labels, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        logits = outputs["logits"]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_items_in_batch

    data = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows(8, seed=5)]
    targets = sum(sum(t != IGNORE_INDEX for t in r["labels"]) for r in data)
    results = []
    for bs, acc in ((8, 1), (2, 4)):
        seen.clear()
        t = Trainer(LogitsOnly(), args(tmp_path / f"{bs}", per_device_train_batch_size=bs,
                                       gradient_accumulation_steps=acc, max_steps=1),
                    train_dataset=data, compute_loss_func=token_loss)
        t.train()
        assert seen == [targets] * acc  # every micro-batch sees the whole window's count
        results.append(t.model)
    assert_close_params(results[0], results[1], atol=1e-6)


def test_model_without_loss_gets_a_clear_error(tmp_path):
    data = [{"input_ids": r["input_ids"]} for r in rows(4)]
    with pytest.raises(ValueError, match="returned no loss"):
        Trainer(LogitsOnly(), args(tmp_path, max_steps=1), train_dataset=data).train()


# --- optimizers, schedules, memory switches --------------------------------------------------------


@pytest.mark.parametrize("name, cls", [
    ("adamw_torch", "AdamW"), ("adamw_torch_fused", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor"),
    # bitsandbytes' AdamW and Lion told their state's bits and paging, as transformers builds them
    ("adamw_bnb_8bit", "AdamW"), ("paged_adamw_8bit", "AdamW"), ("lion_8bit", "Lion"),
])
def test_optimizer_by_name_trains(tmp_path, name, cls):
    model = llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = Trainer(model, args(tmp_path, optim=name, learning_rate=1e-2, max_steps=2, per_device_train_batch_size=4),
                train_dataset=rows(8))
    t.train()
    assert type(t.optimizer.optimizer).__name__ == cls
    if name == "adamw_torch_fused":
        assert t.optimizer.optimizer.defaults["fused"] is True
    if "8bit" in name:  # 8-bit state, paged where the name says
        assert t.optimizer.optimizer.args.optim_bits == 8
        assert t.optimizer.optimizer.is_paged == name.startswith("paged_")
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)


def test_weight_decay_spares_biases_and_norms_and_frozen_params_are_left_out():
    from stoker.optim import create_optimizer

    model = llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    opt = create_optimizer(model, TrainingArguments(output_dir="x", weight_decay=0.1, optim="adamw_torch"))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in no_decay["params"])
    assert not any("norm" in names[id(p)] for p in decay["params"])
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in grouped
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    decay, no_decay = create_optimizer(m, TrainingArguments(output_dir="x", weight_decay=0.1, optim="sgd")).param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([2, 2])]
    assert len(no_decay["params"]) == 3  # linear bias, batchnorm weight and bias


def test_schedule_follows_transformers_get_scheduler(tmp_path):
    from transformers import get_scheduler

    t = Trainer(llama(), args(tmp_path, lr_scheduler_type="cosine", warmup_steps=0.25, max_steps=8,
                              learning_rate=1e-3, optim="adamw_torch", per_device_train_batch_size=2),
                train_dataset=rows(16))
    t.train()
    logged = [r["learning_rate"] for r in t.state.log_history if "learning_rate" in r]
    ref_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref = get_scheduler("cosine", ref_opt, num_warmup_steps=2, num_training_steps=8)
    expected = []
    for _ in range(8):  # each step logs the rate it used, as transformers.Trainer does: before the schedule moves
        expected.append(ref.get_last_lr()[0])
        ref_opt.step()
        ref.step()
    assert logged == pytest.approx(expected, abs=1e-12)
    assert logged[0] == 0.0 and logged[0] < logged[1] and logged[-1] > 0.0


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    data = rows(8, seed=2)
    _, plain = train(llama(), tmp_path / "a", data, per_device_train_batch_size=4, max_steps=1)
    model = llama()
    t, ckpt = train(model, tmp_path / "b", data, per_device_train_batch_size=4, max_steps=1,
                    gradient_checkpointing=True)
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    for name, g in plain.grads[0].items():
        torch.testing.assert_close(ckpt.grads[0][name], g, atol=1e-5, rtol=0)


def test_gradient_checkpointing_on_a_plain_module_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="gradient_checkpointing_enable"):
        Trainer(Regressor(), args(tmp_path, gradient_checkpointing=True), train_dataset=regression_rows())


def test_torch_compile_trains_like_eager(tmp_path):
    data = rows(8, seed=4)
    a, _ = train(llama(), tmp_path / "a", data, per_device_train_batch_size=4, max_steps=2)
    b, _ = train(llama(), tmp_path / "b", data, per_device_train_batch_size=4, max_steps=2,
                 torch_compile_backend="eager")
    assert b.args.torch_compile
    # the decoder layers, compiled in place (compile_scope "auto": the model has repeated blocks)
    assert all(layer._compiled_call_impl is not None for layer in b.model_wrapped.model.layers)
    assert_close_params(a.model, b.model, atol=1e-5)


def test_bf16_autocast_runs_on_cpu(tmp_path):
    t, _ = train(llama(), tmp_path, rows(8), per_device_train_batch_size=4, max_steps=2, bf16=True)
    assert t.accelerator.mixed_precision == "bf16"
    assert all(torch.isfinite(torch.tensor(losses(t))))


# --- data handling ----------------------------------------------------------------------------------


def test_unused_columns_are_removed_for_transformers_models(tmp_path):
    data = [{**r, "text": "a string column", "id": i} for i, r in enumerate(rows(8))]
    t, _ = train(llama(), tmp_path / "a", data, per_device_train_batch_size=4, max_steps=1)
    assert t.state.global_step == 1
    with pytest.raises(ConfigError, match="first batch could not be built .*data collator.*'text'"):
        train(llama(), tmp_path / "b", data, per_device_train_batch_size=4, max_steps=1, remove_unused_columns=False)


def test_datasets_dataset_and_token_counting(tmp_path):
    from datasets import Dataset

    data = rows(12, seed=9)
    ds = Dataset.from_list([{**r, "attention_mask": [1] * len(r["input_ids"])} for r in data])
    seen = {}
    for mode in ("non_padding", "all", "no"):
        t, _ = train(llama(), tmp_path / mode, ds, per_device_train_batch_size=4, num_train_epochs=1,
                     include_num_input_tokens_seen=mode, logging_steps=2)
        seen[mode] = t.state.num_input_tokens_seen
        assert t.state.global_step == 3 and t.state.epoch == pytest.approx(1.0)
    assert seen["non_padding"] == sum(len(r["input_ids"]) for r in data)
    assert seen["all"] > seen["non_padding"] and seen["no"] == 0  # "all" counts padding too


def test_fractional_epochs_and_max_steps(tmp_path):
    t, _ = train(llama(), tmp_path / "a", rows(16), per_device_train_batch_size=4, num_train_epochs=1.5)
    assert t.state.global_step == 6 and t.state.epoch == pytest.approx(1.5)
    t, _ = train(llama(), tmp_path / "b", rows(16), per_device_train_batch_size=4, max_steps=10)
    assert t.state.global_step == 10 and t.state.epoch == pytest.approx(2.5)


# --- evaluation and prediction ----------------------------------------------------------------------


def test_eval_loss_is_the_exact_token_mean_and_metrics_get_the_prefix(tmp_path):
    from stoker.data import PaddingCollator

    model, data = llama(), rows(10, seed=6)
    received = {}

    def metrics(p):
        received["shapes"] = (p.predictions.shape, p.label_ids.shape)
        return {"rows": float(len(p.label_ids))}

    t = Trainer(model, args(tmp_path, per_device_eval_batch_size=4), eval_dataset=data, compute_metrics=metrics)
    out = t.evaluate()
    batch = PaddingCollator()(data)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    expected = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert out["eval_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert out["eval_rows"] == 10.0
    assert received["shapes"][0][:2] == (10, 17) and received["shapes"][1] == (10, 17)
    pred = t.predict(data)
    assert pred.predictions.shape == (10, 17, 64) and pred.label_ids.shape == (10, 17)
    assert pred.metrics["test_loss"] == pytest.approx(expected.item(), abs=1e-5)


def test_eval_accumulation_and_preprocess_logits(tmp_path):
    seen, data = [], rows(9)
    t = Trainer(llama(), args(tmp_path, per_device_eval_batch_size=2, eval_accumulation_steps=2),
                eval_dataset=data, compute_metrics=lambda p: seen.append(p) or {},
                preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    t.evaluate()
    longest = max(len(r["input_ids"]) for r in data)
    assert seen[0].predictions.shape == (9, longest) and seen[0].predictions.dtype.kind == "i"
    # rows come back in dataset order, padded with -100 past their own length
    for row, labels in zip(data, seen[0].label_ids, strict=True):
        assert labels[: len(row["labels"])].tolist() == row["labels"]
        assert (labels[len(row["labels"]):] == IGNORE_INDEX).all()


# --- saving ----------------------------------------------------------------------------------------


def test_save_model_transformers_and_plain(tmp_path):
    from transformers import AutoModelForCausalLM

    from stoker.checkpoint_format import load_weights

    t, _ = train(llama(), tmp_path / "a", rows(8), per_device_train_batch_size=4, max_steps=1)
    t.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_close_params(t.model, loaded, atol=0)

    p, _ = train(Regressor(), tmp_path / "b", regression_rows(), per_device_train_batch_size=4, max_steps=1)
    p.save_model(str(tmp_path / "plain"))
    assert sorted(os.listdir(tmp_path / "plain")) == ["model.safetensors", "stoker_model.json", "training_args.json"]
    fresh = Regressor()
    load_weights(fresh, str(tmp_path / "plain"))
    assert_close_params(p.model, fresh, atol=0)


def test_checkpoints_rotate_hold_no_pickle_and_keep_the_best(tmp_path):
    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=6, save_strategy="steps",
                              save_steps=1, save_total_limit=2, eval_strategy="steps", eval_steps=1,
                              load_best_model_at_end=True, metric_for_best_model="loss", optim="adamw_torch",
                              learning_rate=1e-2),
                train_dataset=rows(8), eval_dataset=rows(4, seed=1))
    t.train()
    out = tmp_path / "out"
    kept = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))
    best = os.path.basename(t.state.best_model_checkpoint)
    expected = ["checkpoint-5", "checkpoint-6"] if best in ("checkpoint-5", "checkpoint-6") else [best, "checkpoint-6"]
    assert kept == expected
    for root, _, files in os.walk(out / "checkpoint-6"):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                head = fh.read(2)
            assert head[:1] != b"\x80" and head != b"PK", f"{f} looks like a pickle or a torch.save zip"
    assert not any(p.startswith(".tmp") for p in os.listdir(out))


# --- bad input --------------------------------------------------------------------------------------


def test_inputs_are_checked_together_before_any_work(tmp_path):
    with pytest.raises(ConfigError) as e:
        Trainer(llama(), args(tmp_path, eval_strategy="steps", eval_steps=1), train_dataset=[],
                optimizers=(None, object()))
    msg = str(e.value)
    assert "eval_dataset" in msg and "train_dataset: is empty" in msg and "optimizers" in msg


def test_rotation_never_deletes_the_best_or_the_newest(tmp_path):
    from stoker.checkpoint_format import rotate

    for step in (1, 2, 3, 10, 20):
        os.makedirs(tmp_path / f"checkpoint-{step}")
    deleted = rotate(str(tmp_path), 2, keep=str(tmp_path / "checkpoint-2"))
    assert sorted(os.path.basename(p) for p in deleted) == ["checkpoint-1", "checkpoint-10", "checkpoint-3"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-20"]
    assert rotate(str(tmp_path), 1, keep=str(tmp_path / "checkpoint-2")) == []  # both are protected
