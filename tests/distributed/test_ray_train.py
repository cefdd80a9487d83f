"""Ray Train with a real local Ray: TorchTrainer with ScalingConfig(num_workers=2, use_gpu=False) runs a stoker
Trainer as Ray documents it for transformers.Trainer (RayTrainReportCallback, prepare_trainer), one DDP group of
two CPU workers; Ray receives every checkpoint, and after a lost worker the job resumes from the one Ray holds
and ends as a run that was never stopped."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.ray_worker import ROWS, SETTINGS, train_func  # Ray's workers import it by this name

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_ray_train_fits_reports_checkpoints_and_resumes_after_a_lost_worker(local_ray, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stoker import Trainer, TrainingArguments
    from stoker.data import PaddingCollator
    from tests.parity.families import FAMILIES, rows

    # the reference: one process, the same global batch, never stopped
    args = TrainingArguments(output_dir=str(tmp_path / "one"), per_device_train_batch_size=ROWS, **SETTINGS)
    one = Trainer(FAMILIES["llama"](0), args, train_dataset=rows("llama", ROWS, 1), eval_dataset=rows("llama", 6, 2),
                  data_collator=PaddingCollator())
    one.train()
    expected = {(r["step"], k): r[k] for r in one.state.log_history for k in ("loss", "eval_loss") if k in r}

    out = tmp_path / "ray_out"
    result = TorchTrainer(train_func, train_loop_config={"out": str(out), "fail_after": 2},
                          scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                          run_config=RunConfig(name="job", storage_path=str(tmp_path / "ray"),
                                               failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "failed.0", "failed.1", "metrics.jsonl"]
    # the second attempt resumed from the step-2 checkpoint Ray held: steps 1 and 2 ran once
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 2, 3, 4, 4, 4]
    assert result.metrics["step"] == 4 and result.metrics["eval_loss"] == pytest.approx(expected[(4, "eval_loss")])
    with result.checkpoint.as_directory() as folder:  # Ray's checkpoint is stoker's checkpoint-4
        assert sorted(os.listdir(folder)) == ["checkpoint"]
        with open(os.path.join(folder, "checkpoint", "trainer_state.json")) as f:
            state = json.load(f)
    got = {(r["step"], k): r[k] for r in state["log_history"] for k in ("loss", "eval_loss") if k in r}
    assert state["global_step"] == 4 and sorted(got) == sorted(expected)
    assert [got[k] for k in sorted(got)] == pytest.approx([expected[k] for k in sorted(expected)], rel=1e-5)
