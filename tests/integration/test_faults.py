"""Faults: preemption signals, corrupted and planted checkpoints, failed saves, non-finite steps, OOM, bad input."""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import pickle
import re
import shutil
import signal

import pytest
import torch
from torch import nn

from stoker import ConfigError, EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from stoker import checkpoint_format as ckpt
from stoker.errors import PREEMPTED_EXIT_CODE, NonFiniteError, TrainingPreempted
from tests.helpers.tiny_jobs import llama, rows


def make_args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "report_to": "none", "disable_tqdm": True, "logging_steps": 1,
            "save_strategy": "steps", "save_steps": 1, "per_device_train_batch_size": 2, "max_steps": 6,
            "learning_rate": 1e-2, "optim": "adamw_torch", "seed": 5}
    return TrainingArguments(**{**base, **kw})


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict, atol: float = 0.0):
    for name, p in a.items():
        torch.testing.assert_close(b[name], p, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


class At(TrainerCallback):
    """Calls fn(trainer-visible kwargs) in on_step_end at the given global step."""

    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            self.fn()


# --- preemption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"], ids=["sync", "deferred"])
def test_sigterm_checkpoints_the_current_step_exits_75_and_resumes_exactly(tmp_path, monkeypatch, optim):
    """With either check (the fused optimizer's is read one step late: the preempted step's is settled before its
    checkpoint)."""
    data = rows(16)
    make_args = functools.partial(globals()["make_args"], optim=optim)
    reference = Trainer(llama(), make_args(tmp_path / "ref"), train_dataset=data)
    reference.train()

    # a second SIGTERM arrives while the checkpoint is being written: the save must still complete
    real_save_state = ckpt.save_state

    def save_state_with_signal(folder, name, obj, *rest):
        if name == "optimizer":
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save_state(folder, name, obj, *rest)

    trainer = Trainer(llama(), make_args(tmp_path / "run", save_strategy="no"), train_dataset=data,
                      callbacks=[At(3, lambda: os.kill(os.getpid(), signal.SIGTERM))])
    monkeypatch.setattr(ckpt, "save_state", save_state_with_signal)
    with pytest.raises(TrainingPreempted) as info:
        trainer.train()
    monkeypatch.setattr(ckpt, "save_state", real_save_state)
    assert info.value.code == PREEMPTED_EXIT_CODE == 75
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-3", "metrics.jsonl"]
    assert ckpt.verify(str(tmp_path / "run" / "checkpoint-3")) is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    resumed = Trainer(llama(), make_args(tmp_path / "run", save_strategy="no"), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert_same(params(reference.model), params(resumed.model))


# --- corrupted, incomplete and planted checkpoints ------------------------------------------------


def _trained_run(tmp_path, steps=3):
    t = Trainer(llama(), make_args(tmp_path / "run", max_steps=steps), train_dataset=rows(8))
    t.train()
    return tmp_path / "run"


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _flip_a_byte(folder):
    path = folder / "optimizer.json"
    text = path.read_text()
    path.write_text(text.replace("0", "1", 1))


def _drop_manifest(folder):
    (folder / ckpt.MANIFEST).unlink()


ABORTING_TEARDOWN = """
import os, sys
from stoker import errors

class CommunicationLibrary:  # stands in for a gloo or NCCL group that aborts when freed at interpreter exit
    def __del__(self, abort=os.abort):  # bound now: module globals are gone by the time it runs
        abort()

library = CommunicationLibrary()
if sys.argv[1] == "preempted":
    errors.exit_with_code_after_preemption()
raise errors.TrainingPreempted(15, 3)
"""


@pytest.mark.parametrize("committed", [True, False])
def test_a_preempted_multi_process_run_exits_75_even_if_its_teardown_aborts(tmp_path, committed):
    """After every rank has its share of the checkpoint, the exit code is 75 whatever the teardown of the
    process does afterwards (without that guarantee, the abort wins: the control case)."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(ABORTING_TEARDOWN)
    proc = subprocess.run([sys.executable, str(script), "preempted" if committed else "plain"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if committed:
        assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr
    else:
        assert proc.returncode == -signal.SIGABRT, proc.stderr


@pytest.mark.parametrize("damage, reason", [(_truncate, "bytes"), (_flip_a_byte, "sha256"),
                                            (_drop_manifest, "no manifest")])
def test_damaged_checkpoint_is_skipped_by_true_and_refused_by_path(tmp_path, capsys, damage, reason):
    out = _trained_run(tmp_path)
    damage(out / "checkpoint-3")
    with pytest.raises(ckpt.CheckpointError, match=reason):
        Trainer(llama(), make_args(out), train_dataset=rows(8)).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    t = Trainer(llama(), make_args(out, max_steps=4), train_dataset=rows(8))
    t.train(resume_from_checkpoint=True)
    err = capsys.readouterr().err
    assert "skipping" in err and "checkpoint-3" in err and reason in err
    assert t.state.log_history[0]["step"] == 1 and t.state.global_step == 4  # resumed from checkpoint-2


def test_resume_last_without_checkpoints_starts_fresh_with_a_notice(tmp_path, capsys):
    """'last' is a requeued job's first start; True there is refused as transformers refuses it
    (tests/parity/test_parity_hf_behaviours.py)."""
    t = Trainer(llama(), make_args(tmp_path / "empty", max_steps=2), train_dataset=rows(8))
    t.train(resume_from_checkpoint="last")
    assert t.state.global_step == 2 and "starting from scratch" in capsys.readouterr().err


class Sentinel:
    """Unpickling this object would create a file: proof that code ran."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("planted_as", ["optimizer.pt", "optimizer.safetensors", "process_0.json"])
def test_planted_pickle_is_refused_and_never_runs(tmp_path, planted_as):
    out = _trained_run(tmp_path)
    sentinel = tmp_path / "pwned"
    Sentinel.path = str(sentinel)
    (out / "checkpoint-3" / planted_as).write_bytes(pickle.dumps(Sentinel(), protocol=4))
    with pytest.raises(ckpt.CheckpointError, match="pickle"):
        Trainer(llama(), make_args(out), train_dataset=rows(8)).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    t = Trainer(llama(), make_args(out, max_steps=4), train_dataset=rows(8))
    t.train(resume_from_checkpoint=True)  # falls back to checkpoint-2
    assert not sentinel.exists()


def test_resume_never_unpickles(tmp_path, monkeypatch):
    out = _trained_run(tmp_path)

    def forbidden(*a, **k):
        raise AssertionError("pickle used while loading a checkpoint")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    t = Trainer(llama(), make_args(out, max_steps=4), train_dataset=rows(8))
    t.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert t.state.global_step == 4


def test_every_checkpoint_file_is_json_or_safetensors(tmp_path):
    from safetensors import safe_open

    t = Trainer(llama(), make_args(tmp_path / "run", max_steps=2, bf16=True, eval_strategy="steps", eval_steps=1,
                                   metric_for_best_model="loss"),
                train_dataset=rows(8), eval_dataset=rows(4), callbacks=[EarlyStoppingCallback(3)])
    t.train()
    folder = tmp_path / "run" / "checkpoint-2"
    names = sorted(os.listdir(folder))
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "loop_state.json",
            "process_0.safetensors", "manifest.json"} <= set(names)
    for name in names:
        path = folder / name
        assert path.read_bytes()[:1] != b"\x80", name  # no pickle protocol header
        if name.endswith(".json"):
            json.loads(path.read_text())
        else:
            assert name.endswith(".safetensors"), name
            with safe_open(str(path), "pt") as f:
                assert list(f.keys())
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 3, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 0}}


