"""The CUDA-only paths of fp16 loss scaling and auto_find_batch_size, run on the CPU: torch's CPU GradScaler stands
in for the CUDA one (Accelerate builds a scaler for fp16 only off the CPU), torch's fused AdamW runs on the CPU,
and 2 gloo ranks under torchrun stand in for 2 GPUs."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import stoker.trainer as trainer_module
from stoker import Trainer, TrainerCallback
from tests.helpers.tiny_jobs import args, llama, rows

INIT_SCALE = 2.0**10  # the scaler's scale in the tests (torch's default is 2**16); halved by each inf step


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """Every Trainer built in the test gets an Accelerator with fp16 as Accelerate sets it up on a GPU: the state's
    mixed precision "fp16", autocast to float16 in the prepared forward (native_amp), and a real GradScaler (the
    CPU one), which scales the loss in backward, unscales in clip_grad_norm_ and steps and updates in
    optimizer.step. TrainingArguments(fp16=True) itself is refused without CUDA."""
    build = trainer_module.build_accelerator

    def build_with_scaler(a, model, optimizers=(None, None)):
        acc = build(a, model, optimizers)
        acc.state._mixed_precision = "fp16"  # the process-wide state; the next build_accelerator resets it
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        return acc

    monkeypatch.setattr(trainer_module, "build_accelerator", build_with_scaler)


class Recorder(TrainerCallback):
    """After every step: the parameters, the scaler's scale and the schedule's step count."""

    def __init__(self, trainer_of):
        self.trainer_of, self.params, self.scales, self.schedule_steps = trainer_of, [], [], []

    def on_step_end(self, args, state, control, model=None, **kw):
        t = self.trainer_of()
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        self.scales.append(t.accelerator.scaler.get_scale())
        self.schedule_steps.append(t.lr_scheduler.last_epoch)


def poison_loss_at(model, steps: set[int], trainer_of):
    """The model's loss is inf in the forwards of the given optimizer steps (1-based), so are its gradients."""
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature, from which unused columns are dropped
    def poisoned(*a, **kw):
        out = forward(*a, **kw)
        if trainer_of().state.global_step + 1 in steps:
            out.loss = out.loss * math.inf
        return out

    model.forward = poisoned
    return model


def poison_gradients_at(model, steps: set[int], trainer_of):
    """A finite loss, but inf gradients in the backward of the given optimizer steps (1-based): the scaler's case."""
    def hook(grad):
        return grad * math.inf if trainer_of().state.global_step + 1 in steps else grad

    model.get_input_embeddings().weight.register_hook(hook)
    return model


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


# --- fp16: a step the non-finite guard skips ---------------------------------------------------------


def test_fp16_a_step_skipped_for_a_nonfinite_loss_is_seen_by_the_scaler_and_the_next_steps_apply(
        tmp_path, fp16_on_cpu):
    """clip_grad_norm_ unscales the gradients; when the guard then skips the step, the scaler must see it end (its
    update, which lowers the scale after inf gradients), or the next step's unscale_ raises."""
    t = None
    model = poison_loss_at(llama(), {2}, lambda: t)
    rec = Recorder(lambda: t)
    t = Trainer(model, args(tmp_path, max_steps=4, optim="adamw_torch", learning_rate=1e-2, max_grad_norm=1.0),
                train_dataset=rows(16), callbacks=[rec])
    out = t.train()
    assert out.global_step == 4
    assert [r.get("nonfinite_steps_skipped", 0) for r in t.state.log_history if "learning_rate" in r] == [0, 1, 1, 1]
    assert not changed(rec.params[0], rec.params[1])  # step 2 skipped
    assert changed(rec.params[1], rec.params[2]) and changed(rec.params[2], rec.params[3])  # steps 3 and 4 applied
    assert rec.scales == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]  # backed off once, as a scaler
    assert all(math.isfinite(v) for p in rec.params[-1].values() for v in p.flatten().tolist())


