"""Recipes and docs stay in step with the package: every recipe runs end to end on a shortened setting."""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
from pathlib import Path

from stoker import TrainingArguments
from stoker.arguments import parse_config
from stoker.recipes import DEFAULT_JOB, DataArguments, ModelArguments

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--num_train_examples", "128", "--num_eval_examples", "32", "--num_train_epochs", "1",
         "--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1",
         "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--disable_tqdm", "true",
         "--logging_steps", "2", "--eval_steps", "4", "--save_steps", "4"]


def test_addition_yaml_spells_out_the_embedded_default():
    from_yaml = parse_config((ModelArguments, DataArguments, TrainingArguments),
                             [str(ROOT / "recipes" / "clm_addition.yaml")])
    embedded = parse_config((ModelArguments, DataArguments, TrainingArguments), [], DEFAULT_JOB)
    for a, b in zip(from_yaml, embedded, strict=True):
        da, db = dataclasses.asdict(a), dataclasses.asdict(b)
        da.pop("logging_dir", None), db.pop("logging_dir", None)  # time-stamped
        assert da == db


def test_clm_recipe_runs_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    main = runpy.run_path(str(ROOT / "recipes" / "clm.py"))["main"]
    out = tmp_path / "run"
    assert main([str(ROOT / "recipes" / "clm_addition.yaml"), "--output_dir", str(out), *SHORT]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["after"]["eval_loss"] < results["before"]["eval_loss"]
    assert {"eval_exact_match", "eval_token_accuracy"} <= set(results["after"])
    assert any(p.startswith("checkpoint-") for p in os.listdir(out))
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 32


def test_clm_recipe_trains_on_local_text_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}"}) + "\n" for i in range(40)))
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}"}) + "\n" for i in range(40, 48)))
    main = runpy.run_path(str(ROOT / "recipes" / "clm.py"))["main"]
    out = tmp_path / "run"
    assert main(["--train_file", str(train), "--validation_file", str(dev), "--output_dir", str(out), *SHORT]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["after"]["eval_loss"] < results["before"]["eval_loss"]


def test_bad_data_files_are_named(tmp_path, capsys):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({"body": "no text column"}) + "\n")
    main = runpy.run_path(str(ROOT / "recipes" / "clm.py"))["main"]
    assert main(["--train_file", str(tmp_path / "missing.jsonl"), "--validation_file", str(tmp_path / "x.csv"),
                 "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "train_file=" in err and "no such file" in err and "validation_file=" in err and ".jsonl" in err


def test_readme_documents_every_training_argument():
    readme = (ROOT / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainingArguments) if f"`{f.name}`" not in readme]
    assert missing == []