# --- failed and interrupted saves ------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failed_save_leaves_earlier_checkpoints_and_no_partial_folder(tmp_path, monkeypatch, code):
    real = ckpt.save_state
    calls = []

    def failing(folder, name, obj, *rest):
        calls.append(name)
        if name == "scheduler" and calls.count("scheduler") == 2:  # the second checkpoint
            raise OSError(code, os.strerror(code))
        return real(folder, name, obj, *rest)

    monkeypatch.setattr(ckpt, "save_state", failing)
    t = Trainer(llama(), make_args(tmp_path / "run", max_steps=4), train_dataset=rows(8))
    with pytest.raises(ckpt.CheckpointError, match=os.strerror(code)):
        t.train()
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-1", "metrics.jsonl"]
    assert ckpt.verify(str(tmp_path / "run" / "checkpoint-1")) is None


def test_resaving_a_step_keeps_the_old_folder_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """Committing over an existing checkpoint-N (the final step re-saved after an epoch-end save) moves the old
    one aside first: if the new one cannot be renamed into place, the old one is put back, intact."""
    out = _trained_run(tmp_path, steps=2)
    final, tmp = str(out / "checkpoint-2"), ckpt.temp_dir_for(str(out / "checkpoint-2"))
    shutil.copytree(final, tmp)
    os.remove(os.path.join(tmp, ckpt.MANIFEST))
    real = os.rename

    def failing(src, dst):
        if src == tmp:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        ckpt.commit(tmp, final, 2)
    assert ckpt.verify(final) is None and not os.path.exists(ckpt.temp_dir_for(final, ".old-"))
    monkeypatch.setattr(os, "rename", real)
    ckpt.commit(tmp, final, 2)  # and when it can, the new one replaces it
    assert ckpt.verify(final) is None and ckpt.stale_temp_dirs(str(out)) == []