# --- fp16: a step the scaler skips does not advance the schedule, whatever the optimizer ----------------


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_fp16_a_step_the_scaler_skips_leaves_the_schedule_where_it_was(tmp_path, fp16_on_cpu, optim):
    """Inf gradients at step 2 with a finite loss: the scaler skips that update (a fused optimizer's kernel skips it
    itself, so Accelerate never sees it skipped) and the schedule, and the learning rate logged, must not advance."""
    t = None
    model = poison_gradients_at(llama(), {2}, lambda: t)
    rec = Recorder(lambda: t)
    t = Trainer(model, args(tmp_path, max_steps=4, optim=optim, learning_rate=1e-2, lr_scheduler_type="linear",
                            max_grad_norm=1.0), train_dataset=rows(16), callbacks=[rec])
    t.train()
    assert not changed(rec.params[0], rec.params[1]) and changed(rec.params[1], rec.params[2])
    assert rec.scales == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]
    assert rec.schedule_steps == [1, 1, 2, 3]  # the skipped step 2 did not step the schedule
    lrs = [r["learning_rate"] for r in t.state.log_history if "learning_rate" in r]
    assert lrs[1] == lrs[2] == pytest.approx(1e-2 * 3 / 4) and lrs[3] == pytest.approx(1e-2 * 2 / 4)
    assert not [r for r in t.state.log_history if "nonfinite_steps_skipped" in r]  # the scaler's skip, not the guard's


# --- a second train() on the same Trainer --------------------------------------------------------------


@pytest.mark.parametrize("given", [False, True], ids=["built", "given_optimizer"])
def test_fp16_a_second_train_prepares_one_optimizer_and_updates_as_a_fresh_trainer(tmp_path, fp16_on_cpu, given):
    """A second train() must not leave the first run's optimizer in the Accelerator, whose unscale_gradients()
    unscales every optimizer it holds: the gradients divided by the scale twice (or an error, the same optimizer
    twice)."""
    data = rows(16, seed=3)
    kw = dict(max_steps=2, optim="sgd", learning_rate=0.5, max_grad_norm=1.0)

    def optimizers(model):
        return (torch.optim.SGD(model.parameters(), lr=0.5), None) if given else (None, None)

    model = llama()
    t = Trainer(model, args(tmp_path / "twice", **kw), train_dataset=data, optimizers=optimizers(model))
    t.train()
    after_first = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    assert len(t.accelerator._optimizers) == 1 and len(t.accelerator._models) == 1

    fresh_model = llama()
    fresh_model.load_state_dict(after_first, strict=False)
    fresh = Trainer(fresh_model, args(tmp_path / "fresh", **kw), train_dataset=data,
                    optimizers=optimizers(fresh_model))
    fresh.train()
    for name, p in fresh.model.named_parameters():
        torch.testing.assert_close(dict(t.model.named_parameters())[name], p, atol=0, rtol=0, msg=name)


def test_evaluate_before_a_second_train_still_trains_the_prepared_model(tmp_path, fp16_on_cpu):
    """evaluate() before each train(): the clean Accelerator of each run still undoes the evaluation-only
    preparation, and trains (one model, one optimizer in the Accelerator)."""
    t = Trainer(llama(), args(tmp_path, max_steps=2, optim="sgd"), train_dataset=rows(16), eval_dataset=rows(4))
    t.evaluate()
    t.train()
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.evaluate()
    t.train()
    assert changed(before, {n: p.detach() for n, p in t.model.named_parameters()})
    assert len(t.accelerator._optimizers) == 1 and len(t.accelerator._models) == 1


# --- auto_find_batch_size on several processes -----------------------------------------------------------

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dist_worker.py"


