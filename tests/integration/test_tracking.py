"""Experiment trackers (stoker.tracking) with the real packages, offline: MLflow on a sqlite store, W&B in offline
mode, Trackio's local store. One job runs through transformers.Trainer and through stoker.Trainer reporting to
all three at once; each tracker is read back and must hold the run's log_history, which must equal what it
holds for transformers' run. Then: a 2-process run logs once; report_to's names, 'all', 'none', kubeflow and
the refusals."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from stoker import ConfigError, Trainer, TrainingArguments
from stoker.tracking import INTEGRATIONS

ROOT = Path(__file__).resolve().parents[2]
TRACKERS = ["mlflow", "wandb", "trackio"]
# what both frameworks log (log_history keys) and the name each tracker gives it
KEYS = ("loss", "grad_norm", "learning_rate", "eval_loss", "epoch")
REWRITTEN = {"loss": "train/loss", "grad_norm": "train/grad_norm", "learning_rate": "train/learning_rate",
             "eval_loss": "eval/loss", "epoch": "train/epoch"}


def tracker_env(monkeypatch, where: Path) -> None:
    """Every tracker offline, writing under `where`."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{where / 'mlflow.db'}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(where))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(where / "trackio"))  # read when trackio is first imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WANDB_LOG_MODEL", raising=False)


def run_job(framework: str, out: str, **overrides):
    """The parity oracle's job (tests/parity/oracle.py), three steps of SGD on a linear schedule with an
    evaluation and a log every step, reporting to every tracker; returns the trainer after train and predict."""
    from stoker.data import PaddingCollator
    from tests.parity.families import FAMILIES, rows
    from tests.parity.oracle import EVAL_ROWS, TRAIN_ROWS, settings

    if framework == "hf":
        from transformers import Trainer as Framework
        from transformers import TrainingArguments as Arguments
    else:
        Framework, Arguments = Trainer, TrainingArguments
    values = settings(out, report_to=TRACKERS, run_name=framework, lr_scheduler_type="linear", num_train_epochs=3,
                      save_strategy="no", **overrides)
    trainer = Framework(FAMILIES["llama"](0), Arguments(**values), train_dataset=rows("llama", TRAIN_ROWS, 1),
                        eval_dataset=rows("llama", EVAL_ROWS, 2), data_collator=PaddingCollator())
    trainer.train()
    trainer.predict(rows("llama", EVAL_ROWS, 2))
    import trackio
    import wandb

    # the W&B callback leaves its run open, and Trackio's reopens its run for predict's metrics (transformers'
    # too): closed here, so that the next job starts runs of its own and nothing is left to flush at exit
    wandb.finish()
    trackio.finish()
    return trainer