def test_stale_temporary_folder_is_ignored_and_cleaned(tmp_path):
    out = _trained_run(tmp_path, steps=2)
    stale = out / ".tmp-checkpoint-3"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    t = Trainer(llama(), make_args(out, max_steps=3, save_strategy="no"), train_dataset=rows(8))
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 3 and not stale.exists()


# --- non-finite steps -------------------------------------------------------------------------------


class Poisonable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.poison_steps: set[int] = set()
        self.step = 0

    def forward(self, x, labels):
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), labels)
        return loss * float("nan") if self.step in self.poison_steps else loss


class StepCounter(TrainerCallback):
    """Tells the model which step runs next, and records parameters and optimizer state after each step."""

    def __init__(self):
        self.after = {}

    def on_step_begin(self, args, state, control, model=None, **kw):
        model.step = state.global_step + 1

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.after[state.global_step] = (params(model), json.dumps(
            {k: {n: v.tolist() for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()}))


def regression(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": x[i].sum()} for i in range(n)]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"], ids=["sync", "deferred"])
def test_nonfinite_step_is_skipped_on_a_non_logging_step(tmp_path, optim):
    """With either check (read in its step, or one step late with the update skipped on the device by the fused
    optimizer), the non-finite step changes neither the parameters nor the optimizer state."""
    model, rec = Poisonable(), StepCounter()
    model.poison_steps = {3}
    t = Trainer(model, make_args(tmp_path, logging_steps=5, max_steps=5, save_strategy="no", optim=optim),
                train_dataset=regression(), callbacks=[rec])
    t.train()
    assert_same(rec.after[2][0], rec.after[3][0])  # parameters unchanged by the poisoned step
    assert rec.after[2][1] == rec.after[3][1]  # optimizer state unchanged
    assert rec.after[3][0]["net.weight"].ne(rec.after[4][0]["net.weight"]).any()  # and training goes on
    log = next(r for r in t.state.log_history if r.get("step") == 5 and "loss" in r)
    assert log["nonfinite_steps_skipped"] == 1 and log["loss"] == log["loss"]  # the NaN is not averaged in


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"], ids=["sync", "deferred"])
def test_a_window_of_skipped_steps_split_by_a_checkpoint_logs_nan_after_the_resume(tmp_path, optim):
    # steps 3 and 4 (the second logging window) are non-finite; the run is checkpointed at step 3 and resumed:
    # its log at step 4 is still the window's NaN, and the whole history is the uninterrupted run's
    def run(out, resume=False):
        model = Poisonable()
        model.poison_steps = {3, 4}
        t = Trainer(model, make_args(out, logging_steps=2, save_steps=3, max_steps=6, optim=optim),
                    train_dataset=regression(), callbacks=[StepCounter()])
        if resume:
            shutil.rmtree(out / "checkpoint-6")
        t.train(resume_from_checkpoint=str(out / "checkpoint-3") if resume else None)
        return [(r["step"], r["loss"]) for r in t.state.log_history if "loss" in r]

    whole = run(tmp_path)
    assert [s for s, _ in whole] == [2, 4, 6] and math.isnan(whole[1][1])
    assert math.isfinite(whole[0][1]) and math.isfinite(whole[2][1])
    resumed = run(tmp_path, resume=True)
    assert [s for s, _ in resumed] == [2, 4, 6] and math.isnan(resumed[1][1])
    assert resumed[0][1] == whole[0][1] and resumed[2][1] == whole[2][1]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"], ids=["sync", "deferred"])
