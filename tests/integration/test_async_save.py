"""async_save: checkpoints written in the background hold bit for bit what a synchronous save at the same step
holds, while the loop trains on; one is in flight at a time; a failed background write is raised in the loop.

Each background write is held until the loop has taken its next optimizer step (Gate), so that training really
moves on while it runs: a snapshot that shared memory with the live parameters or optimizer state would then be
written with later values."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stoker import Trainer, TrainerCallback, TrainingArguments, background_save
from stoker import checkpoint_format as ckpt
from stoker.errors import CheckpointError
from tests.helpers.tiny_jobs import rows


class Gate:
    """Holds each background write until the loop has applied the next optimizer step (its next poll), so that
    the parameters and the optimizer state have moved on when the checkpoint is written; then sleeps `delay`
    seconds more (a write slower than a step)."""

    def __init__(self, monkeypatch):
        self.delay, self.moved_on = 0.0, threading.Event()
        start, poll = background_save.BackgroundWriter.start, background_save.BackgroundWriter.poll
        gate = self

        def gated_start(writer, job, write):
            gate.moved_on.clear()

            def held():
                gate.moved_on.wait(timeout=60)
                time.sleep(gate.delay)
                write()

            start(writer, job, held)

        def counted_poll(writer, wait=False):
            gate.moved_on.set()  # a poll comes after the step that follows a save (or at the end, waiting)
            poll(writer, wait)

        monkeypatch.setattr(background_save.BackgroundWriter, "start", gated_start)
        monkeypatch.setattr(background_save.BackgroundWriter, "poll", counted_poll)


@pytest.fixture
def slow_writes(monkeypatch) -> Gate:
    return Gate(monkeypatch)


def tied_llama() -> LlamaForCausalLM:
    """The tiny Llama with its output layer tied to the embeddings (one tensor under two names)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def args_for(out: Path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, logging_steps=1, save_strategy="steps",
                save_steps=2, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, optim="adamw_torch",
                seed=3)
    return TrainingArguments(**{**base, **kw})


class CommittedAt(TrainerCallback):
    """Which checkpoints were committed when each step ended."""

    def __init__(self, out: Path):
        self.out, self.seen = out, {}

    def on_step_end(self, args, state, control, **kw):
        self.seen[state.global_step] = [os.path.basename(p) for p in ckpt.list_checkpoints(str(self.out))]


def committed_at(trainer) -> dict:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, CommittedAt)).seen


def train(out: Path, peft: bool, **kw) -> Trainer:
    trainer = Trainer(tied_llama(), args_for(out, **kw), train_dataset=rows(16, seed=4),
                      peft_config=lora_config() if peft else None, callbacks=[CommittedAt(out)])
    trainer.train()
    return trainer