def series(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    return sorted((r["step"], r[key]) for r in log_history if key in r)


# ---------------------------------------------------------------------------------------------------
# reading each tracker back


def mlflow_read(where: Path, experiment: str) -> tuple[dict, dict]:
    """(metric -> [(step, value)], params) of the one run in the experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{where / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run_id = runs[0].info.run_id
    metrics = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in KEYS}
    return metrics, runs[0].data.params


def wandb_records(where: Path, name: str) -> list:
    """The protobuf records of the offline run called `name`: the .wandb file is a LevelDB-style log (a 7-byte
    header, then 32 KiB blocks of checksum/length/type-framed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = []
    for path in sorted(where.glob("wandb/offline-run-*/*.wandb")):
        data, pos, pending, records = path.read_bytes(), 7, b"", []
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # full / first, else middle / last
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(pending)
                records.append(record)
        if any(r.WhichOneof("record_type") == "run" and r.run.display_name == name for r in records):
            found.append(records)
    assert len(found) == 1, f"{len(found)} offline runs named {name!r}"
    return found[0]


def wandb_read(where: Path, name: str) -> tuple[dict, dict]:
    records = wandb_records(where, name)
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config.update({i.key: json.loads(i.value_json) for i in items})
    metrics = {k: sorted((row["train/global_step"], row[REWRITTEN[k]]) for row in rows if REWRITTEN[k] in row)
               for k in KEYS}
    return metrics, config


def trackio_read(where: Path, name: str) -> tuple[dict, dict]:
    from trackio import sqlite_storage

    with pytest.MonkeyPatch.context() as mp:  # trackio fixes its folder when first imported
        mp.setattr(sqlite_storage, "TRACKIO_DIR", where / "trackio")
        rows = sqlite_storage.SQLiteStorage.get_logs("huggingface", name)
        config = sqlite_storage.SQLiteStorage.get_run_config("huggingface", name)
    metrics = {k: sorted((row["train/global_step"], row[REWRITTEN[k]]) for row in rows if REWRITTEN[k] in row)
               for k in KEYS}
    return metrics, config


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The job through each framework, every tracker reading what both sent: {framework: (trainer, where)}."""
    where = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        tracker_env(mp, where)
        out = {}
        for framework in ("hf", "stoker"):
            mp.setenv("MLFLOW_EXPERIMENT_NAME", framework)
            out[framework] = run_job(framework, str(where / framework))
        yield out, where


READERS = {"mlflow": mlflow_read, "wandb": wandb_read, "trackio": trackio_read}


@pytest.mark.parametrize("tracker", TRACKERS)
def test_tracker_holds_the_log_history_and_transformers_numbers(tracked, tracker):
    trainers, where = tracked
    ours, _ = READERS[tracker](where, "stoker")
    theirs, _ = READERS[tracker](where, "hf")
    history = trainers["stoker"].state.log_history
    for key in KEYS:
        assert ours[key] == series(history, key), key  # exactly what the run logged
        assert [s for s, _ in ours[key]] == [s for s, _ in theirs[key]], key
        assert [v for _, v in ours[key]] == pytest.approx([v for _, v in theirs[key]], rel=1e-5, abs=1e-7), key
    assert [s for s, _ in ours["loss"]] == [1, 2, 3] and [s for s, _ in ours["eval_loss"]] == [1, 2, 3]
    assert [v for _, v in ours["learning_rate"]] == pytest.approx([0.5, 1 / 3, 1 / 6])


@pytest.mark.parametrize("tracker", TRACKERS)
def test_tracker_holds_the_arguments_and_the_model_config(tracked, tracker):
    trainers, where = tracked
    _, params = READERS[tracker](where, "stoker")
    model = trainers["stoker"].model
    if tracker == "mlflow":  # MLflow keeps parameters as strings
        assert params["learning_rate"] == "0.5" and params["lr_scheduler_type"] == "linear"
        assert params["vocab_size"] == str(model.config.vocab_size) and params["output_dir"].endswith("stoker")
    else:
        assert params["learning_rate"] == 0.5 and params["lr_scheduler_type"] == "linear"
        assert params["vocab_size"] == model.config.vocab_size
        assert params["model/num_parameters"] == model.num_parameters()
    assert params["hub_token"] in (None, "None")  # a token is never logged (to_dict masks a set one)


def test_a_nan_loss_window_reaches_every_tracker_metrics_jsonl_and_the_report_and_the_run_resumes(tmp_path,
                                                                                                 monkeypatch):
    """Every step of the first logging window non-finite (skipped): its log's loss is NaN. MLflow, W&B, Trackio,
    TensorBoard, metrics.jsonl, the printed log and the HTML report take it without failing, the checkpoint
    that holds it in its log_history resumes, and the next window's finite loss reaches the trackers."""
    import math

    from tests.helpers.tiny_jobs import Scalar  # (w * x)^2, NaN where x is 999

    tracker_env(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "nan")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    data = [{"x": v} for v in (999.0, 999.0, 1.0, 1.0)]

    def job(max_steps: int):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[*TRACKERS, "tensorboard"],
                                 run_name="nan", max_steps=max_steps, logging_steps=2, save_steps=2,
                                 per_device_train_batch_size=1, optim="sgd", learning_rate=0.1,
                                 lr_scheduler_type="constant", train_sampling_strategy="sequential",
                                 max_grad_norm=0.0, disable_tqdm=True, training_report=True, use_cpu=True)
        return Trainer(Scalar(), args, train_dataset=data)

    import wandb

    first = job(2)
    first.train()
    assert math.isnan(first.state.log_history[0]["loss"])
    wandb.finish()  # Trackio's callback finishes its run at the end of training, W&B's leaves it open
    resumed = job(4)
    resumed.train(resume_from_checkpoint=True)
    wandb.finish()
    history = resumed.state.log_history
    assert math.isnan(history[0]["loss"]) and history[1]["loss"] == pytest.approx((1.0 + 0.8 ** 2) / 2)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert math.isnan(losses[0]) and losses[-1] == history[1]["loss"]
    assert (tmp_path / "out" / "report.html").stat().st_size > 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("nan").experiment_id])
    finite = {(m.step, m.value) for r in runs for m in client.get_metric_history(r.info.run_id, "loss")
              if math.isfinite(m.value)}
    assert finite == {(4, history[1]["loss"])}


TWO_PROCESSES = """
import os, sys
sys.path.insert(0, {root!r})
from stoker import Trainer, TrainingArguments
from stoker.data import PaddingCollator
from tests.parity.families import FAMILIES, rows

args = TrainingArguments(output_dir=sys.argv[1], report_to={trackers!r}, run_name="ddp", optim="sgd",
                         learning_rate=0.5, per_device_train_batch_size=4, num_train_epochs=2, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, use_cpu=True)
trainer = Trainer(FAMILIES["llama"](0), args, train_dataset=rows("llama", 8, 1), data_collator=PaddingCollator())
trainer.train()
if trainer.is_world_process_zero():
    import wandb
    wandb.finish()
"""


