"""The pieces of one step (stoker.step): what every process agrees on, the non-finite policy, out-of-memory
halving, and a Run that lives only as long as its train() call."""

from __future__ import annotations

import inspect
import math
import signal
from types import SimpleNamespace

import pytest
import torch

from stoker import TrainerCallback, TrainingArguments
from stoker.errors import NonFiniteError
from stoker.run import Run
from stoker.step import LogSums, LoopPosition, MicroBatchHalver, NonFinitePolicy, StepCheck, StepVerdict

ONE_PROCESS = SimpleNamespace(num_processes=1, ranks_per_batch=1, ranks_per_loss=1, device=torch.device("cpu"))
OOM = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _verdict(loss, grad_norm, check_grad_norm=True, received=None, deferred=False):
    check = StepCheck(ONE_PROCESS, deferred, check_grad_norm, reads_loss=True)
    skip = check.queue(torch.tensor(loss), torch.tensor(grad_norm), 4, 0.1, received)
    (step, _, _, learning_rate), verdict = check.take(received)
    assert (step, learning_rate, check.take(received)) == (4, 0.1, None)  # taken once
    return verdict, skip


def test_one_process_agrees_on_its_own_numbers_and_signal():
    assert _verdict(1.5, 0.3) == (StepVerdict(True, True, None, 1.5), None)  # the window's loss rides along
    assert _verdict(1.5, math.inf, received=signal.SIGUSR1)[0] == StepVerdict(False, False, signal.SIGUSR1, 1.5)
    # without spike_rollback the loss is not copied at all
    check = StepCheck(ONE_PROCESS, False, True)
    check.queue(torch.tensor(1.5), torch.tensor(0.3), 1, 0.1, None)
    assert math.isnan(check.take(None)[1].loss)
    # with fp16 loss scaling the gradient norm is the scaler's business: only the loss is checked
    assert _verdict(1.5, math.inf, check_grad_norm=False)[0].finite
    assert not _verdict(math.nan, 0.3, check_grad_norm=False)[0].finite


def test_a_deferred_check_hands_the_optimizer_its_skip_flag_and_keeps_the_step_pending():
    """Deferred, queue returns the device flag a fused optimizer skips its update on (1.0: skip), as the
    GradScaler's found_inf; the verdict waits in `pending` until take."""
    for loss, flag in ((1.5, 0.0), (math.nan, 1.0)):
        verdict, skip = _verdict(loss, 0.3, deferred=True)
        assert skip.dtype == torch.float32 and skip.item() == flag and verdict.finite is (flag == 0.0)
    check = StepCheck(ONE_PROCESS, True, True)
    assert check.take(None) is None
    check.queue(torch.tensor(1.0), torch.tensor(1.0), 1, 0.1, None)
    assert check.pending is not None and check.pending.step == 1


def test_a_fused_optimizer_skips_the_whole_update_on_the_flag():
    """What the deferred check relies on: torch's fused AdamW given found_inf=1 leaves the parameters, moments and
    step count as they were; given 0, it updates exactly as without the flag."""
    def stepped(flag):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        for f in (0.0, flag, 0.0):
            p.grad = torch.randn(5)
            if f is not None:
                opt.found_inf = torch.tensor(f)
            opt.step()
        return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}

    plain, flagged, skipped = stepped(None), stepped(0.0), stepped(1.0)
    assert torch.equal(plain[0], flagged[0]) and all(torch.equal(plain[1][k], flagged[1][k]) for k in plain[1])
    assert skipped[1]["step"].item() == 2 and not torch.equal(skipped[0], plain[0])


PLAIN = SimpleNamespace(scaler=None, optimizer_step_was_skipped=False)  # one process, no fp16 loss scaling
# every torch optimizer with a fused kernel (`fused=True`), with the settings that keep state between steps
FUSED = {"AdamW": (torch.optim.AdamW, {}), "Adam": (torch.optim.Adam, {"amsgrad": True}),
         "SGD momentum": (torch.optim.SGD, {"momentum": 0.9}), "SGD": (torch.optim.SGD, {}),
         "Adagrad": (torch.optim.Adagrad, {})}


def _skipping_run(name: str, on_device: bool, bad_steps=(1, 3)) -> list[tuple[torch.Tensor, dict]]:
    """Four steps of a fused optimizer whose `bad_steps` have a NaN gradient, skipped on the device (the deferred
    check's flag through Backend.optimizer_step) or by not stepping at all (the synchronous check); the parameters
    and the optimizer's state after each step."""
    from stoker.distributed.backends import Backend

    cls, kw = FUSED[name]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    opt, backend, seen = cls([p], lr=0.1, fused=True, **kw), Backend(PLAIN, None), []
    for step in range(1, 5):
        p.grad = torch.randn(6)
        if step in bad_steps:
            p.grad[0] = math.nan
        if on_device:
            backend.optimizer_step(opt, torch.tensor(float(step in bad_steps)))
        elif step not in bad_steps:
            backend.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        seen.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}))
    return seen


