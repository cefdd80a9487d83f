"""Bad input through the real commands: each case runs `stoker train|plan|merge|consolidate` in a subprocess and
must exit with code 2 before any work, printing one message (one line per problem) that names the flag or file
(and line, for data files), the value and what is accepted; no traceback; its folder left exactly as it was.

The cases run concurrently (each is a fresh interpreter that only parses and checks); a case that started to
train would show as a timeout, an exit code 0, or a changed folder.
"""

from __future__ import annotations

import builtins
import http.server
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STOKER = str(Path(sys.executable).parent / "stoker")

LLAMA_CONFIG = json.dumps({"model_type": "llama", "hidden_size": 8})
OFFLINE = {"HF_HUB_OFFLINE": "1"}
UNREACHABLE = {"HF_ENDPOINT": "{closed_endpoint}"}  # a port nothing listens on: connection refused
FAKE_HUB = {"HF_ENDPOINT": "{fake_hub}"}  # answers every repository lookup with the hub's 'not found'


# name: (argv, files to create in the case's folder, environment, the problems the message lists: for each,
# the substrings its line holds). The cases put several bad inputs in one command where they can be found
# together, which is also what the commands must do: name every problem at once.
CASES = {
    # --- config files and flags
    "yaml syntax error": (
        ["train", "c.yaml"], {"c.yaml": "learning_rate: 1e-4\nlabel_names: [a, b\nseed: 3\n"}, {},
        [("config file 'c.yaml' line 3, column 5", "not valid YAML")]),
    "yaml with two bad values": (
        ["train", "c.yaml"], {"c.yaml": "output_dir: {out}\nlearning_rate: fast\nper_device_train_batch_size: -3\n"},
        {}, [("c.yaml: learning_rate='fast': must be a number",),
             ("c.yaml: per_device_train_batch_size=-3: must be a positive integer",)]),
    "yaml unknown key, a list for one value, a bad bool; flags of the wrong type, unknown, misspelt": (
        ["train", "c.yaml", "--num_train_epochs", "x", "--seed", "1.5", "--learning_rte", "1e-4", "--recipe", "clmm",
         "--optim", "adamw_torh"],
        {"c.yaml": "output_dir: {out}\nlearning_rat: 1e-4\nmax_steps: [1, 2]\nbf16: maybe\nwarmup_ratio: 2\n"}, {},
        [("c.yaml: learning_rat: unknown field (did you mean 'learning_rate'?)",),
         ("c.yaml: max_steps=[1, 2]: must be a single value, not a list",),
         ("c.yaml: bf16='maybe': must be true or false",),
         ("--num_train_epochs='x': must be a number",),
         ("--seed='1.5': must be a whole number",),
         ("--learning_rte: unknown flag (did you mean 'learning_rate'?)",),
         ("--recipe='clmm': accepted: clm, sft, classification",),
         ("--optim='adamw_torh': unknown optimizer (did you mean 'adamw_torch'?)", "accepted: adamw_torch,"),
         ("c.yaml: warmup_ratio=2.0: must be in [0, 1)",)]),
    "json syntax error, a flag without its value": (
        ["train", "c.json", "--output_dir", "{out}", "--learning_rate"], {"c.json": '{\n  "learning_rate": 1e-4,\n}\n'},
        {}, [("config file 'c.json' line 3, column 1", "not valid JSON"), ("--learning_rate: expected one argument",)]),
    "output_dir that cannot be created": (
        ["train", "--output_dir", "/proc/stoker-test/run"], {}, {},
        [("--output_dir='/proc/stoker-test/run': cannot create folders under /proc", "accepted: a folder")]),
    "config file that is a list": (
        ["train", "c.yaml"], {"c.yaml": "- learning_rate\n- 1e-4\n"}, {},
        [("config file 'c.yaml'", "must hold a mapping of field: value, got list")]),
    "missing config file, output_dir that is a file": (
        ["train", "nope.yaml", "--output_dir", "run.txt"], {"run.txt": "a file\n"}, {},
        [("config file 'nope.yaml': no such file", "accepted: a .yaml/.yml/.json file"),
         ("--output_dir='run.txt': is a file; accepted: a folder",)]),
    # --- models, data files, checkpoints
    "model path that does not exist": (
        ["train", "--output_dir", "{out}", "--model_name_or_path", "/nonexistent"], {}, {},
        [("--model_name_or_path='/nonexistent': no such folder", "accepted: a local model folder")]),
    "jsonl with a broken line": (
        ["train", "--recipe", "clm", "--output_dir", "{out}", "--train_file", "train.jsonl"],
        {"train.jsonl": '{"text": "one"}\n{"text": "two"}\n{"text": "three"\n{"text": "four"}\n'}, {},
        [("--train_file='train.jsonl': line 3, column 17: not valid JSON",)]),
    "resume from a folder that is no checkpoint": (
        ["train", "--output_dir", "{out}", "--resume_from_checkpoint", "home"],
        {"home/project/model.pt": pickle.dumps({"a": 1}), "home/notes.txt": "x"}, {},
        [("--resume_from_checkpoint='home': no manifest.json, so not a stoker checkpoint", "accepted: an "
          "output_dir/checkpoint-<step> folder")]),
    "model folder without config.json, empty jsonl, output_dir with checkpoints": (
        ["train", "--recipe", "clm", "--output_dir", "{out}", "--model_name_or_path", "model", "--train_file",
         "held.jsonl"], {"model/weights.bin": "x", "out/checkpoint-4/manifest.json": "{}", "held.jsonl": ""}, {},
        [("--model_name_or_path='model': the folder has no config.json",),
         ("--train_file='held.jsonl': has no rows",),
         ("output_dir=", "already holds 1 checkpoint(s) (newest checkpoint-4)", "overwrite_output_dir")]),
    "model type without a causal-LM head, text not UTF-8": (
        ["train", "--recipe", "clm", "--output_dir", "{out}", "--model_name_or_path", "model", "--train_file",
         "t.txt"], {"model/config.json": json.dumps({"model_type": "vit"}), "t.txt": b"fine\n\xff\xfe not text\n"},
        {}, [("--model_name_or_path='model': transformers has no causal-lm head for model_type 'vit'", "e.g. llama"),
             ("--train_file='t.txt': line 2: not UTF-8 text (byte 0xff)",)]),
    "model without a tokenizer, rows without the columns, missing file, another program's manifest": (
        ["train", "--recipe", "classification", "--output_dir", "{out}", "--model_name_or_path", "model",
         "--train_file", "t.jsonl", "--validation_file", "v.jsonl", "--resume_from_checkpoint", "ckpt"],
        {"model/config.json": LLAMA_CONFIG, "t.jsonl": '{"body": "x", "id": 1}\n',
         "ckpt/manifest.json": '{"name": "web app", "version": 3}'}, {},
        [("--model_name_or_path='model': the folder has no tokenizer",),
         ("--train_file='t.jsonl': rows need 'text'+'label'; found columns ['body', 'id']",),
         ("--validation_file='v.jsonl': no such file",),
         ("--resume_from_checkpoint='ckpt': manifest.json is not a stoker checkpoint manifest",)]),
    "broken config.json, rows with values of the wrong kind, json array with a syntax error": (
        ["train", "--recipe", "sft", "--output_dir", "{out}", "--model_name_or_path", "model", "--train_file",
         "chat.jsonl", "--validation_file", "held.json"],
        {"model/config.json": "{model_type", "held.json": '[\n  {"text": "one"},\n  {"text": "two"},,\n]\n',
         "chat.jsonl": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                       + json.dumps({"messages": "hi"}) + "\n"}, {},
        [("--model_name_or_path='model': config.json is not valid JSON",),
         ("--train_file='chat.jsonl': line 2: 'messages' must end with an assistant message",
          "line 3: 'messages' must be a list of"),
         ("--validation_file='held.json': line 3, column 19: not valid JSON",)]),
    "neither a path nor a hub id, a data file of another format, a missing one": (
        ["train", "--output_dir", "{out}", "--model_name_or_path", "bad id!", "--train_file", "t.csv",
         "--validation_file", "v.jsonl"], {"t.csv": "text\na\n"}, {},
        [("--model_name_or_path='bad id!': no such local folder, and not a valid hub id",),
         ("--train_file='t.csv': accepted formats are .txt, .json, .jsonl",),
         ("--validation_file='v.jsonl': no such file", "accepted: a .txt/.json/.jsonl file")]),
    "a data file as dataset_name": (
        ["train", "--output_dir", "{out}", "--dataset_name", "rows.jsonl"], {"rows.jsonl": '{"text": "a"}\n'}, {},
        [("--dataset_name='rows.jsonl': is a file: give data files as train_file", "accepted: a generated task")]),
    # --- the hub: offline, unreachable, or not knowing the id
    "hub model and dataset with HF_HUB_OFFLINE": (
        ["train", "--output_dir", "{out}", "--model_name_or_path", "org/model", "--dataset_name", "org/data"], {},
        OFFLINE, [("--model_name_or_path='org/model': no such local folder, not in the local hub cache, and "
                   "HF_HUB_OFFLINE=1 forbids downloading it",),
                  ("--dataset_name='org/data'", "HF_HUB_OFFLINE=1 forbids downloading it")]),
    "hub model with the hub unreachable": (
        ["train", "--output_dir", "{out}", "--model_name_or_path", "org/model"], {}, UNREACHABLE,
        [("--model_name_or_path='org/model': not a local folder, not in the local cache, and the hub",
          "is unreachable (ConnectError")]),
    "dataset with the hub unreachable": (
        ["train", "--output_dir", "{out}", "--dataset_name", "imdb"], {}, UNREACHABLE,
        [("--dataset_name='imdb': not a local folder, not in the local cache, and the hub", "is unreachable")]),
    "hub ids the hub does not know": (
        ["train", "--output_dir", "{out}", "--model_name_or_path", "org/no-such-model", "--dataset_name", "additon"],
        {}, FAKE_HUB, [("--model_name_or_path='org/no-such-model': no such model on the hub", "no such local folder"),
                       ("--dataset_name='additon': no such dataset on the hub", "(did you mean 'addition'?)")]),
    # --- the other commands
    "plan: a yaml syntax error, its own flags, the model": (
        ["plan", "c.yaml", "--budget_gb", "-1", "--world_size", "two", "--model_name_or_path", "/nonexistent"],
        {"c.yaml": "per_device_train_batch_size: 4\n  seed: 3\n"}, {},
        [("--budget_gb='-1': must be a positive number",), ("--world_size='two': must be a positive whole number",),
         ("config file 'c.yaml' line 2", "not valid YAML"),
         ("--model_name_or_path='/nonexistent': no such folder",)]),
    "merge: every input wrong": (
        ["merge", "--base", "/nonexistent", "--adapter", "adapter", "--out", "/proc/stoker-test/merged", "--dtype",
         "f16"], {"adapter/adapter_config.json": "{peft"}, {},
        [("--dtype='f16': accepted: float32, bfloat16, float16 (did you mean 'float16'?)",),
         ("--base='/nonexistent': no such folder",), ("--adapter='adapter': adapter_config.json is not valid JSON",),
         ("--out='/proc/stoker-test/merged': cannot create folders under /proc",)]),
    "merge: required flags missing": (
        ["merge", "--base", "base"], {}, {}, [("the following arguments are required: --adapter, --out",)]),
    "consolidate: a folder that is no checkpoint, an output that cannot be created": (
        ["consolidate", "home", "--out", "/proc/stoker-test/model"], {"home/a/b/c.pkl": pickle.dumps([1])}, {},
        [("checkpoint='home': no manifest.json, so not a stoker checkpoint",),
         ("--out='/proc/stoker-test/model': cannot create folders under /proc",)]),
}


