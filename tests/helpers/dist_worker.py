"""One rank of the multi-process tests in tests/distributed/test_distributed.py, started by torchrun (CPU, gloo,
float32):

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dist_worker.py OUT SCENARIO [SCENARIO ...]

Every scenario trains the tiny Llama of tests/helpers/tiny_jobs.py and writes what the test compares under
OUT/<scenario>/: rank_<r>.json (what that rank saw: steps, logs, metrics, a digest of its parameters and RNG)
and, from rank 0 only, safetensors files of final parameters and predictions. The single-process references
are computed by the test itself with the same settings (see `training_args` and the data below).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from stoker import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from stoker.checkpointer import Checkpointer  # noqa: E402
from stoker.errors import TrainingPreempted  # noqa: E402
from tests.helpers.tiny_jobs import llama, rows  # noqa: E402

# 24 training rows = 3 optimizer steps of a global batch of 8; 7 and 3 held-out rows do not divide evenly
# over 2 processes, so Accelerate pads the last evaluation batch with duplicates.
TRAIN = rows(24, seed=5)
EVAL7 = rows(7, seed=6)
EVAL3 = rows(3, seed=7)


def training_args(out: str, **kw) -> TrainingArguments:
    """The settings every equivalence run shares (the test builds its single-process runs from this too). The
    linear schedule makes the update depend on the number of steps planned, which must count per process."""
    base = dict(output_dir=out, report_to="none", disable_tqdm=True, logging_steps=1, optim="sgd",
                learning_rate=0.5, lr_scheduler_type="linear", max_grad_norm=1.0, seed=7, save_strategy="no",
                per_device_eval_batch_size=2)
    return TrainingArguments(**{**base, **kw})


def token_metrics(p) -> dict:
    """Accuracy of next-token argmax over target positions, and the row count compute_metrics received."""
    preds, labels = torch.as_tensor(p.predictions), torch.as_tensor(p.label_ids)
    hit = (preds[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != -100)
    return {"rows": int(labels.shape[0]), "token_accuracy": hit.sum().item() / (labels[:, 1:] != -100).sum().item()}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def param_digest(model) -> str:
    return digest(p for _, p in sorted(model.named_parameters()))


def final_params(trainer) -> dict:
    return {n: p.detach().clone().contiguous() for n, p in trainer.accelerator.unwrap_model(
        trainer.model_wrapped).named_parameters()}


class Report:
    """Collects what this rank saw and writes OUT/<scenario>/rank_<r>.json."""

    def __init__(self, out: str, scenario: str):
        self.folder = os.path.join(out, scenario)
        os.makedirs(self.folder, exist_ok=True)
        self.rank = int(os.environ["RANK"])
        self.values = {"world_size": int(os.environ["WORLD_SIZE"])}

    def save_tensors(self, name: str, tensors: dict) -> None:
        if self.rank == 0:
            save_file(tensors, os.path.join(self.folder, f"{name}.safetensors"))

    def write(self) -> None:
        with open(os.path.join(self.folder, f"rank_{self.rank}.json"), "w") as f:
            json.dump(self.values, f, indent=1)


def gathered_state(trainer) -> dict | None:
    """The trained model's full state dict, gathered across shards on rank 0 (every rank must call it)."""
    return trainer._backend.state_dict_for_saving(trainer.model_wrapped)


def losses(trainer) -> list:
    return [[r["step"], r["loss"]] for r in trainer.state.log_history if "loss" in r]


# ---------------------------------------------------------------------------------------------------
# scenarios


def equivalence(out: str, per_device: int = 4, accumulation: int = 1, scenario: str = "equivalence",
                evaluate_first: bool = False) -> None:
    """2 x batch 4 (or 2 x batch 2 x accumulation 2): compared by the test with 1 x 8 and 1 x 2 x 4. With
    `evaluate_first`, evaluate() runs before train(), as the recipes do."""
    r = Report(out, scenario)
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=accumulation, num_train_epochs=1, save_strategy="steps",
                         save_steps=2)
    trainer = Trainer(llama(), args, train_dataset=TRAIN, eval_dataset=EVAL7)
    if evaluate_first:
        trainer.evaluate()
    trainer.train()
    r.values.update(global_step=trainer.state.global_step, max_steps=trainer.state.max_steps,
                    losses=losses(trainer), params=param_digest(trainer.model),
                    log_records=len(trainer.state.log_history), wrapper=type(trainer.model_wrapped).__name__)
    r.save_tensors("final", final_params(trainer))
    r.write()


def ddp_settings(out: str) -> None:
    """The ddp_* arguments as DDP and the process group received them. It must be a launch's first scenario:
    the process group (and its timeout) is set up by the first Trainer."""
    r = Report(out, "ddp_settings")
    args = training_args(os.path.join(r.folder, "out"), max_steps=1, ddp_find_unused_parameters=False,
                         ddp_bucket_cap_mb=5, ddp_broadcast_buffers=False, ddp_timeout=123)
    trainer = Trainer(llama(), args, train_dataset=TRAIN)
    trainer.train()
    ddp = trainer.model_wrapped
    backend = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    r.values.update(wrapper=type(ddp).__name__, find_unused_parameters=ddp.find_unused_parameters,
                    bucket_bytes_cap=ddp.bucket_bytes_cap, broadcast_buffers=ddp.broadcast_buffers,
                    timeout_s=backend.options._timeout.total_seconds(), backend=torch.distributed.get_backend())
    r.write()


def equivalence_accumulation(out: str) -> None:
    equivalence(out, per_device=2, accumulation=2, scenario="equivalence_accumulation")


def equivalence_after_evaluate(out: str) -> None:
    equivalence(out, scenario="equivalence_after_evaluate", evaluate_first=True)


def evaluation(out: str) -> None:
    """evaluate() and predict() on 7 rows (the last batch of rank 1 is half padding) and 3 rows (all of
    rank 1's only batch is padding), with compute_metrics."""
    r = Report(out, "evaluation")
    trainer = Trainer(llama(), training_args(os.path.join(r.folder, "out")), eval_dataset=EVAL7,
                      compute_metrics=token_metrics)
    r.values["eval7"] = trainer.evaluate()
    r.values["eval3"] = trainer.evaluate(EVAL3)
    pred = trainer.predict(EVAL7)
    r.values["predict7"] = pred.metrics
    r.save_tensors("predict7", {"predictions": torch.as_tensor(pred.predictions),
                                "label_ids": torch.as_tensor(pred.label_ids)})
    for v in r.values.values():  # runtimes differ between ranks; the test compares everything else
        if isinstance(v, dict):
            for k in [k for k in v if k.endswith(("_runtime", "_per_second"))]:
                del v[k]
    r.write()


