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


def test_state_files_are_safetensors_save_files_bytes_and_hashed_as_they_are_written(tmp_path):
    """save_state writes its tensors itself (hashing them on the way, for the manifest): the file is the one
    safetensors' save_file writes, byte for byte, and the hash is the file's; a paced write reports every byte."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"b.weight": torch.randn(300, 70), "a": torch.arange(5), "z": torch.randn(9).to(torch.bfloat16),
               "step": torch.tensor(3.0), "empty": torch.zeros(0),
               "rng": torch.randint(0, 255, (13,), dtype=torch.uint8),
               "big": torch.randn(3 * 2**20 + 7)}  # more than one chunk of the writer
    state = {"t": tensors, "n": 1}
    save_file(ckpt.flatten(state)[1], str(tmp_path / "reference.safetensors"))
    reported = []
    hashes = ckpt.save_state(str(tmp_path), "state", state, pace=reported.append)
    assert (tmp_path / "state.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert hashes == {name: ckpt._sha256(str(tmp_path / name)) for name in ("state.safetensors", "state.json")}
    assert sum(reported) == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = ckpt.load_state(str(tmp_path), "state")
    assert loaded["n"] == 1 and all(torch.equal(loaded["t"][k], v) for k, v in tensors.items())
    # the manifest takes the hashes as given and reads back only the files it has none for
    (tmp_path / "tmp").mkdir()
    for name in ("state.safetensors", "state.json", "reference.safetensors"):
        os.rename(tmp_path / name, tmp_path / "tmp" / name)
    ckpt.commit(str(tmp_path / "tmp"), str(tmp_path / "checkpoint-1"), 1, hashes)
    assert ckpt.verify(str(tmp_path / "checkpoint-1")) is None


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


def test_a_safetensors_file_whose_header_length_starts_like_a_pickle_is_not_taken_for_one(tmp_path):
    """896 = 0x0380: the file's first two bytes are 0x80 0x03, a pickle's protocol-3 opening; the JSON header after
    the length says what it is. A pickle is still recognised."""
    import pickle
    import struct

    from safetensors.torch import load_file

    from stoker.checkpoint_format import _looks_pickled

    header = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    header += b" " * (896 - len(header))
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 896) + header + struct.pack("<f", 1.5))
    assert load_file(tmp_path / "a.safetensors")["t"].item() == 1.5
    assert not _looks_pickled(tmp_path / "a.safetensors")
    (tmp_path / "b.pt").write_bytes(pickle.dumps({"t": 1}, protocol=3))
    assert _looks_pickled(tmp_path / "b.pt")