@pytest.fixture(scope="module")
def fake_hub():
    """An HTTP server answering as the hub does for a repository it does not have."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "Repository not found"}')

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder` with its size and modification time."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.stat()
        out[str(path.relative_to(folder))] = (st.st_size if path.is_file() else -1, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, fake_hub):
    """Each case run in its own folder, all at once; {name: (completed process, folder, snapshot before)}."""
    root = tmp_path_factory.mktemp("bad_input")
    placeholders = {"closed_endpoint": f"http://127.0.0.1:{_closed_port()}", "fake_hub": fake_hub}
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")}
    base_env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(root / "hf_home"))  # an empty cache

    def prepare(i: int, name: str):
        argv, files, env, _ = CASES[name]
        folder = root / f"case{i}"
        (folder / "out").mkdir(parents=True)
        (folder / "out" / "keep.txt").write_text("the output folder is left as it was\n")
        fill = {**placeholders, "out": str(folder / "out")}
        for rel, content in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                (folder / rel).write_bytes(content)
            else:
                (folder / rel).write_text(content.replace("{out}", fill["out"]))
        command = [STOKER] + [a.format(**fill) for a in argv]
        return folder, command, {**base_env, **{k: v.format(**fill) for k, v in env.items()}}

    prepared = {name: prepare(i, name) for i, name in enumerate(CASES)}
    before = {name: _snapshot(folder) for name, (folder, _, _) in prepared.items()}

    def run(name):
        folder, command, env = prepared[name]
        return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        done = dict(zip(CASES, pool.map(run, CASES), strict=True))
    return {name: (done[name], prepared[name][0], before[name]) for name in CASES}


def test_there_are_enough_bad_inputs():
    assert sum(len(problems) for *_, problems in CASES.values()) >= 25
    assert {argv[0] for argv, *_ in CASES.values()} == {"train", "plan", "merge", "consolidate"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_message_before_any_work(results, name):
    proc, folder, before = results[name]
    problems = CASES[name][-1]
    err = proc.stderr
    assert proc.returncode == 2, f"exit code {proc.returncode}\n{err}"
    assert "Traceback" not in err and proc.stdout == "", err + proc.stdout  # nothing ran far enough to print
    lines = err.rstrip("\n").split("\n")
    if len(problems) == 1:
        assert len(lines) == 1 and lines[0].startswith("stoker: "), err
    else:
        assert lines[0] == f"stoker: {len(problems)} problems:", err
        assert len(lines) == len(problems) + 1 and all(line.startswith("  - ") for line in lines[1:]), err
    for expected in problems:
        assert any(all(text in line for text in expected) for line in lines), f"{expected} not in one line of:\n{err}"
    assert _snapshot(folder) == before, "the command wrote into its folder"


def test_a_folder_that_is_no_checkpoint_is_refused_without_reading_it(tmp_path, monkeypatch):
    """Only the manifest's path is looked at: no walk, no listing, no file opened."""
    from stoker import checkpoint_format as ckpt

    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / "project" / "weights.pt").write_bytes(pickle.dumps({"w": 1}))
    opened, real_open = [], builtins.open

    def forbidden(*args, **kwargs):
        raise AssertionError("the folder was walked or listed")

    monkeypatch.setattr(os, "walk", forbidden)
    monkeypatch.setattr(os, "listdir", forbidden)
    monkeypatch.setattr(os, "scandir", forbidden)
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    problem = ckpt.verify(str(home))
    assert problem.startswith("no manifest.json, so not a stoker checkpoint")
    assert "weights.pt" not in problem and opened == []