class NanOnRankOne(Trainer):
    """Makes the loss of rank 1 (only) non-finite during step 2, without touching its gradients (a constant
    NaN added to the loss has no gradient): only rank 1's own check can see it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and self.state.global_step == 1 and self.accelerator.process_index == 1:
            nan = torch.tensor(float("nan"))
            result = (result[0] + nan, result[1]) if return_outputs else result + nan
        return result


def guards(out: str) -> None:
    """The non-finite guard and early stopping must decide the same on every rank."""
    r = Report(out, "guards")
    # greater_is_better on a falling eval_loss: every evaluation after the first is worse, except the one
    # after the skipped step 2, which equals it; patience 2 stops training at step 3
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, max_steps=6,
                         eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss",
                         greater_is_better=True)
    trainer = NanOnRankOne(llama(), args, train_dataset=TRAIN, eval_dataset=EVAL7,
                           callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    evals = [x["eval_loss"] for x in trainer.state.log_history if "eval_loss" in x]
    skipped = [x.get("nonfinite_steps_skipped", 0) for x in trainer.state.log_history if "learning_rate" in x]
    r.values.update(global_step=trainer.state.global_step, params=param_digest(trainer.model), eval_losses=evals,
                    nonfinite_steps_skipped=max(skipped), best_metric=trainer.state.best_metric)
    r.write()


def guards_deferred(out: str) -> None:
    """The deferred check on two ranks: with fused AdamW, rank 1's non-finite step 2 is skipped on the device on both
    ranks (the flags all-reduced in the step's one collective), its verdict read in step 3."""
    r = Report(out, "guards_deferred")
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, max_steps=5, logging_steps=5,
                         optim="adamw_torch_fused", learning_rate=1e-3, max_grad_norm=0.0)
    trainer = NanOnRankOne(llama(), args, train_dataset=TRAIN)
    trainer.train()
    log = next(x for x in trainer.state.log_history if "learning_rate" in x)
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    r.values.update(global_step=trainer.state.global_step, params=param_digest(trainer.model),
                    nonfinite_steps_skipped=log.get("nonfinite_steps_skipped", 0), learning_rate=log["learning_rate"],
                    optimizer_steps=sorted(steps))
    r.write()


class RankRng(TrainerCallback):
    """Draws rank+1 random numbers before the first step, so that every rank's RNG stream (and dropout mask)
    differs from the others; records each rank's torch RNG digest at every step; and, with `pause_at`, holds
    rank 1 after that step until the test has delivered a SIGTERM to it (and only to it)."""

    def __init__(self, report: Report, pause_at: int | None = None):
        self.report, self.pause_at = report, pause_at
        self.rng = {}

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 0:
            torch.rand(self.report.rank + 1)

    def on_step_end(self, args, state, control, **kw):
        self.rng[state.global_step] = digest([torch.get_rng_state()])
        if self.pause_at == state.global_step and self.report.rank == 1:
            with open(os.path.join(self.report.folder, "pid_1"), "w") as f:
                f.write(str(os.getpid()))
            flag = os.path.join(self.report.folder, "signal_sent")
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)


def rng_args(out: str, **kw) -> TrainingArguments:
    # 24 rows / (2 per device x 2 processes x accumulation 2) = 3 steps per epoch; 6 steps = 2 epochs
    return training_args(out, **{**dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                                        save_strategy="steps", save_steps=2, optim="adamw_torch",
                                        learning_rate=1e-2), **kw})


def dropout_llama():
    model = llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model


def rng_resume(out: str) -> None:
    """A run with dropout and per-rank RNG streams, then a second one resumed from its checkpoint-2."""
    r = Report(out, "rng_resume")
    rng = RankRng(r)
    full = Trainer(dropout_llama(), rng_args(os.path.join(r.folder, "out")), train_dataset=TRAIN, callbacks=[rng])
    full.train()
    resumed = Trainer(dropout_llama(), rng_args(os.path.join(r.folder, "resumed")), train_dataset=TRAIN,
                      callbacks=[RankRng(r)])
    resumed.train(resume_from_checkpoint=os.path.join(r.folder, "out", "checkpoint-2"))
    r.values.update(rng_at_step=rng.rng, losses=losses(full), resumed_losses=losses(resumed),
                    params=param_digest(full.model), resumed_params=param_digest(resumed.model))
    r.save_tensors("final", final_params(full))
    r.save_tensors("resumed", final_params(resumed))
    r.write()


class RandomMaskingCollator:
    """Pads as stoker's collator, then hides each target token with probability 0.3, drawn with torch in the
    loader's worker, as an MLM collator or an augmentation draws; draws one number from numpy and one from `random`
    too. Appends what the worker drew, with torch's seed for that worker (the loader's base seed + worker id,
    before any worker_init_fn) and the seed it drew with, to <folder>/draws_rank<r>.jsonl."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, features):
        import random

        import numpy as np

        from stoker.data import PaddingCollator

        batch = PaddingCollator()(features)
        info = torch.utils.data.get_worker_info()
        draws = torch.rand(batch["labels"].shape)
        batch["labels"] = batch["labels"].masked_fill(draws < 0.3, -100)
        if info is None:  # the Trainer's check of its first rows, in the main process
            return batch
        with open(self.path, "a") as f:
            f.write(json.dumps({"worker": info.id, "workers": info.num_workers, "torch_seed": info.seed,
                                "seed": torch.initial_seed(), "torch": draws.tolist(),
                                "numpy": float(np.random.rand()), "random": random.random()}) + "\n")
        return batch


def worker_seeds_args(out: str, **kw) -> TrainingArguments:
    # 24 rows / (2 per device x 2 processes x accumulation 2) = 3 steps per epoch; checkpoint-3 ends epoch 1
    return training_args(out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                         save_strategy="steps", save_steps=3, optim="adamw_torch", learning_rate=1e-2,
                         dataloader_num_workers=2, **kw)


def worker_seeds(out: str) -> None:
    """Two loader workers per rank whose collator masks labels at random: a run of 2 epochs, and a second one
    resumed from checkpoint-3 (the epoch boundary, where the workers start afresh)."""
    r = Report(out, "worker_seeds")
    runs = {}
    for name in ("full", "resumed"):
        collator = RandomMaskingCollator(os.path.join(r.folder, f"draws_{name}_rank{r.rank}.jsonl"))
        runs[name] = Trainer(llama(), worker_seeds_args(os.path.join(r.folder, name)), train_dataset=TRAIN,
                             data_collator=collator)
    runs["full"].train()
    runs["resumed"].train(resume_from_checkpoint=os.path.join(r.folder, "full", "checkpoint-3"))
    r.values.update(losses=losses(runs["full"]), resumed_losses=losses(runs["resumed"]),
                    params=param_digest(runs["full"].model), resumed_params=param_digest(runs["resumed"].model))
    r.write()


def preempt(out: str) -> None:
    """The rng_resume run, with rank 1 held after step 2 until the test has sent it SIGTERM."""
    r = Report(out, "preempt")
    trainer = Trainer(dropout_llama(), rng_args(os.path.join(r.folder, "out")), train_dataset=TRAIN,
                      callbacks=[RankRng(r, pause_at=2)])
    try:
        trainer.train()
    except TrainingPreempted as e:
        r.values.update(exit_code=e.code, step=e.step, signal=e.signum)
        r.write()
        # torchrun's agent sends SIGTERM to the other workers as soon as one exits non-zero; the checkpoint is
        # committed by now, and ignoring that signal lets this rank, too, exit with its own code
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise
    r.values["exit_code"] = 0
    r.write()


class SignalSelfAfter(TrainerCallback):
    """Rank 1 sends itself SIGTERM at the end of step `step`; rank 0 receives nothing."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def preempt_deferred(out: str) -> None:
    """Fused AdamW (the check deferred), rank 1 alone signalled at the end of step 2: its signal rides step 3's
    flags, which every rank reads in step 4; both checkpoint step 4 and exit with 75."""
    r = Report(out, "preempt_deferred")
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=2, max_steps=8,
                         optim="adamw_torch_fused", learning_rate=1e-3, logging_steps=1000)
    trainer = Trainer(llama(), args, train_dataset=TRAIN, callbacks=[SignalSelfAfter(2)])
    try:
        trainer.train()
    except TrainingPreempted as e:
        r.values.update(exit_code=e.code, step=e.step, signal=e.signum)
        r.write()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as preempt: torchrun's SIGTERM to the others is ignored
        raise
    r.values["exit_code"] = 0
    r.write()