def test_nonfinite_stop_policy_and_the_consecutive_limit(tmp_path, optim):
    model = Poisonable()
    model.poison_steps = {3}
    t = Trainer(model, make_args(tmp_path / "a", logging_steps=5, nonfinite_policy="stop", optim=optim),
                train_dataset=regression(), callbacks=[StepCounter()])
    with pytest.raises(NonFiniteError, match="step 3"):
        t.train()
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-1", "checkpoint-2"]  # step 3 never saved
    model = Poisonable()
    model.poison_steps = {2, 3, 4}
    t = Trainer(model, make_args(tmp_path / "b", max_nonfinite_steps=3, optim=optim), train_dataset=regression(),
                callbacks=[StepCounter()])
    with pytest.raises(NonFiniteError, match="3 non-finite steps in a row"):
        t.train()


class RatesUsed(TrainerCallback):
    """The learning rate each step's update is handed (at on_pre_optimizer_step)."""

    def __init__(self):
        self.rates = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.rates[state.global_step + 1] = optimizer.param_groups[0]["lr"]


def test_a_deferred_check_leaves_what_the_synchronous_one_leaves(tmp_path, monkeypatch):
    """Fused AdamW, a linear schedule, steps 3 and 4 non-finite, a checkpoint at step 3, logs every 2 steps: the run
    whose check is read one step late (the update skipped on the device) equals, bit for bit, the same run with the
    check read in its own step: parameters and optimizer state after every step, the rate every update used (the
    schedule held on the skipped steps: steps 3, 4 and 5 use step 3's rate), the log, and the checkpoint."""
    from stoker.distributed.backends import Backend

    def run(out, deferred: bool):
        model, rec, rates = Poisonable(), StepCounter(), RatesUsed()
        model.poison_steps = {3, 4}
        t = Trainer(model, make_args(out, logging_steps=2, save_steps=3, max_steps=6, optim="adamw_torch_fused",
                                     lr_scheduler_type="linear", max_nonfinite_steps=5),
                    train_dataset=regression(), callbacks=[rec, rates])
        with monkeypatch.context() as m:
            if not deferred:
                m.setattr(Backend, "skips_on_device", lambda self, optimizer: False)
            t.train()
        logs = [{k: v for k, v in r.items() if k not in ("train_runtime", "train_samples_per_second",
                                                           "train_steps_per_second")} for r in t.state.log_history]
        saved = {name: (out / "checkpoint-3" / name).read_bytes() for name in sorted(os.listdir(out / "checkpoint-3"))
                 if name.endswith(".safetensors")}
        return rec.after, rates.rates, logs, saved

    deferred, sync = run(tmp_path / "deferred", True), run(tmp_path / "sync", False)
    after, rates, logs, saved = deferred
    assert after.keys() == sync[0].keys() == set(range(1, 7))
    for step in after:
        assert_same(after[step][0], sync[0][step][0])
        assert after[step][1] == sync[0][step][1], step
    # the synchronous check runs no update for a non-finite step (no on_pre_optimizer_step); deferred, the update is
    # queued and skipped on the device, with the rate the schedule held
    assert {k: v for k, v in rates.items() if k not in (3, 4)} == sync[1] and sync[1].keys() == {1, 2, 5, 6}
    assert rates[3] == rates[4] == rates[5] < rates[2]
    assert logs == sync[2] and saved == sync[3] and saved


def test_a_nonfinite_model_is_never_saved(tmp_path):
    model = Poisonable()
    t = Trainer(model, make_args(tmp_path, max_steps=2), train_dataset=regression(),
                callbacks=[At(1, lambda: model.net.weight.data.fill_(float("inf")))])
    with pytest.raises(NonFiniteError, match="refusing to save checkpoint-1"):
        t.train()
    assert not os.path.exists(tmp_path / "checkpoint-1")


