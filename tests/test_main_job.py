"""The project's first promise: `stoker train` with nothing else, as the README runs it, teaches the tiny Llama the
chat form of addition (held-out exact match >= 0.9) and leaves the adapter, the merged model and the report where
it says. Unshrunk: the job a new user runs first, about a minute and a half on 2 CPU cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_job_learns_and_saves_what_it_says(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "train"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp_path / "stoker_output"
    results = json.loads((out / "results.json").read_text())
    assert results["before"]["eval_exact_match"] < 0.1  # the base has not learned the chat form
    assert results["after"]["eval_exact_match"] >= 0.9
    sample = results["sample"]
    assert sample["generated"] == sample["expected"] and sample["prompt"].endswith("\n")
    for line in (f"adapter: {Path('stoker_output')}", "merged model: stoker_output/merged",
                 "report: stoker_output/report.html", "sample: "):
        assert line in done.stdout, f"{line!r} not printed:\n{done.stdout}"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert b"<img" in (out / "report.html").read_bytes()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    tokenizer = AutoTokenizer.from_pretrained(out / "merged")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "54+68"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    answer = merged.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(answer[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True) == "122"