def preempt_resume(out: str) -> None:
    """Resume the preempted run (resume_from_checkpoint=True) to its end."""
    r = Report(out, "preempt_resume")
    trainer = Trainer(dropout_llama(), rng_args(os.path.join(out, "preempt", "out")), train_dataset=TRAIN,
                      callbacks=[RankRng(r)])
    trainer.train(resume_from_checkpoint=True)
    r.values.update(global_step=trainer.state.global_step, max_steps=trainer.state.max_steps,
                    losses=losses(trainer), params=param_digest(trainer.model))
    r.save_tensors("final", final_params(trainer))
    r.write()


def save_failure(out: str) -> None:
    """Rank 1 alone cannot write its part of checkpoint-2 (its safetensors file goes to a folder that does not
    exist: safetensors raises its own error, not an OSError): every rank must raise, none may wait for the
    others forever, and the partial folder goes."""
    from stoker import checkpoint_format as ckpt

    r = Report(out, "save_failure")
    real = ckpt.save_state

    def unwritable(folder, name, obj, *rest):
        return real(os.path.join(folder, "missing") if name == "process_1" and folder.endswith("checkpoint-2")
                    else folder, name, obj, *rest)

    ckpt.save_state = unwritable
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, num_train_epochs=1,
                         save_strategy="steps", save_steps=1)
    trainer = Trainer(llama(), args, train_dataset=TRAIN)
    try:
        trainer.train()
    except ckpt.CheckpointError as e:
        r.values["error"] = str(e)
    finally:
        ckpt.save_state = real
    r.values["step"] = trainer.state.global_step
    r.write()


def fsdp_on_cpu(trainer, version: int = 2, **fsdp_config) -> None:
    """Test-only fixture: the FSDP state Accelerate sets up on GPUs, set up here on the CPU (gloo). Accelerate
    enables FSDP only on accelerators (on the CPU it silently keeps DDP, and stoker refuses fsdp there), but
    its FSDP paths (fully_shard, or FullyShardedDataParallel, over the process group) run on gloo. The plugin
    comes from stoker's own translation of fsdp='full_shard' with fsdp_config version 2 or 1 (and
    `fsdp_config`), as a GPU run would build it."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from stoker.distributed.backends import backend_for
    from stoker.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs

    precision = trainer.args.mixed_precision
    kwargs, problems = fsdp_plugin_kwargs("full_shard", {"version": version, **fsdp_config}, model=trainer.model,
                                          mixed_precision=precision)
    assert not problems, problems
    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ does
    state.fsdp_plugin = fsdp_plugin(kwargs)
    if precision != "no":
        state.fsdp_plugin.set_mixed_precision(precision)  # as AcceleratorState.__init__ does
    if version == 1:  # FullyShardedDataParallel's CPU compute device is "cpu"; Accelerate's gloo device "cpu:0"
        PartialState._shared_state["device"] = state.device = torch.device("cpu")
    assert trainer.accelerator.is_fsdp2 == (version == 2)
    # the Trainer's backend object follows the Accelerate state it was made from: made again for this one
    trainer._backend = backend_for(trainer.accelerator, trainer.args)


def skipped_steps(trainer) -> int:
    """Non-finite steps skipped so far, as the last log reports them (logging_steps=1)."""
    return max((r.get("nonfinite_steps_skipped", 0) for r in trainer.state.log_history), default=0)


def fsdp_args(out: str, **kw) -> TrainingArguments:
    return training_args(out, **{**dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                        num_train_epochs=1, optim="adamw_torch", learning_rate=1e-2,
                                        weight_decay=0.1), **kw})


def fsdp2(out: str) -> None:
    """The ddp_adamw run (2 processes x batch 2 x accumulation 2: the non-final micro-batches skip FSDP's
    gradient reduce-scatter) sharded with FSDP2 and compared by the test with it, saved with save_model. Its
    checkpoint-2 (state_dict_type FULL_STATE_DICT, the default: shards and the full model) is resumed, after an
    evaluate(), by a run with SHARDED_STATE_DICT, whose checkpoint-3 holds shards only; that run then loads
    checkpoint-2's model weights alone (as load_best_model_at_end does). It must be the launch's last scenario:
    the fixture leaves the process's Accelerate state set to FSDP."""
    r = Report(out, "fsdp2")
    args = fsdp_args(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=2)
    full = Trainer(llama(), args, train_dataset=TRAIN)
    fsdp_on_cpu(full)
    full.train()
    params = list(full.model_wrapped.parameters())
    r.values.update(
        dtensors=all(type(p).__name__ == "DTensor" for p in params),
        local_numel=sum(p.to_local().numel() for p in params), total_numel=sum(p.numel() for p in params),
        losses=losses(full), global_step=full.state.global_step)
    gathered = gathered_state(full)  # the full model, on rank 0
    full.save_model(os.path.join(r.folder, "saved"))  # one full safetensors model, for transformers
    checkpoint_2 = os.path.join(r.folder, "out", "checkpoint-2")
    resumed = Trainer(llama(), fsdp_args(os.path.join(r.folder, "resumed"), save_strategy="steps", save_steps=3),
                      train_dataset=TRAIN)
    fsdp_on_cpu(resumed, state_dict_type="SHARDED_STATE_DICT")
    resumed.evaluate(EVAL7)  # before train(), its evaluation-only placement must not keep FSDP from sharding
    resumed.train(resume_from_checkpoint=checkpoint_2)
    gathered_resumed = gathered_state(resumed)
    r.values["resumed_losses"] = losses(resumed)
    r.values["resumed_dtensors"] = all(type(p).__name__ == "DTensor" for p in resumed.model_wrapped.parameters())
    resumed._backend.load_weights(checkpoint_2, resumed.model_wrapped)
    gathered_step_2 = gathered_state(resumed)
    if r.rank == 0:
        for name, tensors in (("final", gathered), ("resumed", gathered_resumed), ("step_2", gathered_step_2)):
            r.save_tensors(name, {k: v.contiguous() for k, v in tensors.items()})
    r.write()