@pytest.mark.distributed
def test_out_of_memory_on_one_rank_halves_every_rank_and_one_in_the_last_backward_fails_on_every_rank(tmp_path):
    """2 gloo ranks under torchrun (tests/helpers/dist_worker.py): rank 1 alone runs out of memory in a forward and
    then in on_step_end; both halve together and update as the run without errors. Then rank 1 runs out of memory
    inside the backward where rank 0 waits in DDP's all-reduce: the launch fails (never hangs), rank 1 saying why."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
               str(tmp_path), "oom_on_one_rank", "oom_in_the_last_backward"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    found = [json.loads((tmp_path / "oom_on_one_rank" / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [f["train_batch_size"] for f in found] == [1, 1], output[-4000:]  # 4 -> 2 (forward) -> 1 (on_step_end)
    assert found[0]["global_step"] == found[1]["global_step"] == 3
    assert [loss for _, loss in found[0]["losses"]] == pytest.approx(
        [loss for _, loss in found[0]["reference_losses"]], abs=1e-5)
    final = load_file(tmp_path / "oom_on_one_rank" / "final.safetensors")
    reference = load_file(tmp_path / "oom_on_one_rank" / "reference.safetensors")
    for name, p in reference.items():
        torch.testing.assert_close(final[name], p, atol=1e-6, rtol=0, msg=name)
    assert proc.returncode != 0
    assert "out of memory on process 1 of 2, in the backward of the window's last micro-batch" in output


class TwoProcesses:
    """Stands for the Accelerator of process 0 of 2, whose reduce adds the other process's flag."""

    num_processes, process_index, device = 2, 0, torch.device("cpu")

    def __init__(self, other: float):
        self.other, self.reduced = other, 0

    def reduce(self, tensor, reduction):
        self.reduced += 1
        return tensor + self.other


def test_an_evaluation_batch_runs_out_of_memory_on_every_process_or_on_none():
    """The evaluation batch's agreement: an out-of-memory error here, or one another process reports, is raised as
    OutOfMemoryInEvaluation on this process too; a batch without one anywhere goes on; any other error is raised
    as it is, without the exchange (whose partner would never come)."""
    from stoker.evaluation import OutOfMemoryInEvaluation, agreeing_on_out_of_memory

    here = TwoProcesses(other=0.0)
    with pytest.raises(OutOfMemoryInEvaluation, match=r"on this process \(process 0 of 2\)") as raised:
        with agreeing_on_out_of_memory(here, True):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError) and here.reduced == 1
    with pytest.raises(OutOfMemoryInEvaluation, match="on another process"):
        with agreeing_on_out_of_memory(TwoProcesses(other=1.0), True):
            pass
    quiet = TwoProcesses(other=0.0)
    with agreeing_on_out_of_memory(quiet, True):
        pass
    assert quiet.reduced == 1
    other = TwoProcesses(other=0.0)
    with pytest.raises(ValueError, match="not memory"), agreeing_on_out_of_memory(other, True):
        raise ValueError("not memory")
    assert other.reduced == 0
    with agreeing_on_out_of_memory(alone := TwoProcesses(other=1.0), False):  # one process, or under FSDP
        pass
    assert alone.reduced == 0


@pytest.mark.distributed
def test_out_of_memory_in_evaluation_on_one_rank_halves_every_ranks_evaluation_batch(tmp_path):
    """2 gloo ranks under torchrun: rank 1 alone runs out of memory in evaluation forwards of 4 rows. Both ranks
    halve their evaluation batch together (halving alone, rank 1 would start over while rank 0 waits in the
    batch's gather) and report the metrics of an evaluation at batch 2 on every rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
               str(tmp_path), "eval_oom_on_one_rank"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    found = [json.loads((tmp_path / "eval_oom_on_one_rank" / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [f["eval_batch_size"] for f in found] == [2, 2]
    for f in found:
        assert f["halved"].keys() == f["reference"].keys()
        assert f["halved"] == pytest.approx(f["reference"], abs=1e-6)
    assert found[0]["halved"] == found[1]["halved"]