def test_a_real_checkpoint_with_a_planted_pickle_is_still_refused(tmp_path):
    """The manifest comes first, but inside a checkpoint every file is still looked at, listed or not."""
    from stoker import checkpoint_format as ckpt

    tmp = tmp_path / ".tmp-checkpoint-1"
    tmp.mkdir()
    ckpt.save_state(str(tmp), "trainer_state", {"global_step": 1})
    ckpt.commit(str(tmp), str(tmp_path / "checkpoint-1"), 1)
    folder = tmp_path / "checkpoint-1"
    assert ckpt.verify(str(folder)) is None
    (folder / "extra").mkdir()
    (folder / "extra" / "rng.pt").write_bytes(pickle.dumps([1, 2]))
    assert re.match(r"extra/rng\.pt is a pickle", ckpt.verify(str(folder), hashes=False))


def test_type_errors_leave_the_other_fields_checked_and_name_their_origin(tmp_path):
    from stoker import ConfigError, TrainingArguments
    from stoker.arguments import parse_config

    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: fast\nmax_steps: 0\nseed: 3\n")
    with pytest.raises(ConfigError) as info:
        parse_config((TrainingArguments,), [str(config), "--per_device_train_batch_size", "x", "--warmup_ratio", "2"])
    assert info.value.problems == [
        f"{config}: learning_rate='fast': must be a number (e.g. 3e-4)",
        "--per_device_train_batch_size='x': must be a whole number",
        f"{config}: max_steps=0: must be > 0, or -1 to train for num_train_epochs",
        "--warmup_ratio=2.0: must be in [0, 1)",
    ]
    # the file is reported even where a flag overrides its value: the same file without the flag would fail
    with pytest.raises(ConfigError) as info:
        parse_config((TrainingArguments,), [str(config), "--learning_rate", "1e-3", "--max_steps", "5"])
    assert info.value.problems == [f"{config}: learning_rate='fast': must be a number (e.g. 3e-4)"]