def fsdp1(out: str) -> None:
    """FSDP1 (FullyShardedDataParallel) with use_orig_params=False: the parameters become flat shards, and the
    optimizer must be built on those. A DDP run of the same settings first (without weight decay: FSDP1's flat
    parameters mix norms and weights, so they form one group), then the FSDP1 run, then a run resumed from
    its sharded checkpoint-2. It must come after every DDP scenario (see fsdp2)."""
    r = Report(out, "fsdp1")
    settings = dict(weight_decay=0.0, save_strategy="steps", save_steps=2)
    ddp = Trainer(llama(), fsdp_args(os.path.join(r.folder, "ddp"), **settings), train_dataset=TRAIN)
    ddp.train()
    fsdp_config = dict(use_orig_params=False, sync_module_states=False)  # Accelerate's sync needs a GPU; the
    # ranks build the same model anyway
    full = Trainer(llama(), fsdp_args(os.path.join(r.folder, "out"), **settings), train_dataset=TRAIN)
    fsdp_on_cpu(full, version=1, **fsdp_config)
    full.train()
    flat = list(full.model_wrapped.parameters())
    r.values.update(ddp_losses=losses(ddp), losses=losses(full), wrapper=type(full.model_wrapped).__name__,
                    local_numel=sum(p.numel() for p in flat),
                    total_numel=sum(p.numel() for p in llama().parameters()),
                    optimizer_on_flat=sorted(id(p) for g in full.optimizer.param_groups for p in g["params"])
                    == sorted(map(id, flat)))
    gathered = gathered_state(full)
    try:
        full.train()
    except RuntimeError as e:
        r.values["second_train"] = str(e)
    resumed = Trainer(llama(), fsdp_args(os.path.join(r.folder, "resumed"), **settings), train_dataset=TRAIN)
    fsdp_on_cpu(resumed, version=1, **fsdp_config)
    resumed.train(resume_from_checkpoint=os.path.join(r.folder, "out", "checkpoint-2"))
    r.values["resumed_losses"] = losses(resumed)
    gathered_resumed = gathered_state(resumed)
    if r.rank == 0:
        r.save_tensors("ddp", final_params(ddp))
        for name, tensors in (("final", gathered), ("resumed", gathered_resumed)):
            r.save_tensors(name, {k: v.contiguous() for k, v in tensors.items()})
    r.write()


def lora_fsdp2(out: str) -> None:
    """A LoRA adapter on the FSDP2-sharded tiny Llama, with state_dict_type SHARDED_STATE_DICT: checkpoint-2 holds
    the adapter (for peft; it is small) and the shards of the trainable parameters only; a run resumed from it
    ends where the uninterrupted one ended; save_model writes the adapter. It must follow every DDP scenario
    (see fsdp2)."""
    from peft import LoraConfig

    r = Report(out, "lora_fsdp2")

    def trainer(folder: str, **kw) -> Trainer:
        t = Trainer(llama(), fsdp_args(os.path.join(r.folder, folder), **kw), train_dataset=TRAIN,
                    peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        fsdp_on_cpu(t, state_dict_type="SHARDED_STATE_DICT")
        return t

    full = trainer("out", save_strategy="steps", save_steps=2)
    full.train()
    adapter = gathered_state(full)  # the trainable parameters, gathered on rank 0
    full.save_model(os.path.join(r.folder, "saved"))
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=os.path.join(r.folder, "out", "checkpoint-2"))
    r.values.update(losses=losses(full), resumed_losses=losses(resumed))
    if r.rank == 0:
        r.save_tensors("final", {k: v.contiguous() for k, v in adapter.items()})
        r.save_tensors("resumed", {k: v.contiguous() for k, v in gathered_state(resumed).items()})
    else:
        gathered_state(resumed)
    r.write()


def async_fsdp2(out: str) -> None:
    """The fsdp2 run's first Trainer with async_save, each background write held until the loop has taken the
    next step (tests/integration/test_async_save.py's Gate): its checkpoint-2 is compared by the test with the
    synchronous one of fsdp2, and a run resumed from it ends where it ended. It must follow every DDP scenario
    (see fsdp2)."""
    import pytest

    from tests.integration.test_async_save import Gate

    r = Report(out, "async_fsdp2")
    patches = pytest.MonkeyPatch()
    Gate(patches)
    try:
        full = Trainer(llama(), fsdp_args(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=2,
                                          async_save=True), train_dataset=TRAIN)
        fsdp_on_cpu(full)
        full.train()
        gathered = gathered_state(full)
        resumed = Trainer(llama(), fsdp_args(os.path.join(r.folder, "resumed"), async_save=True), train_dataset=TRAIN)
        fsdp_on_cpu(resumed)
        resumed.train(resume_from_checkpoint=os.path.join(r.folder, "out", "checkpoint-2"))
        gathered_resumed = gathered_state(resumed)
    finally:
        patches.undo()
    r.values.update(losses=losses(full), resumed_losses=losses(resumed))
    if r.rank == 0:
        for name, tensors in (("final", gathered), ("resumed", gathered_resumed)):
            r.save_tensors(name, {k: v.contiguous() for k, v in tensors.items()})
    r.write()


