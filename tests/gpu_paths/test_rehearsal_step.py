"""The GPU step's rehearsal: the first thing to run on a GPU (`python -m pytest tests/gpu_paths -k rehearsal`), and
on this CPU the same path with torch.cuda's capability queries answering as an H100 where the code reads them.

A run that asks for no precision, on an Ampere or newer GPU, is stoker's GPU default: float32 weights under bf16
autocast, TF32 for what autocast leaves in float32, and fused AdamW, whose non-finite steps the deferred check skips
on the device. Here that decision is made, then the run goes through it with a non-finite loss injected at one step,
and each boundary of the step's dtype flow is asserted: float32 master weights, bf16 matmul outputs and logits inside
the forward, a float32 loss, float32 gradients and optimizer state, the skip flag the fused optimizer reads (a
float32 scalar on the device, 1.0 only at the injected step), and the verdict: that step's update skipped whole
(parameters and step count as they were), counted and logged, the run going on. On a GPU nothing is mocked and the
run is on the device.
"""

from __future__ import annotations

import math

import torch

from stoker import Trainer, TrainerCallback, TrainingArguments
from tests.helpers.gpu_stand_ins import fake_gpu
from tests.helpers.tiny_jobs import llama, rows

ON_GPU = torch.cuda.is_available()
INJECTED = 2  # the step whose loss is made non-finite


def decided(monkeypatch, **kw) -> TrainingArguments:
    """The arguments of a run that asked for no precision, decided as on an H100 (mocked on a CPU)."""
    if not ON_GPU:
        fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    a = TrainingArguments(report_to="none", **kw)
    monkeypatch.undo()  # the run itself on this machine's device
    return a


class Boundaries(TrainerCallback):
    """The dtypes at each boundary of every step, the skip flag the fused optimizer was handed, and the parameters
    and step count around each update; a non-finite loss injected at step INJECTED (the output layer's logits made
    NaN, as an overflow would)."""

    def __init__(self, model):
        self.seen: dict[str, set] = {"weights": set(), "matmul": set(), "logits": set(), "grads": set(),
                                     "state": set()}
        self.flags, self.unchanged, self.step_counts, self.step, self.logs = {}, {}, {}, 0, []
        layer = model.model.layers[0].mlp.down_proj
        layer.register_forward_hook(lambda m, i, out: self.seen["matmul"].add(out.dtype))
        model.lm_head.register_forward_hook(self._logits)

    def _logits(self, module, inputs, out):
        self.seen["logits"].add(out.dtype)
        return out * math.nan if self.step == INJECTED and module.training else out

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        inner = getattr(optimizer, "optimizer", optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        inner.register_step_pre_hook(self._before_update)
        inner.register_step_post_hook(self._after_update)

    def on_step_begin(self, args, state, control, **kw):
        self.step = state.global_step + 1
        self.seen["weights"] |= {p.dtype for p in self.params}

    def _before_update(self, optimizer, *a):
        flag = getattr(optimizer, "found_inf", None)  # set only on the deferred path (Backend.optimizer_step)
        self.flags[self.step] = (flag.dtype, flag.device.type, float(flag)) if flag is not None else None
        self.seen["grads"] |= {p.grad.dtype for p in self.params if p.grad is not None}
        self._before = [p.detach().clone() for p in self.params]

    def _after_update(self, optimizer, *a):
        self.unchanged[self.step] = all(torch.equal(b, p) for b, p in zip(self._before, self.params, strict=True))
        states = [optimizer.state[p] for p in self.params]
        self.seen["state"] |= {v.dtype for s in states for k, v in s.items() if k != "step"}
        self.step_counts[self.step] = float(states[0]["step"])

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


class LossDtypes(Trainer):
    """stoker's Trainer, noting the dtype of the loss each training forward returns (its compute_loss, under
    autocast)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.__dict__.setdefault("loss_dtypes", set()).add((loss[0] if return_outputs else loss).dtype)
        return loss


def test_the_gpu_default_trains_float32_weights_under_bf16_autocast_and_skips_a_nonfinite_step_on_the_device(
        monkeypatch, tmp_path):
    a = decided(monkeypatch, output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                save_strategy="no", disable_tqdm=True, optim="adamw_torch_fused", learning_rate=1e-2)
    # the decision: bf16 autocast and TF32, said once; the run's optimizer is fused AdamW
    assert (a.bf16, a.fp16, a.mixed_precision, a.tf32) == (True, False, "bf16", True)
    assert a.gpu_default_notice.startswith("precision: bf16 autocast and TF32 matmuls on this GPU")
    model = llama()
    recorder = Boundaries(model)
    trainer = LossDtypes(model, a, train_dataset=rows(8), callbacks=[recorder])
    trainer.train()
    assert trainer._backend.skips_on_device(trainer.optimizer)  # the deferred check was this run's
    device = "cuda" if ON_GPU else "cpu"
    # the dtype flow: float32 master weights, gradients and state; bf16 where autocast computes; a float32 loss
    assert recorder.seen == {"weights": {torch.float32}, "matmul": {torch.bfloat16}, "logits": {torch.bfloat16},
                             "grads": {torch.float32}, "state": {torch.float32}}
    assert trainer.loss_dtypes == {torch.float32}
    # the skip flag rode every update, as the GradScaler's found_inf: 1.0 at the injected step only
    assert recorder.flags == {s: (torch.float32, device, float(s == INJECTED)) for s in range(1, 5)}
    # the verdict: that update skipped whole on the device (parameters and step count), the others applied
    assert recorder.unchanged == {1: False, 2: True, 3: False, 4: False}
    assert recorder.step_counts == {1: 1.0, 2: 1.0, 3: 2.0, 4: 3.0}
    steps = [log for log in recorder.logs if "loss" in log]
    assert len(steps) == 4 and math.isnan(steps[1]["loss"]) and steps[1]["nonfinite_steps_skipped"] == 1
    assert all(math.isfinite(log["loss"]) for i, log in enumerate(steps) if i != 1)
    assert trainer.state.global_step == 4
