"""transformers' data conventions: label columns, its collators (BatchEncoding), several label names, nested
predictions, IterableDataset, a dict of eval datasets, float inputs; and the errors bad input still gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stoker import ConfigError, Trainer
from tests.helpers.tiny_jobs import args
from tests.parity.families import FAMILIES, rows
from tests.parity.oracle import assert_logs_close, recorder


def tokenizer():
    """A word-level tokenizer built in memory (no hub): "w5 w6 ..." -> [5, 6, ...]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, **{f"w{i}": i for i in range(5, 64)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def both(family: str, tmp_path, data, collator, **kw) -> tuple[dict, dict]:
    """Parameters and logs after 2 SGD steps over one batch of all of `data`, through transformers.Trainer and
    stoker.Trainer with the same collator."""
    import transformers

    import stoker

    out = {}
    for name, module in (("hf", transformers), ("stoker", stoker)):
        model = FAMILIES[family](0)
        settings = dict(output_dir=str(tmp_path / name), report_to="none", disable_tqdm=True, optim="sgd",
                        learning_rate=0.5, lr_scheduler_type="constant", seed=7, per_device_train_batch_size=len(data),
                        num_train_epochs=2, logging_steps=1, save_strategy="no", **kw)
        trainer = module.Trainer(model, module.TrainingArguments(**settings), train_dataset=data,
                                 data_collator=collator(model))
        trainer.train()
        out[name] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                     "logs": [{k: r[k] for k in ("loss", "grad_norm", "step") if k in r}
                              for r in trainer.state.log_history]}
    return out["hf"], out["stoker"]


def assert_same_training(hf: dict, ours: dict) -> None:
    for name, p in hf["params"].items():
        torch.testing.assert_close(ours["params"][name], p, atol=1e-5, rtol=0)
    assert_logs_close(ours["logs"], hf["logs"])


def texts(n: int, seed: int) -> list[str]:
    return [" ".join(f"w{row['input_ids'][i]}" for i in range(len(row["input_ids"])))
            for row in rows("llama", n, seed)]


def test_glue_style_label_column_is_kept_and_renamed_as_transformers_does(tmp_path):
    """A datasets.Dataset with `label` and a text column: remove_unused_columns drops the text and keeps the label,
    which reaches the model as `labels`."""
    from datasets import Dataset
    from transformers import DataCollatorWithPadding

    tok = tokenizer()
    data = Dataset.from_list([{"sentence": t, "label": i % 3, **tok(t)} for i, t in enumerate(texts(8, 4))])
    hf, ours = both("bert_sequence", tmp_path, data, lambda m: DataCollatorWithPadding(tok))
    assert_same_training(hf, ours)
    # with stoker's own collator as well, and `label_ids` like `label`
    plain = Dataset.from_list([{"sentence": t, "label_ids": i % 3, **tok(t)} for i, t in enumerate(texts(8, 4))])
    trainer = Trainer(FAMILIES["bert_sequence"](0), args(tmp_path / "plain", max_steps=1), train_dataset=plain)
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(ours["logs"][0]["loss"], rel=1e-5)


def make_collator(kind: str, tok, model):
    import transformers

    return {"token_classification": lambda: transformers.DataCollatorForTokenClassification(tok),
            "seq2seq": lambda: transformers.DataCollatorForSeq2Seq(tok, model=model),
            "flattening": transformers.DataCollatorWithFlattening,
            "default": lambda: transformers.default_data_collator}[kind]()


@pytest.mark.parametrize("family, kind", [("bert_tokens", "token_classification"), ("t5", "seq2seq"),
                                          ("llama", "flattening"), ("llama", "default")])
def test_transformers_collators_train_as_with_transformers_trainer(tmp_path, family, kind):
    tok = tokenizer()
    data = rows(family, 8, 5)
    if kind == "default":  # stacks without padding: rows of one length
        data = [{"input_ids": r["input_ids"][:3], "labels": r["labels"][:3]} for r in data]
    hf, ours = both(family, tmp_path, data, lambda m: make_collator(kind, tok, m))
    assert_same_training(hf, ours)