def async_kill(out: str) -> None:
    """The rng_resume run with async_save: rank 1 is SIGKILLed by its writer thread while it writes its part of
    checkpoint-4 in the background (torchrun then stops rank 0). Run alone: the launch fails."""
    from stoker import checkpoint_format as ckpt

    r = Report(out, "async_kill")
    real = ckpt.save_state

    def killed(folder, name, obj, *rest):
        if r.rank == 1 and name == "process_1" and folder.endswith("checkpoint-4"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(folder, name, obj, *rest)

    ckpt.save_state = killed
    Trainer(dropout_llama(), rng_args(os.path.join(r.folder, "out"), async_save=True), train_dataset=TRAIN,
            callbacks=[RankRng(r)]).train()


def async_kill_resume(out: str) -> None:
    """Resume the killed async_kill run (resume_from_checkpoint=True) to its end."""
    r = Report(out, "async_kill_resume")
    trainer = Trainer(dropout_llama(), rng_args(os.path.join(out, "async_kill", "out"), async_save=True),
                      train_dataset=TRAIN, callbacks=[RankRng(r)])
    trainer.train(resume_from_checkpoint=True)
    r.values.update(global_step=trainer.state.global_step, losses=losses(trainer))
    r.save_tensors("final", final_params(trainer))
    r.write()


def spike(out: str) -> None:
    """spike_rollback on 2 processes x micro-batch 2 x accumulation 2 (a global batch of 8, in the sequential
    order): step 6's window holds a poisoned row on rank 1. Every rank rolls back to step 4 together, each names
    the same 8 rows (with the rank that trained each), and the run goes on without them; the test compares it
    with one process on the data without those rows, and resumes its checkpoint-8 on one process."""
    from stoker.rollback import SpikeRollback
    from tests.helpers.rollback_jobs import HEAL, Regressor, args
    from tests.helpers.rollback_jobs import rows as regression_rows

    r = Report(out, "spike")
    named, quarantine = [], SpikeRollback.quarantine

    def spy(self, found):
        record = quarantine(self, found)
        named.append(record)
        return record

    SpikeRollback.quarantine = spy
    try:
        trainer = Trainer(Regressor(), args(os.path.join(r.folder, "out"), per_device_train_batch_size=2,
                                            gradient_accumulation_steps=2, save_strategy="steps", save_steps=8,
                                            **HEAL),
                          train_dataset=regression_rows(poisoned={43}))
        trainer.train()
    finally:
        SpikeRollback.quarantine = quarantine
    r.values.update(records=[{k: v for k, v in rec.items() if k != "run_id"} for rec in named],
                    losses=losses(trainer), global_step=trainer.state.global_step)
    r.save_tensors("final", {k: v.detach().contiguous() for k, v in trainer.model.named_parameters()})
    r.write()


def spike_fsdp2(out: str) -> None:
    """spike_rollback under FSDP2 (2 processes x micro-batch 1 x accumulation 2): each process snapshots and
    restores its own shards of the weights and the optimizer state; step 7's window (rows 24-27) holds a poisoned
    row. The test compares the gathered model with one process on the data without the window's rows."""
    from tests.helpers.rollback_jobs import HEAL, args, clm, poisoned_loss
    from tests.helpers.rollback_jobs import llama as seeded_llama

    r = Report(out, "spike_fsdp2")
    trainer = Trainer(seeded_llama(), args(os.path.join(r.folder, "out"), per_device_train_batch_size=1,
                                           gradient_accumulation_steps=2, max_steps=10, learning_rate=1e-2, **HEAL),
                      train_dataset=clm(48, poisoned={25}), compute_loss_func=poisoned_loss)
    fsdp_on_cpu(trainer)
    trainer.train()
    r.values.update(losses=losses(trainer), dtensors=all(type(p).__name__ == "DTensor"
                                                         for p in trainer.model_wrapped.parameters()))
    gathered = gathered_state(trainer)
    if r.rank == 0:
        r.save_tensors("final", {k: v.contiguous() for k, v in gathered.items()})
    r.write()


def without_deepspeed_shm_build() -> None:
    """Test-only: DeepSpeed compiles a shared-memory fast path for collectives within a node on first use (C++,
    about 40 s on 2 cores); the gloo process group serves without it."""
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def deepspeed_config(stage: int, **more) -> dict:
    return {"zero_optimization": {"stage": stage, **more.pop("zero", {})}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto", **more}


def resumed_run(r: Report, folder: str, args_of, checkpoint: str = "checkpoint-2") -> Trainer:
    trainer = Trainer(llama(), args_of(os.path.join(r.folder, folder)), train_dataset=TRAIN)
    trainer.train(resume_from_checkpoint=os.path.join(r.folder, "out", checkpoint))
    return trainer


def zero2(out: str) -> None:
    """ZeRO-2 with the equivalence settings (2 processes x batch 2 x accumulation 2, SGD, linear schedule),
    compared by the test with 1 x batch 8; evaluated; resumed from its checkpoint-2."""
    without_deepspeed_shm_build()
    r = Report(out, "zero2")

    def args_of(folder: str, **kw) -> TrainingArguments:
        return training_args(folder, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
                             deepspeed=deepspeed_config(2), **kw)

    trainer = Trainer(llama(), args_of(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=2),
                      train_dataset=TRAIN, eval_dataset=EVAL7)
    trainer.train()
    r.values.update(distributed_type=str(trainer.accelerator.distributed_type), losses=losses(trainer),
                    eval=trainer.evaluate(), global_step=trainer.state.global_step, total_flos=trainer.state.total_flos)
    try:
        trainer.train()
    except RuntimeError as e:
        r.values["second_train"] = str(e)
    r.save_tensors("final", final_params(trainer))
    resumed = resumed_run(r, "resumed", args_of)
    r.values["resumed_losses"] = losses(resumed)
    r.save_tensors("resumed", final_params(resumed))
    r.write()


def zero3(out: str) -> None:
    """ZeRO-3 (every parameter partitioned) with the settings of zero2, compared by the test with 1 x batch 8;
    saved with save_model; resumed from its checkpoint-2; then checkpoint-2's weights loaded alone (as
    load_best_model_at_end does)."""
    without_deepspeed_shm_build()
    r = Report(out, "zero3")
    config = deepspeed_config(3, zero={"stage3_param_persistence_threshold": 0})

    def args_of(folder: str, **kw) -> TrainingArguments:
        return training_args(folder, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
                             deepspeed=config, **kw)

    trainer = Trainer(llama(), args_of(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=2),
                      train_dataset=TRAIN)
    trainer.train()
    params = list(trainer.model_wrapped.parameters())
    r.values.update(losses=losses(trainer), local_numel=sum(p.ds_tensor.numel() for p in params),
                    total_numel=sum(p.ds_numel for p in params), total_flos=trainer.state.total_flos)
    final = gathered_state(trainer)  # gathered on rank 0
    trainer.save_model(os.path.join(r.folder, "saved"))
    resumed = resumed_run(r, "resumed", args_of)
    r.values["resumed_losses"] = losses(resumed)
    resumed_final = gathered_state(resumed)
    resumed._backend.load_weights(os.path.join(r.folder, "out", "checkpoint-2"), resumed.model_wrapped)
    step_2 = gathered_state(resumed)
    bad = os.path.join(r.folder, "bad")  # one tensor missing, one of another shape
    if r.rank == 0:
        from safetensors.torch import load_file

        weights = load_file(os.path.join(r.folder, "out", "checkpoint-2", "model.safetensors"))
        del weights["model.norm.weight"]
        weights["lm_head.weight"] = weights["lm_head.weight"][:8]
        os.makedirs(bad)
        save_file(weights, os.path.join(bad, "model.safetensors"))
    resumed.accelerator.wait_for_everyone()
    try:
        resumed._backend.load_weights(bad, resumed.model_wrapped)
    except Exception as e:
        r.values["bad_fit"] = f"{type(e).__name__}: {e}"
    if r.rank == 0:
        for name, tensors in (("final", final), ("resumed", resumed_final), ("step_2", step_2)):
            r.save_tensors(name, {k: v.contiguous() for k, v in tensors.items()})
    r.write()


def lora_zero3(out: str) -> None:
    """A LoRA adapter on the tiny Llama under ZeRO-3 with every parameter (the adapter's too) partitioned:
    saved with save_model, resumed from checkpoint-2 and saved again."""
    from peft import LoraConfig

    without_deepspeed_shm_build()
    r = Report(out, "lora_zero3")
    config = deepspeed_config(3, zero={"stage3_param_persistence_threshold": 0})

    def trainer(folder: str, **kw) -> Trainer:
        return Trainer(llama(), fsdp_args(os.path.join(r.folder, folder), deepspeed=config, **kw), train_dataset=TRAIN,
                       peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    full = trainer("out", save_strategy="steps", save_steps=2)
    full.train()
    full.save_model(os.path.join(r.folder, "saved"))
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=os.path.join(r.folder, "out", "checkpoint-2"))
    resumed.save_model(os.path.join(r.folder, "resumed_saved"))
    # as load_best_model_at_end does
    resumed._backend.load_weights(os.path.join(r.folder, "out", "checkpoint-2"), resumed.model_wrapped)
    resumed.save_model(os.path.join(r.folder, "step_2_saved"))
    r.values.update(losses=losses(full), resumed_losses=losses(resumed))
    r.write()


def zero_nonfinite(out: str) -> None:
    """A NaN gradient at step 2 under ZeRO-2 and ZeRO-3 (only rank 1's, before the reduction), with the default
    policy (skip) and with nonfinite_policy='stop'."""
    from stoker.checkpointer import parameters_finite
    from stoker.errors import NonFiniteError

    without_deepspeed_shm_build()
    r = Report(out, "zero_nonfinite")

    class NanAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.poison = state.global_step == 1 and r.rank == 1

    for stage in (2, 3):
        for policy in ("skip", "stop"):
            callback, model = NanAtStep2(), llama()
            model.model.norm.weight.register_hook(lambda g, c=callback: g * float("nan") if c.poison else g)
            args = fsdp_args(os.path.join(r.folder, f"{stage}_{policy}"), nonfinite_policy=policy,
                             deepspeed=deepspeed_config(stage, zero={"stage3_param_persistence_threshold": 0}))
            trainer = Trainer(model, args, train_dataset=TRAIN, callbacks=[callback])
            try:
                trainer.train()
                outcome = {"steps": trainer.state.global_step, "nonfinite": skipped_steps(trainer),
                           "finite": parameters_finite(trainer.accelerator, trainer.model_wrapped)}
                if stage == 3 and policy == "skip":  # rank 1's partition made non-finite: every rank refuses
                    if r.rank == 1:
                        next(iter(trainer.model_wrapped.parameters())).ds_tensor.data.fill_(float("inf"))
                    try:
                        # refused before any part of the run is read: its model is all a save looks at first
                        Checkpointer(args, trainer._backend, "refused", len(TRAIN)).save(SimpleNamespace(
                            model=trainer.model_wrapped, optimizer=trainer.optimizer, state=trainer.state))
                    except NonFiniteError as e:
                        outcome["save"] = str(e)
            except NonFiniteError as e:
                outcome = {"error": str(e)}
            r.values[f"{stage}_{policy}"] = outcome
    r.write()


def zero1_config_sections(out: str) -> None:
    """ZeRO-1 with the optimizer and schedule of the DeepSpeed config (as recipes/ds_zero2.json has them, with
    torch's AdamW): built by DeepSpeed, filled from the arguments, stepped by its engine; resumed exactly."""
    without_deepspeed_shm_build()
    r = Report(out, "zero1_config_sections")
    config = deepspeed_config(
        1, optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                 "weight_decay": "auto", "torch_adam": True}},
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}})

    def args_of(folder: str, **kw) -> TrainingArguments:
        return fsdp_args(folder, deepspeed=config, warmup_steps=2, **kw)

    trainer = Trainer(llama(), args_of(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=2),
                      train_dataset=TRAIN)
    trainer.train()
    engine = trainer.model_wrapped
    r.values.update(losses=losses(trainer), optimizer=type(engine.optimizer.optimizer).__name__,
                    scheduler=type(engine.lr_scheduler).__name__,
                    learning_rates=[x["learning_rate"] for x in trainer.state.log_history if "learning_rate" in x])
    r.save_tensors("final", final_params(trainer))
    resumed = resumed_run(r, "resumed", args_of)
    r.values["resumed_losses"] = losses(resumed)
    r.save_tensors("resumed", final_params(resumed))
    # a "scheduler" section alone: DeepSpeed's schedule over stoker's optimizer
    del config["optimizer"]
    only_schedule = Trainer(llama(), args_of(os.path.join(r.folder, "only_schedule")), train_dataset=TRAIN)
    only_schedule.train()
    engine = only_schedule.model_wrapped
    r.values["only_schedule"] = {
        "optimizer": type(engine.optimizer.optimizer).__name__, "scheduler": type(engine.lr_scheduler).__name__,
        "learning_rates": [x["learning_rate"] for x in only_schedule.state.log_history if "learning_rate" in x]}
    r.write()


