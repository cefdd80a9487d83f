"""Seq2SeqTrainer: evaluation and predict that generate, on tiny T5 and BART models, against transformers'."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from stoker.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments

PAD = 0


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_decoder_layers=1, num_heads=2, pad_token_id=PAD, eos_token_id=1,
                                               decoder_start_token_id=PAD))


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=3, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


MODELS = {"t5": t5, "bart": bart}


def pairs(n: int, seed: int = 0, target_len: int = 5) -> list[dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(4, 64) for _ in range(rng.randint(3, 9))],
             "labels": [rng.randrange(4, 64) for _ in range(target_len)]} for _ in range(n)]


def collate(rows: list[dict]) -> dict:
    """The same padding for both trainers: inputs with PAD, labels with -100."""
    width = max(len(r["input_ids"]) for r in rows)
    target = max(len(r["labels"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (target - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


def args(tmp_path, cls=Seq2SeqTrainingArguments, **kw):
    values = dict(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, per_device_train_batch_size=4,
                  report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, learning_rate=1e-2)
    return cls(**{**values, **kw})


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predict_with_generate_matches_transformers(name, tmp_path):
    import transformers

    model, data = MODELS[name](), pairs(6)
    # batches of 3 rows with 5 target tokens each: transformers' eval loss, a mean of batch means, is then the
    # token mean that stoker computes (with unequal batches the two differ, and stoker's is the exact one)
    gen = dict(predict_with_generate=True, generation_max_length=7, generation_num_beams=2,
               per_device_eval_batch_size=3)
    theirs = transformers.Seq2SeqTrainer(model=copy.deepcopy(model), data_collator=collate,
                                         args=args(tmp_path / "hf", transformers.Seq2SeqTrainingArguments, **gen))
    expected = theirs.predict(data)
    ours = Seq2SeqTrainer(model, args(tmp_path, **gen), data_collator=collate).predict(data)
    np.testing.assert_array_equal(ours.predictions, expected.predictions)
    np.testing.assert_array_equal(ours.label_ids, expected.label_ids)
    assert ours.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-5)
    assert ours.predictions.shape == (6, 20)  # padded to the model's generation max_length, as transformers pads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_evaluation_generates_for_compute_metrics_and_training_runs(name, tmp_path):
    from transformers import GenerationConfig

    seen = []

    def metrics(p):
        seen.append(p.predictions)
        return {"exact": float((p.predictions[:, 1:6] == p.label_ids[:, :5]).all(-1).mean())}

    data, model = pairs(8), MODELS[name]()
    generation = GenerationConfig.from_model_config(model.config)
    generation.max_length, generation.num_beams = 9, 1
    trainer = Seq2SeqTrainer(model, args(tmp_path, predict_with_generate=True, max_steps=3,
                                         generation_config=generation),
                             train_dataset=data, eval_dataset=data, data_collator=collate, compute_metrics=metrics)
    assert trainer.model.generation_config.max_length == 9
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before and "eval_exact" in after
    assert seen[-1].shape == (8, 9) and seen[-1].dtype.kind == "i"  # token ids, not logits
    short = trainer.predict(data, max_new_tokens=2)  # generation keyword arguments of predict
    assert short.predictions.shape == (8, 9)  # the generated ids are padded to the generation config
    assert (short.predictions[:, 3:] == PAD).all()


def test_without_predict_with_generate_predictions_are_logits(tmp_path):
    out = Seq2SeqTrainer(t5(), args(tmp_path), data_collator=collate).predict(pairs(4))
    # as transformers: every output but the loss, so the logits and the encoder's last hidden state
    logits, encoder_states = out.predictions
    assert logits.shape == (4, 5, 64) and encoder_states.shape[0] == 4


def test_generation_config_from_a_local_folder_and_bad_values(tmp_path):
    from transformers import GenerationConfig

    from stoker import ConfigError

    GenerationConfig(max_length=11, num_beams=3, decoder_start_token_id=PAD, eos_token_id=1,
                     pad_token_id=PAD).save_pretrained(tmp_path / "gen")
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--generation_config", str(tmp_path / "gen")])
    trainer = Seq2SeqTrainer(t5(), parsed, data_collator=collate)
    assert trainer.model.generation_config.num_beams == 3
    with pytest.raises(ValueError, match="not a GenerationConfig, nor a local folder"):
        Seq2SeqTrainer(t5(), args(tmp_path, generation_config="org/some-hub-id"), data_collator=collate)
    with pytest.raises(ConfigError, match="generation_num_beams=0: must be a positive integer"):
        args(tmp_path, generation_num_beams=0)
    assert args(tmp_path, generation_config=GenerationConfig(max_length=5)).to_dict()["generation_config"][
        "max_length"] == 5