def test_masked_lm_collator_batches_train(tmp_path):
    """DataCollatorForLanguageModeling draws its masks at random: the run trains on the labels it makes."""
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer()
    data = [{"input_ids": r["input_ids"]} for r in rows("bert_mlm", 8, 6)]
    trainer = Trainer(FAMILIES["bert_mlm"](0), args(tmp_path, max_steps=2, per_device_train_batch_size=4),
                      train_dataset=data, data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.5))
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in trainer.state.log_history if "loss" in r)


class TwoHeads(nn.Module):
    """A plain module with two label columns, returning (loss, logits_a, logits_b)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 4)

    def forward(self, x, labels=None, aux=None):
        la, lb = self.a(x), self.b(x)
        if labels is None:
            return la, lb
        return nn.functional.cross_entropy(la, labels) + nn.functional.cross_entropy(lb, aux), la, lb


def test_several_label_names_and_tuple_predictions(tmp_path):
    torch.manual_seed(0)
    data = [{"x": torch.randn(3).tolist(), "labels": i % 2, "aux": i % 4} for i in range(6)]
    trainer = Trainer(TwoHeads(), args(tmp_path, label_names=["labels", "aux"], per_device_eval_batch_size=4),
                      eval_dataset=data)
    out = trainer.predict(data)
    assert isinstance(out.predictions, tuple) and [p.shape for p in out.predictions] == [(6, 2), (6, 4)]
    assert isinstance(out.label_ids, tuple)
    assert out.label_ids[0].tolist() == [i % 2 for i in range(6)] and out.label_ids[1].tolist() == [
        i % 4 for i in range(6)]
    with torch.no_grad():
        x = torch.tensor([d["x"] for d in data])
        expected = trainer.model(x, torch.tensor(out.label_ids[0]), torch.tensor(out.label_ids[1]))[0].item()
    # two batches of 4 and 2 rows: the loss is their row-weighted mean, the mean over all rows of this model
    assert out.metrics["test_loss"] == pytest.approx(expected, rel=1e-5)
    unlabelled = trainer.predict([{"x": d["x"]} for d in data])
    assert [p.shape for p in unlabelled.predictions] == [(6, 2), (6, 4)] and unlabelled.label_ids is None


def test_seq2seq_predictions_are_a_tuple_as_transformers_gives_them(tmp_path):
    """T5's outputs hold logits and the encoder's last hidden state: both are predictions, as in transformers."""
    data = rows("t5", 5, 2)
    out = Trainer(FAMILIES["t5"](0), args(tmp_path, per_device_eval_batch_size=2)).predict(data)
    logits, encoder = out.predictions
    assert logits.shape[:2] == out.label_ids.shape and logits.shape[2] == 64
    assert encoder.shape[0] == 5 and encoder.shape[2] == 32


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_iterable_datasets_train_evaluate_and_predict(tmp_path):
    train, held_out = rows("llama", 12, 1), rows("llama", 5, 2)
    from stoker import TrainerCallback

    seen = recorder(TrainerCallback)
    trainer = Trainer(FAMILIES["llama"](0), args(tmp_path, max_steps=4, per_device_train_batch_size=4,
                                                 per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2),
                      train_dataset=Stream(train), eval_dataset=Stream(held_out), callbacks=[seen])
    trainer.train()
    assert trainer.state.global_step == 4  # 3 batches an epoch: the stream was read again for the 4th
    assert seen.events.count("on_epoch_begin") == 2
    streamed = trainer.predict(Stream(held_out))
    listed = trainer.predict(held_out)
    assert streamed.metrics["test_loss"] == pytest.approx(listed.metrics["test_loss"], rel=1e-6)
    np.testing.assert_allclose(streamed.predictions, listed.predictions, atol=1e-6)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(listed.metrics["test_loss"], rel=1e-6)


def test_a_dict_of_eval_datasets_is_evaluated_one_by_one_with_its_names(tmp_path):
    sets = {"short": rows("llama", 3, 2), "long": rows("llama", 5, 3)}
    trainer = Trainer(FAMILIES["llama"](0), args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                                 eval_strategy="steps", eval_steps=1,
                                                 metric_for_best_model="eval_long_loss"),
                      train_dataset=rows("llama", 8, 1), eval_dataset=sets)
    trainer.train()
    logged = [r for r in trainer.state.log_history if "eval_long_loss" in r or "eval_short_loss" in r]
    assert [r["step"] for r in logged] == [1, 1, 2, 2]
    assert trainer.state.best_metric == min(r["eval_long_loss"] for r in logged if "eval_long_loss" in r)
    metrics = trainer.evaluate()
    assert {k for k in metrics if k.endswith("_loss")} == {"eval_short_loss", "eval_long_loss"}
    for name, data in sets.items():
        assert metrics[f"eval_{name}_loss"] == pytest.approx(trainer.evaluate(data)["eval_loss"], rel=1e-6)
        assert trainer.evaluate(name)["eval_loss"] == metrics[f"eval_{name}_loss"]  # one of them, by its name


class FloatInputs(nn.Module):
    """A model that takes its token ids and mask as floats (integer-valued), as some regression models do."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(1, 1)

    def forward(self, input_ids, attention_mask, labels):
        pred = self.w((input_ids * attention_mask).sum(1, keepdim=True) / 100).squeeze(1)
        return nn.functional.mse_loss(pred, labels)