def fsdp_save_failure(out: str) -> None:
    """FSDP2, with rank 1's shard writes failing at checkpoint-2: torch.distributed.checkpoint raises on every
    rank, and so must the Trainer (a CheckpointError), leaving no partial folder."""
    from torch.distributed.checkpoint import hf_storage

    from stoker import checkpoint_format as ckpt

    r = Report(out, "fsdp_save_failure")
    real = hf_storage.HuggingFaceStorageWriter.write_data

    def failing(self, plan, planner):
        if r.rank == 1 and "checkpoint-2" in str(self.path):
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    hf_storage.HuggingFaceStorageWriter.write_data = failing
    trainer = Trainer(llama(), fsdp_args(os.path.join(r.folder, "out"), save_strategy="steps", save_steps=1),
                      train_dataset=TRAIN)
    fsdp_on_cpu(trainer)
    try:
        trainer.train()
    except ckpt.CheckpointError as e:
        r.values["error"] = str(e)
    finally:
        hf_storage.HuggingFaceStorageWriter.write_data = real
    r.values["step"] = trainer.state.global_step
    r.write()


def families(out: str) -> None:
    """Every model family of tests/parity/families.py, 2 x batch 4 over 16 rows: compared by the test with one
    process x batch 8."""
    from tests.parity.families import FAMILIES, params, train_family

    r = Report(out, "families")
    for name in FAMILIES:
        trainer = train_family(name, os.path.join(r.folder, name), 16, per_device_train_batch_size=4)
        r.values[name] = {"global_step": trainer.state.global_step, "params": param_digest(trainer.model),
                          "losses": losses(trainer)}
        r.save_tensors(name, params(trainer))
    r.write()


def shared_prefix(out: str) -> None:
    """Rows that start alike with shared_prefix=True, 2 x batch 4 over 3 steps: compared by the test with one
    process x batch 8 without sharing. The prefix's forward runs outside DDP's wrapper, its backward inside."""
    from tests.helpers.tiny_jobs import PREFIX, prompt_rows
    from tests.unit.loss.test_prefix import EmbeddingShapes

    r = Report(out, "shared_prefix")
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, max_steps=3,
                         shared_prefix=True)
    trainer = Trainer(llama(), args, train_dataset=prompt_rows(24, seed=5), callbacks=[shapes := EmbeddingShapes()])
    trainer.train()
    r.values.update(global_step=trainer.state.global_step, losses=losses(trainer), params=param_digest(trainer.model),
                    prefix_forwards=shapes.shapes.count((1, len(PREFIX))))
    r.save_tensors("final", final_params(trainer))
    r.write()


def moe_args(out: str, **kw) -> TrainingArguments:
    """moe_aux_loss_scope='global_batch' over 2 steps of 8 rows of MOE_ROWS (the test's single-process runs too)."""
    return training_args(out, **{**dict(max_steps=2, moe_aux_loss_scope="global_batch", learning_rate=0.1,
                                         max_grad_norm=0.0, lr_scheduler_type="constant"), **kw})