@pytest.mark.distributed
def test_a_two_process_run_logs_once(tmp_path, monkeypatch):
    tracker_env(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "ddp")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = tmp_path / "job.py"
    script.write_text(TWO_PROCESSES.format(root=str(ROOT), trackers=TRACKERS))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    for tracker in TRACKERS:  # one run each (the readers check), one point per step
        metrics, _ = READERS[tracker](tmp_path, "ddp")
        assert [s for s, _ in metrics["loss"]] == [1, 2], tracker


# ---------------------------------------------------------------------------------------------------
# report_to's names


def test_names_are_transformers_integrations():
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    assert set(INTEGRATIONS) == set(INTEGRATION_TO_CALLBACK)


def test_none_is_empty_and_all_is_every_installed_tracker(monkeypatch):
    from transformers.integrations import get_available_reporting_integrations

    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    assert TrainingArguments(report_to="none").report_to == TrainingArguments(report_to=None).report_to == []
    installed = get_available_reporting_integrations()
    assert {"mlflow", "wandb", "trackio", "tensorboard"} <= set(installed)
    assert TrainingArguments(report_to="all").report_to == TrainingArguments(report_to=["all"]).report_to == installed


def test_a_tracker_whose_package_is_missing_is_refused_with_the_pip_command():
    from importlib.util import find_spec

    assert find_spec("swanlab") is None and find_spec("clearml") is None  # not in the dev extra
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to=["swanlab", "mlflow", "clearml"])
    assert e.value.problems == [
        "report_to=['swanlab', 'mlflow', 'clearml']: 'swanlab' needs the swanlab package, which is not installed "
        "(pip install swanlab)",
        "report_to=['swanlab', 'mlflow', 'clearml']: 'clearml' needs the clearml package, which is not installed "
        "(pip install clearml)"]


def only_installed(monkeypatch, present: set[str]) -> None:
    """importlib.util.find_spec sees tensorboard and tensorboardX only where `present` names them."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name in ("tensorboard", "tensorboardX"):
            return real(name, *a, **kw) if name in present else None
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("present", [{"tensorboard", "tensorboardX"}, {"tensorboard"}, {"tensorboardX"}, set()])
def test_tensorboard_needs_tensorboard_or_tensorboardx_as_transformers(monkeypatch, present):
    """transformers' TensorBoardCallback writes with tensorboard's or tensorboardX's writer: either package is
    accepted, as transformers' is_tensorboard_available decides; neither is refused, naming both pip commands."""
    from transformers.integrations.integration_utils import is_tensorboard_available

    only_installed(monkeypatch, present)
    assert is_tensorboard_available() == bool(present)
    if present:
        assert TrainingArguments(report_to="tensorboard").report_to == ["tensorboard"]
        return
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to="tensorboard")
    assert e.value.problems == [
        "report_to=['tensorboard']: 'tensorboard' needs the tensorboard or the tensorboardX package, neither is "
        "installed (pip install tensorboard, or pip install tensorboardX)"]


def test_all_and_none_stand_alone_and_unknown_names_get_a_suggestion():
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to=["all", "mlfow"])
    assert e.value.problems[0] == "report_to=['all', 'mlfow']: 'all' stands alone (report_to='all'), not in a list " \
                                  "of trackers"
    assert e.value.problems[1].startswith("report_to=['all', 'mlfow']: unknown tracker 'mlfow' (did you mean "
                                          "'mlflow'?); accepted: none, all, azure_ml,")


def test_kubeflow_joins_inside_a_trainjob(monkeypatch, tmp_path):
    from transformers.integrations.integration_utils import KubeflowCallback

    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    with pytest.raises(ConfigError, match="'kubeflow' reports a TrainJob's status to KUBEFLOW_TRAINER_SERVER_URL"):
        TrainingArguments(report_to="kubeflow")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://127.0.0.1:9/status")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert args.report_to == ["kubeflow"]
    trainer = Trainer(torch_model(), args)
    assert sum(isinstance(cb, KubeflowCallback) for cb in trainer.callback_handler.callbacks) == 1
    monkeypatch.setenv("DISABLE_KUBEFLOW_INTEGRATION", "true")
    assert TrainingArguments(report_to="none").report_to == []


def test_wandb_log_model_is_refused(monkeypatch):
    for value in ("end", "checkpoint"):
        monkeypatch.setenv("WANDB_LOG_MODEL", value)
        with pytest.raises(ConfigError, match=rf"report_to=\['wandb'\] with WANDB_LOG_MODEL={value}: not supported"):
            TrainingArguments(report_to="wandb")
    monkeypatch.setenv("WANDB_LOG_MODEL", "false")
    assert TrainingArguments(report_to="wandb").report_to == ["wandb"]


def torch_model():
    import torch

    return torch.nn.Linear(2, 1)
