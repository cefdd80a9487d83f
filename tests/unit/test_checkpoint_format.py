"""stoker.checkpoint_format: nested state round-trips through JSON and safetensors, a committed folder verifies
and a changed one does not, and checkpoint folders are listed by step and rotated without the newest or the
best. (Whole runs' checkpoints, damage and resume: tests/integration/test_faults.py and test_trainer.py.)"""

from __future__ import annotations

import os

import numpy as np
import torch

from stoker import checkpoint_format as ckpt


def test_nested_state_round_trips_through_json_and_safetensors(tmp_path):
    state = {"step": torch.tensor(3.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.999), "dtype": torch.bfloat16}],
             "rng": np.arange(4, dtype=np.uint32), "by_id": {0: "a", 1: None}, "count": np.int64(7)}
    ckpt.save_state(str(tmp_path), "optimizer", state)
    assert sorted(os.listdir(tmp_path)) == ["optimizer.json", "optimizer.safetensors"]
    loaded = ckpt.load_state(str(tmp_path), "optimizer")
    assert torch.equal(loaded["step"], state["step"])
    assert loaded["groups"] == [{"lr": 0.1, "betas": (0.9, 0.999), "dtype": torch.bfloat16}]
    assert isinstance(loaded["rng"], np.ndarray) and (loaded["rng"] == state["rng"]).all()
    assert loaded["by_id"] == {0: "a", 1: None} and loaded["count"] == 7


def test_state_without_tensors_is_json_only(tmp_path):
    ckpt.save_state(str(tmp_path), "scheduler", {"last_epoch": 4, "base_lrs": [0.001]})
    assert os.listdir(tmp_path) == ["scheduler.json"]
    assert ckpt.load_state(str(tmp_path), "scheduler") == {"last_epoch": 4, "base_lrs": [0.001]}


def test_a_committed_checkpoint_verifies_until_a_file_changes(tmp_path):
    final = ckpt.checkpoint_dir(str(tmp_path), 5)
    tmp = ckpt.temp_dir_for(final)
    os.makedirs(tmp)
    ckpt.write_json(tmp, "trainer_state.json", {"global_step": 5})
    assert ckpt.stale_temp_dirs(str(tmp_path)) == [tmp]  # not committed yet
    ckpt.commit(tmp, final, 5)
    assert not os.path.exists(tmp) and ckpt.stale_temp_dirs(str(tmp_path)) == []
    assert ckpt.verify(final) is None and ckpt.read_json(final, ckpt.MANIFEST)["global_step"] == 5
    ckpt.write_json(final, "trainer_state.json", {"global_step": 6})  # same size, other bytes
    assert ckpt.verify(final, hashes=False) is None
    assert ckpt.verify(final) == "trainer_state.json does not match its sha256 in the manifest"
    assert ckpt.recognise(str(tmp_path)).startswith("no manifest.json")


def test_checkpoints_are_listed_by_step_and_rotated_without_the_newest_or_the_best(tmp_path):
    for step in (10, 2, 30, 4):
        os.makedirs(ckpt.checkpoint_dir(str(tmp_path), step))
    os.makedirs(tmp_path / "checkpoint-x")
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint")
    listed = ckpt.list_checkpoints(str(tmp_path))
    assert [ckpt.checkpoint_step(p) for p in listed] == [2, 4, 10, 30]
    assert ckpt.checkpoint_step(str(tmp_path / "checkpoint-12") + os.sep) == 12
    assert ckpt.checkpoint_step("checkpoint-last") is None
    deleted = ckpt.rotate(str(tmp_path), limit=2, keep=ckpt.checkpoint_dir(str(tmp_path), 2))
    assert [ckpt.checkpoint_step(p) for p in deleted] == [4, 10]
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(str(tmp_path))] == [2, 30]
    # the best and the newest both stay, even above the limit
    assert ckpt.rotate(str(tmp_path), limit=1, keep=ckpt.checkpoint_dir(str(tmp_path), 2)) == []
    assert ckpt.rotate(str(tmp_path), limit=None) == [] and ckpt.rotate(str(tmp_path), limit=1) == [
        ckpt.checkpoint_dir(str(tmp_path), 2)]