def moe(out: str) -> None:
    """moe_aux_loss_scope='global_batch', 2 x batch 4 (and 2 x 2 x accumulation 2): the MoE models of
    tests/parity/families.py, compared by the test with one process x batch 8. Then with
    average_tokens_across_devices=False (each process's cross-entropy a mean over its own tokens, averaged by DDP)
    for one step, whose update is computed here by hand from the rows each rank trained on: the processes' mean
    cross-entropy plus coef x the aux loss of all their rows as one batch (transformers' load_balancing_loss_func
    of the whole window)."""
    import copy

    from stoker.data import PaddingCollator
    from tests.parity.families import MOE, MOE_ROWS, moe_model, params

    r = Report(out, "moe")
    # batch 4 (the window's routing counted in its training forward), and 2 x accumulation 2 (a routing pass)
    layouts = [(n, n, {"per_device_train_batch_size": 4}) for n in MOE]
    layouts.append(("qwen2_moe_accumulation", "qwen2_moe",
                    {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}))
    for run, name, layout in layouts:
        args = moe_args(os.path.join(r.folder, run), **layout)
        trainer = Trainer(moe_model(name), args, train_dataset=MOE_ROWS)
        trainer.train()
        r.values[run] = {"global_step": trainer.state.global_step, "params": param_digest(trainer.model),
                         "losses": losses(trainer)}
        r.save_tensors(run, params(trainer))

    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    args = moe_args(os.path.join(r.folder, "per_process"), per_device_train_batch_size=4, max_steps=1,
                    average_tokens_across_devices=False)
    by_hand = moe_model("qwen2_moe")
    trainer = Recording(copy.deepcopy(by_hand), args, train_dataset=MOE_ROWS)
    trainer.train()
    batch, coef = seen[0], by_hand.router_aux_loss_coef
    own = by_hand(**batch)
    (own.loss - coef * own.aux_loss).backward()  # this rank's mean cross-entropy
    with torch.no_grad():
        for p in by_hand.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= 2
    mine = [{k: batch[k][i][batch["attention_mask"][i].bool()].tolist() for k in ("input_ids", "labels")}
            for i in range(len(batch["input_ids"]))]
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, mine)
    window = PaddingCollator(0, always_mask=True)([row for rows_of in everyone for row in rows_of])
    (coef * by_hand(**window).aux_loss).backward()  # the same on every rank: the global batch's
    with torch.no_grad():
        for p in by_hand.parameters():
            p -= args.learning_rate * p.grad
    trained = dict(trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters())
    r.values["per_process"] = {
        "tokens": int((batch["labels"][:, 1:] != -100).sum()),
        "max_difference": max((p - trained[n]).abs().max().item() for n, p in by_hand.named_parameters())}
    r.write()


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def placement(out: str) -> None:
    """FSDP2 under bf16 on two ranks: the mixed precision policy fully_shard got, and the full model gathered for
    saving (its shards are in CPU memory here, as an offloaded GPU run's are): where each rank holds it. The
    fixture leaves the process's Accelerate state set to FSDP: the launch's last scenario."""
    r = Report(out, "placement")
    trainer = Trainer(llama(), fsdp_args(os.path.join(r.folder, "out"), bf16=True, max_steps=1), train_dataset=TRAIN)
    fsdp_on_cpu(trainer)
    trainer.train()
    policy = trainer.model_wrapped._get_fsdp_state()._mp_policy
    gathered = gathered_state(trainer)
    r.values.update(param_dtype=str(policy.param_dtype), reduce_dtype=str(policy.reduce_dtype),
                    gathered_keys=len(gathered), gathered_devices=sorted({v.device.type for v in gathered.values()}),
                    gathered_numel=sum(v.numel() for v in gathered.values()),
                    total_numel=sum(p.numel() for p in trainer.model_wrapped.parameters()))
    r.write()


def iterable(out: str) -> None:
    """An IterableDataset for training (max_steps), evaluation and prediction: compared by the test with one
    process reading the same stream in batches of 8."""
    r = Report(out, "iterable")
    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, max_steps=3,
                         lr_scheduler_type="constant")
    trainer = Trainer(llama(), args, train_dataset=Stream(TRAIN))
    trainer.train()
    pred = trainer.predict(Stream(EVAL7))
    r.values.update(global_step=trainer.state.global_step, losses=losses(trainer), test_loss=pred.metrics["test_loss"])
    r.save_tensors("final", final_params(trainer))
    r.save_tensors("predict7", {"predictions": torch.as_tensor(pred.predictions)})
    r.write()


class ReadOnce(torch.utils.data.IterableDataset):
    """A stream that can be read once, as transformers' FiniteIterableDataset of its distributed test: a second
    pass (the next epoch, or a probe reading ahead) finds it used up."""

    def __init__(self, data):
        self.data, self.read = data, 0

    def __iter__(self):
        while self.read < len(self.data):
            self.read += 1
            yield self.data[self.read - 1]


def short_data_runs(out: str, world: int) -> dict:
    """train() on data shorter than the processes or used up before max_steps: transformers' distributed test
    (a read-once stream of one row, max_steps=1, batch 1, dispatch_batches=False), the same stream with
    max_steps=3 (its second epoch yields nothing), map-style data of one row with even_batches=False (one process
    gets no batch) and with dataloader_drop_last=True over fewer rows than the processes' batches. Each must end,
    on every process, with the steps the data allowed. Returns what each run reached."""
    from tests.helpers.tiny_jobs import Regressor, regression_rows

    seen = {}
    one = regression_rows(1)
    runs = {"hf_test": (ReadOnce(one), dict(max_steps=1, accelerator_config={"dispatch_batches": False})),
            "used_up": (ReadOnce(one), dict(max_steps=3, accelerator_config={"dispatch_batches": False})),
            "uneven_map": (one, dict(max_steps=2, accelerator_config={"even_batches": False})),
            "dropped": (regression_rows(world), dict(max_steps=2, per_device_train_batch_size=2,
                                                      dataloader_drop_last=True))}
    for name, (data, kw) in runs.items():
        args = training_args(os.path.join(out, name), **{"per_device_train_batch_size": 1, **kw})
        trainer = Trainer(Regressor(as_dict=True), args, train_dataset=data)
        started = time.perf_counter()
        result = trainer.train()
        seen[name] = {"global_step": result.global_step, "seconds": time.perf_counter() - started}
    return seen


def short_data(out: str) -> None:
    r = Report(out, "short_data")
    r.values.update(short_data_runs(r.folder, int(os.environ["WORLD_SIZE"])))
    r.write()


def ddp_adamw(out: str) -> None:
    """The fsdp2 run's settings with plain DDP, to compare the sharded run against. Weight decay on some
    parameter groups only (never norms and biases): the groups must survive FSDP's re-sharding of the optimizer."""
    r = Report(out, "ddp_adamw")
    args = fsdp_args(os.path.join(r.folder, "out"))
    trainer = Trainer(llama(), args, train_dataset=TRAIN)
    trainer.train()
    r.values["losses"] = losses(trainer)
    r.save_tensors("final", final_params(trainer))
    r.write()


def muon(out: str) -> None:
    """optim='muon', 2 x batch 4 over 3 steps: with torch's bfloat16 orthogonalisation (the replicas must agree bit
    for bit), and with the float32 one of tests/unit/test_muon.py, which the test compares with one process on batch 8
    within 1e-6 (in bfloat16 the processes' float32 summation order would show as bfloat16 roundings)."""
    from tests.unit.test_muon import newton_schulz_float32

    r = Report(out, "muon")
    torch_newton_schulz = torch.optim._muon._zeropower_via_newtonschulz
    for name in ("bf16", "fp32"):
        torch.optim._muon._zeropower_via_newtonschulz = (newton_schulz_float32 if name == "fp32"
                                                         else torch_newton_schulz)
        trainer = Trainer(llama(), muon_args(os.path.join(r.folder, name)), train_dataset=TRAIN)
        trainer.train()
        r.values[name] = {"params": param_digest(trainer.model), "losses": losses(trainer),
                          "optimizer": type(trainer.optimizer.optimizer).__name__}
        r.save_tensors(name, final_params(trainer))
    torch.optim._muon._zeropower_via_newtonschulz = torch_newton_schulz
    r.write()