def tensors_of(path: Path) -> tuple[dict, dict]:
    """A safetensors file's metadata and tensors (dtype, shape, bytes): torch.distributed.checkpoint writes the
    metadata of its shard files in an order that differs between processes."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        return f.metadata(), {k: (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
                              for k, t in tensors.items()}


def contents(folder: Path) -> dict[str, object]:
    """Every file of a checkpoint, as bytes (safetensors files as their metadata and tensors' bytes); the JSON
    files that name the run (its id, output_dir, async_save) without those entries; the manifest, which hashes
    them, left out."""
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_dir() or rel == ckpt.MANIFEST:
            continue
        if rel in ("training_args.json", "loop_state.json"):
            found[rel] = {k: v for k, v in json.loads(path.read_text()).items()
                          if k not in ("run_id", "output_dir", "logging_dir", "run_name", "async_save")}
        elif rel == "trainer_state.json":
            found[rel] = path.read_text().replace(str(folder.parent), "OUT")
        elif rel.endswith(".safetensors"):
            found[rel] = tensors_of(path)
        else:
            found[rel] = path.read_bytes()
    return found


@pytest.mark.parametrize("peft, only_model", [(False, False), (True, False), (False, True)],
                         ids=["tied-llama", "lora", "save-only-model"])
def test_an_async_checkpoint_holds_what_a_sync_one_holds_bit_for_bit(tmp_path, slow_writes, caplog, peft,
                                                                    only_model):
    sync = train(tmp_path / "sync", peft, save_only_model=only_model)
    with caplog.at_level(logging.INFO, logger="stoker"):
        background = train(tmp_path / "async", peft, async_save=True, save_only_model=only_model)
    for step in (2, 4):
        name = f"checkpoint-{step}"
        assert ckpt.verify(str(tmp_path / "async" / name)) is None
        assert contents(tmp_path / "async" / name) == contents(tmp_path / "sync" / name), name
    # the loop trained on while checkpoint-2 was written; the run ended once checkpoint-4 was committed
    assert committed_at(background)[3] == []
    assert committed_at(sync)[3] == ["checkpoint-2"]
    assert any("async_save: up to" in r.message and "of host memory for one checkpoint in flight" in r.message
               for r in caplog.records)
    for a, b in zip(sync.model.parameters(), background.model.parameters(), strict=True):
        assert torch.equal(a, b)


class SnapshotBytes(TrainerCallback):
    """At each save: the bytes the snapshot copied and the bytes of host buffers it had to allocate."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def on_save(self, args, state, control, **kw):
        copies = self.trainer._checkpoint_writer.copies
        self.seen.append((copies.copied, copies.allocated))


@pytest.mark.parametrize("peft, only_model", [(False, False), (True, False), (False, True)],
                         ids=["tied-llama", "lora", "save-only-model"])
def test_the_first_snapshot_copies_into_host_buffers_reserved_after_the_first_step(tmp_path, peft, only_model):
    spy = SnapshotBytes()
    trainer = Trainer(tied_llama(), args_for(tmp_path, async_save=True, save_only_model=only_model, max_steps=6),
                      train_dataset=rows(16, seed=4), peft_config=lora_config() if peft else None, callbacks=[spy])
    spy.trainer = trainer
    trainer.train()
    (first_copied, first_allocated), *later = spy.seen
    assert len(later) == 2
    # the reserved buffers hold the model (or adapter) and the optimizer state; only the few small tensors of
    # the RNG states are allocated by the first snapshot, and nothing by the later ones
    assert first_allocated <= 8 * 2**10 < first_copied, spy.seen
    assert all(copied == first_copied and allocated == 0 for copied, allocated in later), spy.seen


def test_a_paced_write_sleeps_while_ahead_until_hurried():
    pace = background_save.Pace(nbytes=10, interval=2 / background_save.COMPLETION_TARGET)  # 5 bytes a second
    started = time.perf_counter()
    pace(5)  # a second's worth of bytes
    assert time.perf_counter() - started >= 0.9
    pace = background_save.Pace(nbytes=10, interval=200 / background_save.COMPLETION_TARGET)
    threading.Timer(0.2, pace.hurry).start()
    started = time.perf_counter()
    pace(10)  # 200 s's worth, cut short by hurry
    pace(10)
    assert time.perf_counter() - started < 30


def test_a_write_is_spread_over_half_the_save_interval_and_at_most_a_minute():
    """Saves an hour apart: the checkpoint is still committed within MAX_SPREAD_S of its step, since until then a
    crash loses it."""
    gib = 2**30
    assert background_save.Pace(nbytes=gib, interval=20.0).rate == gib / 10.0
    assert background_save.Pace(nbytes=gib, interval=3600.0).rate == gib / 60.0
    assert background_save.Pace(nbytes=gib, interval=0.0).rate == math.inf  # the first save: no interval yet


def test_whoever_waits_for_a_paced_write_gets_it_at_full_speed(tmp_path, monkeypatch):
    """Each background write spread over a thousand times the time between saves: the next save, the end of
    train() and save_model() hurry it instead of waiting that long."""
    monkeypatch.setattr(background_save, "COMPLETION_TARGET", 1000.0)
    started = time.perf_counter()
    trainer = train(tmp_path / "run", False, async_save=True, save_steps=1)
    trainer.save_model(str(tmp_path / "final"))
    assert time.perf_counter() - started < 120
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path / "run"))] == [
        f"checkpoint-{s}" for s in range(1, 5)]
    assert all(ckpt.verify(p) is None for p in ckpt.list_checkpoints(str(tmp_path / "run")))


