"""recipes/hf_example.py, a script in the shape of transformers' examples, run on stoker and on transformers with
only its import line changed: first from flags, then from a JSON file resuming from the checkpoint that
get_last_checkpoint finds; the losses, metrics, predictions, weights and files must agree."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "hf_example.py"
OURS = "from stoker import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer  # TRAINER"
THEIRS = "from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer  # TRAINER"
COMMON = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--learning_rate", "1e-2",
          "--logging_steps", "1", "--save_steps", "2", "--train_sampling_strategy", "sequential", "--use_cpu",
          "--report_to", "none", "--disable_tqdm", "true"]
FILES = {"README.md", "all_results.json", "train_results.json", "eval_results.json", "predict_results.json",
         "trainer_state.json", "config.json", "model.safetensors", "predictions.npy", "checkpoint-2", "checkpoint-4"}


def scripts(tmp_path: Path) -> dict[str, Path]:
    text = SCRIPT.read_text()
    assert text.count(OURS) == 1
    out = {"stoker": tmp_path / "ours.py", "transformers": tmp_path / "theirs.py"}
    out["stoker"].write_text(text)
    out["transformers"].write_text(text.replace(OURS, THEIRS))
    ours, theirs = out["stoker"].read_text().splitlines(), out["transformers"].read_text().splitlines()
    assert sum(a != b for a, b in zip(ours, theirs, strict=True)) == 1
    return out


def run(script: Path, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    runpy.run_path(str(script), run_name="__main__")


def typed(flag_value: str):
    """A flag's value as a JSON file holds it."""
    try:
        return json.loads(flag_value)
    except json.JSONDecodeError:
        return flag_value


def losses(folder: Path) -> dict[int, float]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return {r["step"]: r["loss"] for r in history if "loss" in r}


@pytest.mark.parametrize("task", ["clm", "mlm", "cls", "ner", "seq2seq"])
def test_example_script_runs_on_stoker_as_on_transformers(task, tmp_path, monkeypatch):
    from transformers.trainer_utils import get_last_checkpoint

    generate = ["--predict_with_generate"] if task == "seq2seq" else []
    for name, script in scripts(tmp_path).items():
        out = tmp_path / name
        run(script, ["--task", task, "--output_dir", str(out), "--do_train", "--do_eval", "--max_steps", "2",
                     *generate, *COMMON], monkeypatch)
        assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
        # the same job again, longer, from a JSON file: the script resumes from the checkpoint it finds
        values = {"task": task, "output_dir": str(out), "do_train": True, "do_eval": True, "do_predict": True,
                  "max_steps": 4, "predict_with_generate": task == "seq2seq"}
        flags = iter(COMMON)
        for flag in flags:
            values[flag[2:]] = True if flag == "--use_cpu" else typed(next(flags))
        (tmp_path / f"{name}.json").write_text(json.dumps(values))
        run(script, [str(tmp_path / f"{name}.json")], monkeypatch)
    ours, theirs = tmp_path / "stoker", tmp_path / "transformers"
    assert FILES <= {p.name for p in ours.iterdir()} and FILES <= {p.name for p in theirs.iterdir()}
    ours_losses, their_losses = losses(ours), losses(theirs)
    assert sorted(ours_losses) == sorted(their_losses) == [1, 2, 3, 4]  # the resumed run kept the history
    for step, loss in their_losses.items():
        assert ours_losses[step] == pytest.approx(loss, abs=2e-4), step  # transformers logs 4 decimals
    for split in ("eval", "predict"):
        mine = json.loads((ours / f"{split}_results.json").read_text())
        expected = json.loads((theirs / f"{split}_results.json").read_text())
        for key in (f"{split}_loss", f"{split}_accuracy"):
            assert mine[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    predictions = np.load(ours / "predictions.npy"), np.load(theirs / "predictions.npy")
    if task == "seq2seq":
        np.testing.assert_array_equal(*predictions)  # generated token ids
    else:
        np.testing.assert_allclose(*predictions, atol=1e-4)
    mine, expected = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert set(mine) == set(expected)
    for key in expected:
        torch.testing.assert_close(mine[key], expected[key], atol=2e-5, rtol=1e-4)
    assert f"# tiny-{task}" in (ours / "README.md").read_text()