@pytest.mark.parametrize("values, finite", [
    ([1.0, -2.0], True), ([3e38, 3e38], True),  # finite values whose float32 sum overflows
    ([1.0, float("nan")], False), ([float("inf"), 0.0], False), ([float("inf"), float("-inf")], False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_save_check_of_finite_parameters_is_exact(values, finite, dtype):
    """The check sums each tensor (a sum is finite only if every value is) and looks at the values one by one only
    where a sum is not finite."""
    from types import SimpleNamespace

    from stoker.checkpointer import parameters_finite

    model = nn.Linear(len(values), 1, bias=False)
    model.weight.data = torch.tensor([values], dtype=dtype)
    assert parameters_finite(SimpleNamespace(num_processes=1), model) is finite


# --- out of memory ----------------------------------------------------------------------------------


def oom_above(model, rows_limit):
    """Make the model raise a CUDA-style OOM for micro-batches of more than rows_limit rows (an injected OOM:
    a real one is a torch.OutOfMemoryError whose message accelerate's should_reduce_batch_size recognises)."""
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature, from which unused columns are dropped
    def guarded(*a, **kw):
        if kw["input_ids"].shape[0] > rows_limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*a, **kw)

    model.forward = guarded
    return model


def test_oom_halves_the_micro_batch_keeps_the_update_and_resumes_with_it(tmp_path):
    data = rows(24, seed=8)
    sgd = {"optim": "sgd", "learning_rate": 0.1}  # linear in the gradient: the update itself is compared
    ref = Trainer(llama(), make_args(tmp_path / "ref", per_device_train_batch_size=8, max_steps=5,
                                     save_strategy="no", **sgd), train_dataset=data)
    ref.train()
    t = Trainer(oom_above(llama(), 2), make_args(tmp_path / "oom", per_device_train_batch_size=8, max_steps=5,
                                                  auto_find_batch_size=True, **sgd), train_dataset=data)
    t.train()
    assert t.state.train_batch_size == 2
    assert_same(params(ref.model), params(t.model), atol=1e-6)
    loop = json.loads((tmp_path / "oom" / "checkpoint-2" / "loop_state.json").read_text())
    assert (loop["per_device_train_batch_size"], loop["gradient_accumulation_steps"]) == (2, 4)
    # the resumed run starts with the micro-batch that fit, and continues exactly
    resumed = Trainer(oom_above(llama(), 2), make_args(tmp_path / "oom", per_device_train_batch_size=8,
                                                        max_steps=5, auto_find_batch_size=True, **sgd),
                      train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "oom" / "checkpoint-2"))
    assert resumed.state.train_batch_size == 2
    assert_same(params(t.model), params(resumed.model))


def test_oom_in_the_middle_of_a_window_discards_its_gradients_and_keeps_the_update(tmp_path):
    """An OOM on the 2nd micro-batch of a window, after the 1st one's backward: the gradients already
    accumulated are dropped and the window rerun in halves, so the update is still batch 6's."""
    data = rows(24, seed=8)
    sgd = {"optim": "sgd", "learning_rate": 0.1, "save_strategy": "no", "max_steps": 2}
    ref = Trainer(llama(), make_args(tmp_path / "ref", per_device_train_batch_size=6, **sgd), train_dataset=data)
    ref.train()
    model = llama()
    forward, calls = model.forward, []

    @functools.wraps(forward)
    def second_call_fails(*a, **kw):
        calls.append(kw["input_ids"].shape[0])
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*a, **kw)

    model.forward = second_call_fails
    t = Trainer(model, make_args(tmp_path / "oom", per_device_train_batch_size=2, gradient_accumulation_steps=3,
                                 auto_find_batch_size=True, **sgd), train_dataset=data)
    t.train()
    # then the failed window again as 6 micro-batches of 1, and so the next window
    assert t.state.train_batch_size == 1 and calls[:3] == [2, 2, 1] and calls[-12:] == [1] * 12
    assert_same(params(ref.model), params(t.model), atol=1e-6)