def test_an_async_lora_checkpoint_resumes_exactly(tmp_path, slow_writes):
    full = train(tmp_path / "run", True, async_save=True)
    resumed = Trainer(tied_llama(), args_for(tmp_path / "resumed", async_save=True), train_dataset=rows(16, seed=4),
                      peft_config=lora_config())
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [r["loss"] for r in resumed.state.log_history if "loss" in r] == [
        r["loss"] for r in full.state.log_history if "loss" in r]


def test_a_second_save_waits_for_the_first_and_says_so_once(tmp_path, slow_writes, monkeypatch, caplog):
    """save_steps=1 with writes slower than a step: every save starts only once the previous checkpoint is
    committed, and one warning says that saves come faster than they are written."""
    slow_writes.delay, starts = 0.3, []
    real = background_save.BackgroundWriter.start

    def start(self, job, write):
        starts.append((job.step, self.in_flight, [os.path.basename(p) for p in ckpt.list_checkpoints(str(out))]))
        real(self, job, write)

    monkeypatch.setattr(background_save.BackgroundWriter, "start", start)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="stoker"):
        train(out, False, async_save=True, save_steps=1)
    assert starts == [(1, False, []), (2, False, ["checkpoint-1"]), (3, False, ["checkpoint-1", "checkpoint-2"]),
                      (4, False, ["checkpoint-1", "checkpoint-2", "checkpoint-3"])]
    waits = [r.message for r in caplog.records if "saves come more often than a checkpoint is written" in r.message]
    assert len(waits) == 1 and "save_steps=1" in waits[0]
    assert all(ckpt.verify(p) is None for p in ckpt.list_checkpoints(str(out)))


@pytest.mark.parametrize("failing, raised_at", [(2, 3), (4, 4)], ids=["at-a-later-step", "at-the-end"])
def test_a_full_disk_in_a_background_write_raises_in_the_loop_and_keeps_earlier_checkpoints(
        tmp_path, slow_writes, monkeypatch, failing, raised_at):
    """The write of checkpoint-<failing> fails (ENOSPC) in the writer thread: the loop raises the synchronous
    save's CheckpointError at its next step (or, for the last checkpoint, when train() ends), the partial folder
    is gone and the earlier checkpoints are intact."""
    real = ckpt.save_state

    def full_disk(folder, name, obj, *rest):
        if name == "scheduler" and folder.endswith(f"checkpoint-{failing}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(folder, name, obj, *rest)

    monkeypatch.setattr(ckpt, "save_state", full_disk)
    out = tmp_path / "run"
    trainer = Trainer(tied_llama(), args_for(out, async_save=True, save_steps=1), train_dataset=rows(16, seed=4))
    with pytest.raises(CheckpointError) as raised:
        trainer.train()
    assert str(raised.value) == (f"saving {out / f'checkpoint-{failing}'} failed: {os.strerror(errno.ENOSPC)}; the "
                                 "partial folder was removed and earlier checkpoints are intact")
    assert trainer.state.global_step == raised_at
    earlier = [f"checkpoint-{s}" for s in range(1, failing)]
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == earlier
    assert all(ckpt.verify(str(out / n)) is None for n in earlier)


def test_save_model_waits_for_the_checkpoint_in_flight(tmp_path, slow_writes):
    """save_model() from a callback while a checkpoint is written in the background: that checkpoint is
    committed first."""
    out, seen = tmp_path / "run", []

    class SaveModel(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            trainer.save_model(str(tmp_path / f"model-{state.global_step}"))
            seen.append([os.path.basename(p) for p in ckpt.list_checkpoints(str(out))])

    trainer = Trainer(tied_llama(), args_for(out, async_save=True), train_dataset=rows(16, seed=4),
                      callbacks=[SaveModel()])
    trainer.train()
    assert seen == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"]]