def test_what_the_checks_miss_is_still_named_as_bad_input(tmp_path, monkeypatch):
    """A loader failure the early checks did not foresee names the file and the reader's own reason."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    from stoker import ConfigError
    from stoker.recipes import DataArguments, load_rows

    def failing(*args, **kwargs):
        try:
            raise ValueError("Column changed from object to number in row 7")
        except ValueError as e:
            raise DatasetGenerationError("An error occurred while generating the dataset") from e

    monkeypatch.setattr(datasets, "load_dataset", failing)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError) as info:
        load_rows(DataArguments(train_file=str(rows)))
    assert info.value.problems == [f"train_file={str(rows)!r}: datasets cannot load it (ValueError: Column changed "
                                   "from object to number in row 7)"]


def test_models_and_datasets_in_the_local_cache_need_no_hub(tmp_path, monkeypatch):
    """Offline, a cached hub model is checked from its cached files (config, tokenizer, head) and a cached dataset
    is accepted; only what is not cached is refused, naming HF_HUB_OFFLINE."""
    from huggingface_hub import constants

    from stoker.preflight import dataset_source_problem, model_source_problem

    def cache_model(repo_id: str, files: dict[str, str]):
        repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("abc123")
        for name, text in files.items():
            (repo / "snapshots" / "abc123").mkdir(parents=True, exist_ok=True)
            (repo / "snapshots" / "abc123" / name).write_text(text)

    cache_model("org/llama", {"config.json": LLAMA_CONFIG, "tokenizer.json": "{}"})
    cache_model("org/vit", {"config.json": json.dumps({"model_type": "vit"}), "tokenizer.json": "{}"})
    (tmp_path / "datasets" / "org___data").mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    assert model_source_problem("model_name_or_path", "org/llama", "causal_lm", tokenizer=True) is None
    assert "has no causal-lm head for model_type 'vit'" in model_source_problem("m", "org/vit", "causal_lm")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in model_source_problem("m", "org/other")
    assert dataset_source_problem("dataset_name", "org/data", ("addition",)) is None
    assert "HF_HUB_OFFLINE=1 forbids" in dataset_source_problem("dataset_name", "org/other", ("addition",))


@pytest.mark.parametrize("name, text, expected", [
    ("a.jsonl", '{"text": "a"\n{"text": "b"}\n', "line 1, column 13: not valid JSON"),
    ("a.jsonl", '{"text": "a"}\n\n{"text": "b"}\n', [("line 1", {"text": "a"}), ("line 3", {"text": "b"})]),
    ("a.json", '[{"text": "a"}, {"text": "b"}]', [("row 1", {"text": "a"}), ("row 2", {"text": "b"})]),
    ("a.json", '{"text": "a"}\n{"text": "b"\n', "line 2, column 13: not valid JSON"),
    ("a.json", '[\n  {"text": "a"},\n  {"text": "b"},,\n]\n', "line 3, column 17: not valid JSON"),
])
def test_data_rows_are_read_as_datasets_reads_them_and_errors_name_the_line(tmp_path, name, text, expected):
    from stoker.preflight import read_rows

    (tmp_path / name).write_text(text)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            read_rows(str(tmp_path / name))
    else:
        assert read_rows(str(tmp_path / name)) == expected


def test_every_problem_of_a_run_is_refused_in_one_error_before_any_work(tmp_path, tiny_llama, clm_rows, make_args):
    """What shows only when train() starts (Liger's GPU kernels on the CPU, a shuffle a resume could not read again,
    a spike rollback over a loader without an index sampler) is named in one ConfigError, all of it, before the
    run's first work: no step taken, no output folder made."""
    from stoker import ConfigError, Trainer

    class OwnLoader(Trainer):
        def get_train_dataloader(self):  # batches of its own making: no index sampler to skip rows with
            return [self.data_collator(clm_rows(4)) for _ in range(4)]

    out = tmp_path / "never"
    trainer = OwnLoader(tiny_llama(), make_args(output_dir=str(out), max_steps=2, use_liger_kernel=True,
                                                spike_rollback=True,
                                                accelerator_config={"use_seedable_sampler": False}),
                        train_dataset=clm_rows(16))
    with pytest.raises(ConfigError) as refused:
        trainer.train()
    named = [problem.split(":")[0] for problem in refused.value.problems]
    assert {"use_liger_kernel=True", "spike_rollback=True",
            "accelerator_config.use_seedable_sampler=False"} <= set(named), named
    assert trainer.state.global_step == 0 and not out.exists()