def test_integer_valued_float_inputs_are_counted(tmp_path):
    data = [{"input_ids": [float(t) for t in r["input_ids"]], "attention_mask": [1.0] * len(r["input_ids"]),
             "labels": float(len(r["input_ids"]))} for r in rows("llama", 8, 3)]
    trainer = Trainer(FloatInputs(), args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                          include_num_input_tokens_seen="non_padding"), train_dataset=data)
    trainer.train()
    assert trainer.state.num_input_tokens_seen == sum(len(r["input_ids"]) for r in data)


def test_bad_input_gets_one_clear_error_before_any_work(tmp_path):
    data = rows("llama", 4, 1)
    with pytest.raises(ConfigError, match="data collator returned tuple; it must return a dict"):
        Trainer(FAMILIES["llama"](0), args(tmp_path), train_dataset=data,
                data_collator=lambda rs: (torch.zeros(len(rs), 3),)).train()
    with pytest.raises(ConfigError, match=r"computes its loss from \['labels'\].*which the batches lack"):
        Trainer(FAMILIES["llama"](0), args(tmp_path),
                train_dataset=[{"input_ids": r["input_ids"]} for r in data]).train()
    with pytest.raises(ConfigError, match="max_steps=-1: a train_dataset without a length"):
        Trainer(FAMILIES["llama"](0), args(tmp_path), train_dataset=Stream(data))

    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(1, 2)

        def forward(self, x):
            return (self.w(x),)

    trainer = Trainer(NoLoss(), args(tmp_path, max_steps=1), train_dataset=[{"x": [1.0]}] * 4)
    weight = trainer.model.w.weight.detach().clone()
    with pytest.raises(ValueError, match="the model returned no loss"):
        trainer.train()
    assert torch.equal(trainer.model.w.weight, weight)


def test_question_answering_labels_are_found_and_evaluated_as_transformers_does(tmp_path):
    """label_names default to the model's label arguments (start_positions, end_positions), as transformers."""
    import random

    import transformers

    import stoker
    from stoker.data import PaddingCollator
    from tests.parity.families import _bert_config

    rng = random.Random(0)
    data = []
    for _ in range(6):
        ids = [rng.randint(3, 63) for _ in range(rng.randint(4, 12))]
        start = rng.randrange(len(ids))
        data.append({"input_ids": ids, "start_positions": start, "end_positions": rng.randrange(start, len(ids))})
    results = {}
    for name, module in (("hf", transformers), ("stoker", stoker)):
        torch.manual_seed(0)
        model = transformers.BertForQuestionAnswering(_bert_config())
        trainer = module.Trainer(model, module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none",
                                                                 per_device_eval_batch_size=6),
                                 data_collator=PaddingCollator())
        results[name] = trainer.predict(data)
    ours, hf = results["stoker"], results["hf"]
    assert ours.metrics["test_loss"] == pytest.approx(hf.metrics["test_loss"], rel=1e-5)
    for a, b in zip(ours.predictions, hf.predictions, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert [a.tolist() for a in ours.label_ids] == [b.tolist() for b in hf.label_ids]