def test_oom_without_auto_find_batch_size_is_raised(tmp_path):
    t = Trainer(oom_above(llama(), 2), make_args(tmp_path, per_device_train_batch_size=4), train_dataset=rows(8))
    with pytest.raises(torch.OutOfMemoryError):
        t.train()


def test_oom_in_evaluation_halves_only_the_eval_batch(tmp_path):
    model = llama()
    t = Trainer(oom_above(model, 4), make_args(tmp_path, per_device_train_batch_size=4, max_steps=2,
                                               per_device_eval_batch_size=16, eval_strategy="steps", eval_steps=1,
                                               auto_find_batch_size=True, save_strategy="no"),
                train_dataset=rows(8), eval_dataset=rows(12))
    t.train()
    assert t._eval_batch_size == 4 and t.state.train_batch_size == 4
    assert sum("eval_loss" in r for r in t.state.log_history) == 2


# --- resuming with other settings; restoring best metric and early stopping --------------------------


def test_resume_with_changed_settings_is_refused_or_warned(tmp_path, capsys):
    out = _trained_run(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=(
            r"global batch 2 = 1 x 2 x 1 \(now 4 = 1 x 4 x 1; processes x per_device_train_batch_size x "
            r"gradient_accumulation_steps\), data_seed=5 \(now 9\): resuming cannot reproduce the original run; "
            r"keep its global batch of 2 on 1 process with --per_device_train_batch_size 2 "
            r"--gradient_accumulation_steps 1 \(or per-device batch x accumulation 1 x 2\) and restore the other "
            r"settings")):
        Trainer(llama(), make_args(out, per_device_train_batch_size=4, data_seed=9),
                train_dataset=rows(8)).train(resume_from_checkpoint=True)
    t = Trainer(llama(), make_args(out, max_steps=5, per_device_train_batch_size=4, resume_mismatch="warn"),
                train_dataset=rows(8))
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 5 and "resume_mismatch='warn'" in capsys.readouterr().err


def test_another_split_of_the_same_global_batch_resumes_as_the_same_run(tmp_path, capsys):
    """Micro-batch 2 x accumulation 2, resumed as 4 x 1 and as 1 x 4: the same samples in the same steps, so the
    same run within float summation order, and no flag needed."""
    def trainer(out, micro, accumulation):
        return Trainer(llama(), make_args(out, max_steps=4, save_steps=2, per_device_train_batch_size=micro,
                                          gradient_accumulation_steps=accumulation, lr_scheduler_type="linear"),
                       train_dataset=rows(16))

    full = trainer(tmp_path / "full", 2, 2)
    full.train()
    for micro, accumulation in ((4, 1), (1, 4)):
        resumed = trainer(tmp_path / f"{micro}x{accumulation}", micro, accumulation)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
        assert_same(params(resumed.model), params(full.model), atol=1e-6)
        assert [r["step"] for r in resumed.state.log_history if "loss" in r] == [1, 2, 3, 4]
        assert (f"resuming a 1-process checkpoint on 1 process: global batch 4 = 1 x {micro} x {accumulation}, "
                "unchanged") in capsys.readouterr().err


def test_resume_restores_best_metric_and_early_stopping(tmp_path):
    kw = {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "loss", "learning_rate": 0.0,
          "max_steps": 8}
    first = EarlyStoppingCallback(early_stopping_patience=3)
    t = Trainer(llama(), make_args(tmp_path, **kw), train_dataset=rows(8), eval_dataset=rows(4), callbacks=[first])
    t.train()
    assert t.state.global_step == 4  # lr 0: no improvement after the first evaluation, patience 3
    again = EarlyStoppingCallback(early_stopping_patience=3)
    r = Trainer(llama(), make_args(tmp_path, restore_callback_states_from_checkpoint=True, **kw),
                train_dataset=rows(8), eval_dataset=rows(4), callbacks=[again])
    r.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert r.state.best_metric == t.state.best_metric
    assert r.state.best_model_checkpoint.endswith("checkpoint-1")
    assert r.state.global_step == 4  # the restored patience counter (2) stops it after one more evaluation
    # transformers' default: callback states stay as passed in, so the counter starts again from 0
    fresh = EarlyStoppingCallback(early_stopping_patience=3)
    r = Trainer(llama(), make_args(tmp_path, **kw), train_dataset=rows(8), eval_dataset=rows(4), callbacks=[fresh])
    r.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert r.state.global_step == 6 and fresh.early_stopping_patience_counter == 3