@pytest.mark.parametrize("name", FUSED)
def test_an_update_skipped_on_the_device_leaves_what_a_synchronous_skip_leaves(name):
    """The deferred check is taken only for a fused optimizer whose skip on the device is exact: a non-finite first
    step (its state not yet made) and a later one, skipped by the flag, leave the parameters after every step and
    the optimizer state after the next update exactly as not stepping does. Fused SGD with momentum is not exact:
    its skipped first step leaves an uninitialised (torch.empty_like) momentum buffer that the next step reads."""
    from stoker.distributed.backends import Backend

    cls, kw = FUSED[name]
    deferred = Backend(PLAIN, None).skips_on_device(
        cls([torch.nn.Parameter(torch.zeros(1))], fused=True, **kw))
    assert deferred is (name in ("AdamW", "Adam"))
    if not deferred:
        return
    synchronous, skipped = _skipping_run(name, False), _skipping_run(name, True)
    for (p, _), (q, _) in zip(synchronous, skipped, strict=True):
        assert torch.equal(p, q)
    state, other = synchronous[-1][1], skipped[-1][1]
    assert state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)
    assert float(state["step"]) == 2  # two updates applied of four steps


def test_fused_sgd_with_momentum_is_not_skipped_exactly_on_the_device(monkeypatch):
    """Why SGD is left out: the flag skips its first update but not the making of a momentum buffer from
    torch.empty_like, which the next update then reads as if it held a velocity. The memory is made to hold 1e3
    here: what the allocator hands back is whatever it held, often zeros in a fresh process, which the next update
    would read as no velocity at all (the same update by chance)."""
    synchronous = _skipping_run("SGD momentum", False, (1,))
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: empty_like(*a, **kw).fill_(1e3))
    skipped = _skipping_run("SGD momentum", True, (1,))
    monkeypatch.undo()
    assert torch.equal(synchronous[0][0], skipped[0][0])  # the skipped step itself changed nothing
    assert not torch.equal(synchronous[-1][0], skipped[-1][0])


def policy(nonfinite_policy="skip", max_nonfinite_steps=3, applied=False) -> NonFinitePolicy:
    backend = SimpleNamespace(update_applied_despite_nonfinite=lambda: applied)
    args = SimpleNamespace(nonfinite_policy=nonfinite_policy, max_nonfinite_steps=max_nonfinite_steps)
    return NonFinitePolicy(args, backend)


def test_the_policy_skips_counts_and_stops_after_too_many_in_a_row():
    log = LogSums(torch.device("cpu"))
    bad, good = StepVerdict(False, False, None, math.nan), StepVerdict(True, True, None, 1.0)
    skip = policy(max_nonfinite_steps=2)
    nan = torch.tensor(math.nan)
    assert not skip.allows(bad, log, nan, 1.0, 1, 0)
    assert skip.allows(good, log, torch.tensor(1.0), 1.0, 2, 0)  # a finite step ends the run of bad ones
    assert (log.nonfinite_run, log.nonfinite_total) == (0, 1)
    assert not skip.allows(bad, log, nan, 1.0, 3, 0)
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row"):
        skip.allows(bad, log, nan, 1.0, 4, 0)
    with pytest.raises(NonFiniteError, match="on another process .*nonfinite_policy='stop'"):
        policy("stop").allows(StepVerdict(False, True, None, math.nan), LogSums(torch.device("cpu")),
                              torch.tensor(1.0), 1.0, 1, 0)
    with pytest.raises(NonFiniteError, match="DeepSpeed has applied the update"):
        policy(applied=True).allows(bad, LogSums(torch.device("cpu")), nan, 1.0, 1, 0)


def test_the_halver_reruns_a_window_at_half_the_micro_batch_after_out_of_memory():
    pos = LoopPosition(epoch=0, batches=4, micro_batch=4, accumulation=2)
    state = SimpleNamespace(train_batch_size=4, global_step=3)
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None)
    window = [{"input_ids": torch.arange(8).view(4, 2)}, {"input_ids": torch.arange(8, 16).view(4, 2)}]
    shapes = []

    halver, ran = MicroBatchHalver(True, pos, state), window
    while ran[0]["input_ids"].shape[0] > 2:  # as Trainer._accumulate: out of memory at 4 rows, not at 2
        shapes.append([b["input_ids"].shape[0] for b in ran])
        ran = halver.retry(OOM, ran, optimizer)
    shapes.append([b["input_ids"].shape[0] for b in ran])
    assert shapes == [[4, 4], [2, 2, 2, 2]]
    with pytest.raises(ValueError, match="not memory"):
        halver.retry(ValueError("not memory"), ran, optimizer)
    assert torch.equal(torch.cat([b["input_ids"] for b in ran]), torch.arange(16).view(8, 2))  # the same rows
    assert (pos.micro_batch, pos.accumulation, pos.batches) == (2, 4, 8)
    with MicroBatchHalver(True, pos, state).after_update():  # out of memory in a callback: the next windows
        raise OOM
    assert (pos.micro_batch, pos.accumulation) == (1, 8)


