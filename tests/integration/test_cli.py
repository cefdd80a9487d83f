"""Configuration parsing (flags, YAML, JSON) and the `stoker` command, end to end on a tiny model."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stoker import ConfigError, TrainingArguments
from stoker.arguments import parse_config
from stoker.cli import main
from stoker.recipes import DataArguments, ModelArguments

YAML = """\
learning_rate: 1e-4
per_device_train_batch_size: 4
bf16: true
lr_scheduler_type: cosine_with_restarts
lr_scheduler_kwargs: {num_cycles: 2}
label_names: [labels, extra_labels]
"""


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------------
# parse_config


def test_flags_only():
    (args,) = parse_config((TrainingArguments,), ["--per_device_train_batch_size", "8", "--bf16",
                                                  "--learning_rate", "1e-4"])
    assert args.per_device_train_batch_size == 8
    assert args.bf16 is True
    assert isinstance(args.learning_rate, float) and args.learning_rate == 1e-4


def test_yaml_file(tmp_path):
    (args,) = parse_config((TrainingArguments,), [_write(tmp_path / "c.yaml", YAML)])
    # PyYAML reads 1e-4 (no dot) as the string '1e-4'; it must still arrive as a float
    assert isinstance(args.learning_rate, float) and args.learning_rate == 1e-4
    assert args.per_device_train_batch_size == 4
    assert args.bf16 is True
    assert args.lr_scheduler_type == "cosine_with_restarts"
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert args.label_names == ["labels", "extra_labels"]


def test_json_file(tmp_path):
    config = {"learning_rate": 0.001, "gradient_accumulation_steps": 3, "label_names": ["a", "b"],
              "lr_scheduler_kwargs": {"num_cycles": 3}, "eval_strategy": "steps", "eval_steps": 7}
    (args,) = parse_config((TrainingArguments,), [_write(tmp_path / "c.json", json.dumps(config))])
    assert args.learning_rate == 0.001
    assert args.gradient_accumulation_steps == 3
    assert args.label_names == ["a", "b"]
    assert args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert args.eval_strategy == "steps" and args.eval_steps == 7


def test_flags_override_the_file(tmp_path):
    path = _write(tmp_path / "c.yaml", YAML)
    (args,) = parse_config((TrainingArguments,), [path, "--learning_rate", "3e-4",
                                                  "--per_device_train_batch_size", "2"])
    assert args.learning_rate == 3e-4
    assert args.per_device_train_batch_size == 2
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}  # untouched keys still come from the file


def test_file_overrides_defaults(tmp_path):
    path = _write(tmp_path / "c.yaml", "seed: 3\n")
    (args,) = parse_config((TrainingArguments,), [path], defaults={"seed": 1, "learning_rate": 0.5})
    assert args.seed == 3 and args.learning_rate == 0.5


def test_unknown_yaml_key(tmp_path):
    path = _write(tmp_path / "c.yaml", "learning_rat: 1e-4\nseed: 1\n")
    with pytest.raises(ConfigError) as info:
        parse_config((TrainingArguments,), [path])
    message = str(info.value)
    assert "learning_rat" in message and "did you mean 'learning_rate'" in message


def test_unknown_flag():
    with pytest.raises(ConfigError) as info:
        parse_config((TrainingArguments,), ["--learning_rte", "1e-4"])
    assert any(p.startswith("--learning_rte") and "did you mean 'learning_rate'" in p for p in info.value.problems)


def test_abbreviated_flag_is_rejected_like_the_same_yaml_key():
    # argparse accepts any unambiguous prefix of a flag by default, so '--learning_rat' would silently set
    # learning_rate while the YAML key 'learning_rat' is rejected; and whether a prefix is ambiguous depends on
    # which dataclasses are parsed together ('--num_train' is num_train_epochs alone, an error with recipes).
    with pytest.raises(ConfigError) as info:
        parse_config((TrainingArguments,), ["--learning_rat", "1e-4"])
    assert "did you mean 'learning_rate'" in str(info.value)


def test_type_error_in_yaml_stops_before_anything_runs(tmp_path):
    path = _write(tmp_path / "c.yaml", "per_device_train_batch_size: abc\n")
    with pytest.raises(ConfigError, match="per_device_train_batch_size.*'abc'"):
        parse_config((TrainingArguments,), [path])


def test_type_error_through_the_command_does_not_train(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    path = _write(tmp_path / "c.yaml", f"output_dir: {out}\nper_device_train_batch_size: abc\n")
    assert main(["train", path]) == 2
    assert "per_device_train_batch_size" in capsys.readouterr().err
    assert not out.exists()


def test_problems_of_every_dataclass_in_one_error():
    with pytest.raises(ConfigError) as info:
        parse_config((ModelArguments, DataArguments, TrainingArguments),
                     ["--hidden_size", "0", "--num_train_examples", "0", "--per_device_train_batch_size", "0",
                      "--optim", "adamw_torh"])
    problems = info.value.problems
    for name in ("hidden_size=", "num_train_examples=", "per_device_train_batch_size=", "optim="):
        assert any(p.startswith(f"--{name}") for p in problems), name  # each names the flag it comes from
    assert len(problems) == 4


# ---------------------------------------------------------------------------------------------------
# the stoker command


def test_train_help_lists_groups_and_field_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for heading in ("model (recipe):", "dataset (recipe):", "batch:", "optimizer:", "precision:", "evaluation:",
                    "saving:", "distributed:"):
        assert f"\n{heading}\n" in out, heading
    assert "Peak learning rate." in out
    assert "Samples per micro-batch on each process." in out
    assert "--num_train_examples" in out  # DataArguments are there too


def test_unknown_command(capsys):
    assert main(["bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_unknown_flag_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--no_such_flag", "1"]) == 2
    assert "--no_such_flag" in capsys.readouterr().err
    assert main(["train", "--learning_rte", "1"]) == 2
    assert "did you mean 'learning_rate'" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing ran


def test_train_end_to_end(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    rc = main(["train", "--recipe", "clm", "--output_dir", str(out), "--num_train_examples", "256",
               "--num_eval_examples", "64",
               "--num_train_epochs", "1", "--hidden_size", "32", "--intermediate_size", "64",
               "--num_hidden_layers", "1", "--disable_tqdm", "true", "--eval_steps", "4", "--save_steps", "4",
               "--logging_steps", "2"])
    assert rc == 0

    results = json.loads((out / "results.json").read_text())
    assert results["after"]["eval_loss"] < results["before"]["eval_loss"]

    # 256 rows / batch 32 = 8 steps, a checkpoint every 4 steps, save_total_limit 2 (the default job)
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4", "checkpoint-8"]
    for name in checkpoints:
        assert (out / name / "manifest.json").is_file()

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]
    assert any("eval_loss" in r for r in records)

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["12+34=", "07+08="], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert logits.shape[:2] == batch["input_ids"].shape
    assert logits.shape[-1] == model.config.vocab_size == len(tokenizer)
    assert torch.isfinite(logits).all()
    assert not math.isnan(results["train"]["train_loss"])


def _stoker_executable() -> str:
    found = shutil.which("stoker")
    if found:
        return found
    candidate = Path(sys.executable).parent / "stoker"
    if not candidate.exists():
        pytest.fail("the stoker console script is not installed next to the interpreter")
    return str(candidate)


def test_console_script_help():
    proc = subprocess.run([_stoker_executable(), "train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "optimizer:" in proc.stdout and "--per_device_train_batch_size" in proc.stdout


# ---------------------------------------------------------------------------------------------------
# stoker report


def test_report_rewrites_a_runs_report_and_prints_its_goodput(tiny_llama, clm_rows, make_args, tmp_path, capsys):
    from stoker import Trainer

    out = tmp_path / "out"
    Trainer(tiny_llama(), make_args(max_steps=6, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                                    save_steps=3), train_dataset=clm_rows(32), eval_dataset=clm_rows(8, seed=1)).train()
    (out / "quarantine.jsonl").write_text(json.dumps({"step": 5, "restored_step": 3, "reason": "loss spike",
                                                      "loss": 9.1, "median": 2.3, "indices": [4, 11, 17],
                                                      "ranks": [0, 0, 0]}) + "\n")
    assert not (out / "report.html").exists()
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert f"goodput {100 * final['goodput']:.1f}%: productive" in printed
    assert re.search(r"^  checkpoint +[\d.]+ s +[\d.]+%$", printed, flags=re.M)
    assert re.search(r"^  evaluation +[\d.]+ s +[\d.]+%$", printed, flags=re.M)
    assert "3 rows quarantined in 1 rollback\nstep 5: rolled back to step 3, 3 rows set aside" in printed
    assert "global_step: 6" in printed and f"report written to {out / 'report.html'}" in printed
    page = (out / "report.html").read_text()
    assert '<img alt="Goodput"' in page and '<img alt="Loss"' in page and "Quarantined rows" in page


def test_report_of_a_folder_without_a_run_exits_2_naming_it(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert f"OUTPUT_DIR='{tmp_path / 'missing'}': no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"OUTPUT_DIR='{tmp_path / 'empty'}': no run records in it; expected metrics.jsonl" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["report"]) == 2
    assert "stoker: " in capsys.readouterr().err
    assert not (tmp_path / "empty" / "report.html").exists()