def muon_args(out: str, **kw) -> TrainingArguments:
    """The muon scenario's settings (the test's single-process run too)."""
    return training_args(out, **{"optim": "muon", "learning_rate": 0.02, "weight_decay": 0.1,
                                 "per_device_train_batch_size": 4, "num_train_epochs": 1, **kw})


def per_process_tokens(out: str) -> None:
    """average_tokens_across_devices=False: each rank's loss is the mean over its own target tokens and DDP
    averages the ranks' gradients; that update is computed here by hand from the batch each rank trained on."""
    import copy

    r = Report(out, "per_process_tokens")
    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    args = training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4, max_steps=1,
                         max_grad_norm=0.0, lr_scheduler_type="constant", average_tokens_across_devices=False)
    by_hand = llama()
    trainer = Recording(copy.deepcopy(by_hand), args, train_dataset=TRAIN)
    trainer.train()
    loss = by_hand(**seen[0]).loss  # transformers' mean over this rank's target tokens
    loss.backward()
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss)
    with torch.no_grad():
        for p in by_hand.parameters():
            torch.distributed.all_reduce(p.grad)
            p -= args.learning_rate * p.grad / 2
    trained = dict(trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters())
    r.values.update(tokens=int((seen[0]["labels"][:, 1:] != -100).sum()), losses=losses(trainer),
                    expected_loss=mean_loss.item() / 2,
                    max_difference=max((p - trained[n]).abs().max().item() for n, p in by_hand.named_parameters()))
    r.write()


def oom_on_rank_one(model, trainer_of, forward_at: int | None = None, backward_at: int | None = None):
    """Rank 1 alone runs out of memory (a CUDA-style error, as in tests/integration/test_faults.py): at step
    `forward_at` in the forward of every micro-batch of more than 2 rows, at step `backward_at` in the backward of
    the embeddings' gradient (the last one computed, while DDP all-reduces the others)."""
    def step() -> int:
        return trainer_of().state.global_step + 1

    if int(os.environ["RANK"]) != 1:
        return model
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature, from which unused columns are dropped
    def guarded(*a, **kw):
        if step() == forward_at and kw["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*a, **kw)

    def in_backward(grad):
        if step() == backward_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad

    model.forward = guarded
    model.get_input_embeddings().weight.register_hook(in_backward)
    return model


class OomAfterStepOnRankOne(TrainerCallback):
    """Rank 1 alone runs out of memory in on_step_end of one step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step and int(os.environ["RANK"]) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def oom_on_one_rank(out: str) -> None:
    """auto_find_batch_size with 2 x batch 4, where only rank 1 runs out of memory: in step 1's forward (the
    window's only micro-batch, so rank 0 has run its forward for the gradient all-reduce), then in step 1's
    on_step_end. Both ranks must halve together (4 -> 2 -> 1) and update as the run without errors (24 rows: no
    micro-batch size pads the data)."""
    r = Report(out, "oom_on_one_rank")
    kw = dict(per_device_train_batch_size=4, num_train_epochs=1, auto_find_batch_size=True)
    reference = Trainer(llama(), training_args(os.path.join(r.folder, "reference"), **kw), train_dataset=TRAIN)
    reference.train()
    trainer = None
    model = oom_on_rank_one(llama(), lambda: trainer, forward_at=1)
    trainer = Trainer(model, training_args(os.path.join(r.folder, "out"), **kw), train_dataset=TRAIN,
                      callbacks=[OomAfterStepOnRankOne(1)])
    trainer.train()
    r.values.update(train_batch_size=trainer.state.train_batch_size, global_step=trainer.state.global_step,
                    losses=losses(trainer), reference_losses=losses(reference))
    r.save_tensors("final", final_params(trainer))
    r.save_tensors("reference", final_params(reference))
    r.write()


def oom_in_the_last_backward(out: str) -> None:
    """Rank 1 alone runs out of memory inside the backward of a window's last micro-batch, where rank 0 waits in
    DDP's all-reduce: the run must fail on every rank, with rank 1 saying why, never hang. Ends the launch."""
    r = Report(out, "oom_in_the_last_backward")
    trainer = None
    model = oom_on_rank_one(llama(), lambda: trainer, backward_at=2)
    trainer = Trainer(model, training_args(os.path.join(r.folder, "out"), per_device_train_batch_size=4,
                                           num_train_epochs=1, auto_find_batch_size=True), train_dataset=TRAIN)
    trainer.train()


def eval_oom_on_one_rank(out: str) -> None:
    """auto_find_batch_size in evaluation with 2 x eval batch 4, where only rank 1 runs out of memory, in every
    evaluation forward of more than 2 rows once the first batch's loss-convention probes are done: evaluate() with
    compute_metrics (a gather per batch) on 7 rows (rank 1's batch holds one row of padding) must halve both ranks'
    evaluation batch together and give the metrics of an evaluation at batch 2. A process group that falls out of
    step times out within a minute (ddp_timeout) rather than hanging."""
    r = Report(out, "eval_oom_on_one_rank")

    def metrics(trainer) -> dict:
        return {k: v for k, v in trainer.evaluate().items() if not k.endswith(("_runtime", "_per_second"))}

    reference = Trainer(llama(), training_args(os.path.join(r.folder, "reference"), per_device_eval_batch_size=2,
                                               ddp_timeout=60), eval_dataset=EVAL7, compute_metrics=token_metrics)
    r.values["reference"] = metrics(reference)
    model, trainer = llama(), None
    if r.rank == 1:
        forward = model.forward

        @functools.wraps(forward)  # keeps the signature, from which unused columns are dropped
        def guarded(*a, **kw):
            if not model.training and trainer._convention.settled and kw["input_ids"].shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(*a, **kw)

        model.forward = guarded
    trainer = Trainer(model, training_args(os.path.join(r.folder, "out"), per_device_eval_batch_size=4,
                                           auto_find_batch_size=True, ddp_timeout=60),
                      eval_dataset=EVAL7, compute_metrics=token_metrics)
    r.values["halved"] = metrics(trainer)
    r.values["eval_batch_size"] = trainer._eval_batch_size
    r.write()


SCENARIOS = {f.__name__: f for f in (
    ddp_settings, save_failure, equivalence, equivalence_accumulation, equivalence_after_evaluate, evaluation,
    guards, guards_deferred, rng_resume, preempt, preempt_deferred, preempt_resume, fsdp2, fsdp1, lora_fsdp2,
    fsdp_save_failure, ddp_adamw, zero2, zero3, lora_zero3, zero_nonfinite, zero1_config_sections,
    per_process_tokens, families, iterable, shared_prefix, moe, placement, oom_on_one_rank, oom_in_the_last_backward,
    eval_oom_on_one_rank, worker_seeds, async_fsdp2, async_kill, async_kill_resume, short_data, spike, spike_fsdp2,
    muon)}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    for name in names:
        SCENARIOS[name](out)
    leave()


def leave() -> None:
    """Every rank has written its report: leave without the interpreter's teardown, in which gloo's threads abort
    the process now and then ("terminate called without an active exception"), which these tests do not test."""
    from accelerate.state import PartialState

    if torch.distributed.is_initialized():
        PartialState().wait_for_everyone()
        PartialState().destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