def test_the_halver_raises_every_other_error_and_an_odd_micro_batch():
    state = SimpleNamespace(train_batch_size=3, global_step=0)
    with pytest.raises(ValueError, match="not memory"):
        with MicroBatchHalver(True, LoopPosition(0, 0, 4, 1), state).after_update():
            raise ValueError("not memory")
    with pytest.raises(RuntimeError, match="out of memory"):  # without auto_find_batch_size
        with MicroBatchHalver(False, LoopPosition(0, 0, 4, 1), state).after_update():
            raise OOM
    with pytest.raises(RuntimeError, match="can only halve an even micro-batch"):
        with MicroBatchHalver(True, LoopPosition(0, 0, 3, 1), state).after_update():
            raise OOM


def test_a_train_call_leaves_nothing_of_its_run_on_the_trainer(tiny_llama, clm_rows, make_args):
    from stoker import Trainer
    from stoker.checkpointer import Checkpointer

    trainer = Trainer(tiny_llama(), make_args(max_steps=2, save_strategy="steps", save_steps=1),
                      train_dataset=clm_rows(16))
    before = set(vars(trainer))
    trainer.train()
    per_run = (Run, Checkpointer, LogSums, LoopPosition, MicroBatchHalver, NonFinitePolicy, StepCheck)
    assert set(vars(trainer)) == before  # train() adds no attribute
    assert not [name for name, value in vars(trainer).items() if isinstance(value, per_run)]


def test_the_step_reads_in_one_screen():
    from stoker.trainer import Trainer

    assert len(inspect.getsource(Trainer._optimizer_step).splitlines()) <= 40


class StepProfile(TrainerCallback):
    """A callback that records the distinct named stoker functions (file, qualified name) entered from one
    on_step_begin to the next (sys.setprofile, this thread: the loop's own), comprehensions and lambdas left out;
    and, for each step, the files a reader following `Trainer._optimizer_step` moves into: those of the stoker
    functions that stoker code calls inside it (a function torch calls back, a schedule's rate, is where the
    library took the reader, not the step)."""

    def __init__(self):
        import os

        import stoker

        self.root, self.steps, self.files, self._current = os.path.dirname(stoker.__file__) + os.sep, [], [], None

    def _ours(self, code) -> bool:
        return code.co_filename.startswith(self.root) and not code.co_name.startswith("<")

    def _in_step(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "_optimizer_step":
                return True
            frame = frame.f_back
        return False

    def on_step_begin(self, args, state, control, **kw):
        import sys

        if self._current is not None:
            self.steps.append(self._current)
            self.files.append(self._files)
        self._current, self._files = set(), set()

        def profile(frame, event, arg):
            code = frame.f_code
            if event == "call" and self._ours(code):
                self._current.add((code.co_filename[len(self.root):], code.co_qualname))
                caller = frame.f_back
                if caller is not None and self._ours(caller.f_code) and self._in_step(frame):
                    self._files.add(code.co_filename[len(self.root):])

        sys.setprofile(profile)

    def on_train_end(self, args, state, control, **kw):
        import sys

        sys.setprofile(None)


def test_a_plain_step_enters_at_most_30_stoker_functions_in_5_files(tmp_path, monkeypatch):
    """The step reads as the normal path: tiny Llama, equal-length rows, no accumulation, nothing logged or saved,
    the default optimizer (fused AdamW, so the check is deferred): from one on_step_begin to the next a step enters
    at most 30 named stoker functions (52 in 13 files before the step was first redesigned, 35 in 10 before the run
    owned its state), its checks riding work the step already does, and a reader following _optimizer_step moves
    into at most 5 files: the step's (trainer.py), its pieces' (step.py), the callbacks', the backend's and the
    loss's. The synchronous check (another optimizer) adds nothing. Counted as in a fresh process: a compiled or GPU
    run earlier in the process leaves stoker's sdpa mask (stoker.sdpa_mask) registered with transformers, one more
    function in every later forward."""
    from transformers.masking_utils import AttentionMaskInterface

    from stoker import Trainer, sdpa_mask
    from tests.helpers.tiny_jobs import llama, rows

    mapping = AttentionMaskInterface._global_mapping
    if getattr(mapping["sdpa"], "_stoker_unpadded", False):
        monkeypatch.setitem(mapping, "sdpa", mapping["sdpa"].__wrapped__)
        monkeypatch.setitem(sdpa_mask._state, "installed", False)

    def profiled(**kw):
        profile = StepProfile()
        trainer = Trainer(llama(), TrainingArguments(str(tmp_path / "out"), report_to="none", disable_tqdm=True,
                                                     save_strategy="no", logging_steps=1000, max_steps=4,
                                                     per_device_train_batch_size=4, **kw),
                          train_dataset=rows(32, lo=16, hi=16), callbacks=[profile])
        trainer.train()
        return list(zip(profile.steps[1:], profile.files[1:], strict=True))  # step 1: the loss convention probes

    for step, files in profiled():
        assert len(step) <= 30, sorted(step)
        assert len(files) <= 5, sorted(files)
        assert ("step.py", "StepCheck.take") in step and ("trainer.py", "Trainer._record") in step
    for step, files in profiled(optim="adamw_torch"):  # not fused: the synchronous check
        assert len(step) <= 30, sorted(step)
        assert len(files) <= 5, sorted(files)