def test_resuming_early_stopping_and_loading_the_best_model_are_each_said_once(tmp_path, capsys):
    kw = {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "loss", "learning_rate": 0.0,
          "max_steps": 8, "load_best_model_at_end": True}
    t = Trainer(llama(), make_args(tmp_path, **kw), train_dataset=rows(8), eval_dataset=rows(4),
                callbacks=[EarlyStoppingCallback(early_stopping_patience=3)])
    t.train()
    err = capsys.readouterr().err
    assert err.count("early stopping at step 4: eval_loss=") == 1, err
    assert err.count(f"loaded the best model, {tmp_path / 'checkpoint-1'} (loss=") == 1, err
    r = Trainer(llama(), make_args(tmp_path, **kw), train_dataset=rows(8), eval_dataset=rows(4))
    r.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    err = capsys.readouterr().err
    assert err.count(f"resumed from {tmp_path / 'checkpoint-3'} at step 3") == 1, err
    assert "early stopping" not in err


# --- bad input ---------------------------------------------------------------------------------------


def test_bad_rows_labels_and_collators_are_named_before_training(tmp_path):
    # the first train batch is checked as the loop is about to run it (a Trainer that only evaluates is built,
    # as transformers builds it), before the model sees it: the weights are untouched; the first eval batch when
    # evaluation starts
    def refused(model, **kw):
        trainer = Trainer(model, make_args(tmp_path), **kw)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        with pytest.raises(ConfigError) as e:
            trainer.train()
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
        return str(e.value)

    no_ids = [{"text_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    assert re.search(r"batches have columns \['labels'\] \(remove_unused_columns dropped those forward does not "
                     r"take\); LlamaForCausalLM needs 'input_ids'", refused(llama(), train_dataset=no_ids))
    float_labels = [{"input_ids": [1, 2, 3], "labels": [0.5, 0.1, 0.2]}]
    short_labels = [{"input_ids": [1, 2, 3], "labels": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}]
    assert "train_dataset: labels has dtype torch.float32" in refused(llama(), train_dataset=float_labels)
    with pytest.raises(ConfigError, match=re.escape("eval_dataset: labels has shape [2, 2] but input_ids has [2, 3]")):
        Trainer(llama(), make_args(tmp_path), train_dataset=float_labels, eval_dataset=short_labels).evaluate()
    assert "non-tensor values for ['ids']" in refused(
        llama(), train_dataset=rows(4),
        data_collator=lambda rs: {"input_ids": torch.tensor([r["input_ids"][:3] for r in rs]), "ids": [1]})
    assert "Poisonable.forward needs ['x']" in refused(Poisonable(), train_dataset=[{"labels": 1.0}])


def test_train_rows_the_model_cannot_take_still_evaluate_and_train_is_refused(tmp_path):
    no_labels = [{"input_ids": [1, 2, 3]}] * 4
    trainer = Trainer(llama(), make_args(tmp_path), train_dataset=no_labels, eval_dataset=rows(4))
    assert "eval_loss" in trainer.evaluate()  # transformers builds and evaluates too
    trainer.get_eval_dataloader()
    with pytest.raises(ConfigError, match=r"train_dataset: .*computes its loss from \['labels'\]"):
        trainer.train()


def test_checkpoint_of_another_model_names_the_mismatches(tmp_path):
    out = _trained_run(tmp_path)
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ckpt.CheckpointError, match=r"does not fit this model: .*embed_tokens.weight has shape"):
        Trainer(other, make_args(out), train_dataset=rows(8)).train(resume_from_checkpoint=True)
    assert ckpt.verify(str(out / "checkpoint-3")) is None
    shutil.rmtree(out / "checkpoint-1")  # nothing else was touched: the other checkpoints still verify
    assert ckpt.verify(str(out / "checkpoint-2")) is None
