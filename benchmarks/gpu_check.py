"""GPU smoke checks of stoker on one CUDA GPU, with tokens/s and peak memory for each (run by gpu_check.sh).

    bash benchmarks/gpu_check.sh            # every check, at most 8 minutes; exits 0 with a message without a GPU
    python benchmarks/gpu_check.py --list   # the checks
    python benchmarks/gpu_check.py --only bf16 fp16

Checks, each a short stoker training run of a Llama built from a config (nothing is downloaded):

    bf16, fp16        mixed precision (fp16 with loss scaling) on a ~40M-parameter Llama
    nan_skip          a NaN loss injected at step 3 with fused AdamW: skipped on the device by the deferred check,
                      the parameters equal a synchronous skip's exactly (full_determinism)
    syncs             torch.cuda.set_sync_debug_mode("error") over steps 2-20, with the model's loss, chunked_loss
                      and label smoothing: a step that makes the host wait for the device fails, naming it
    tf32              float32 weights, TF32 matmuls
    compile           bf16 + torch.compile
    fsdp2             FSDP2 (fsdp='full_shard', version 2) in one process under torchrun, then save_model
                      and a transformers reload of the gathered full model
    adamw_8bit        bitsandbytes' 8-bit AdamW
    qlora             the model saved to a folder, loaded in 4 bits (transformers BitsAndBytesConfig, nf4) and
                      trained through a peft LoRA adapter
    mfu_100m          a ~110M-parameter Llama in bf16, eager and with torch.compile: tokens/s and MFU
    checkpoint        synchronous and asynchronous (async_save) checkpoints, each equal to the live parameters of
                      its step (exact); resume bit-exact under full_determinism=True, and otherwise within the
                      device's run-to-run noise, which it measures and reports (in a fresh process of its own)
    fp16_overflow     fp16 with an overflow injected into one step's gradients: that step is skipped (parameters
                      unchanged), the loss scale drops, the schedule does not advance, and the next step applies
    chunked_loss      chunked_loss=True gives the loss of chunked_loss=False, with less peak memory
    packing           packed rows (position_ids restarting) of variable-length sequences, and the MFU the
                      training log reports for them (attention from each sequence's own length)
    shared_prefix     rows sharing a 64-token prompt: shared_prefix=True gives the loss of shared_prefix=False
    ddp_2proc         DDP under torchrun, both ranks' losses equal: two ranks over NCCL with 2 GPUs or more; with
                      one GPU one rank (ddp_1proc: the launcher's path, NCCL, the wrapped model) and the two-rank
                      agreement "not run" (DDP takes a device per rank); two gloo ranks in the rehearsal
    parallelism       parallelism_config's tensor parallelism under torchrun: tp_size=2 over NCCL with 2 GPUs or
                      more; with one GPU tp_size=1 and tensor, sequence and context parallelism over 2 ranks
                      "not run"; tp_size=2 over two gloo ranks in the rehearsal

Throughput is measured over the steps after the first few (compilation and warm-up excluded), at a fixed
sequence length without padding. It is a check, not a test: it prints a table; the exit code is 1 if a
check failed (a row "not run", what this machine cannot show, is not a failure). The whole script keeps to
BUDGET_S (or --budget): a check starts only while the time left (the total less RESERVE_S for the table)
covers its MIN_START_S, an in-process check is interrupted by an alarm when the time left runs out, and a
child process (torchrun's, or a fresh one) gets the time left as its timeout; the table is printed in every
case, on SIGTERM too. `--rehearse` runs the checks that can run on a CPU with tiny sizes (for the test suite).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

BUDGET_S = 480  # the whole script (gpu_check.sh's hard limit is 20 s longer)
RESERVE_S = 15  # kept back from every check and child for printing the table
MIN_START_S = 20  # a check is not started with less time left than this
SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=32000)  # ~40M parameters with tied embeddings
M100 = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, vocab_size=32000)  # ~110M parameters with tied embeddings
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=128)


class OutOfTime(Exception):
    """The script's budget ran out during a check."""


class Budget:
    """The script's time: what is left for checks is the total less the reserve less what has run. `clock` is
    injectable for tests."""

    def __init__(self, total: float = BUDGET_S, reserve: float = RESERVE_S, clock=time.perf_counter):
        self.total, self.reserve, self.clock, self.started = total, reserve, clock, clock()

    def left(self) -> float:
        return max(0.0, self.total - self.reserve - (self.clock() - self.started))

    def may_start(self) -> bool:
        return self.left() >= MIN_START_S

    def child_timeout(self) -> float:
        """A torchrun child's timeout: the time left, never a fixed figure."""
        return self.left()


BUDGET = Budget()


def _alarm(signum, frame):
    raise OutOfTime(f"out of time budget ({BUDGET.total:.0f}s less {BUDGET.reserve:.0f}s reserve)")


def run_within(budget: Budget, fn):
    """fn() interrupted by OutOfTime when the budget's time left runs out (SIGALRM, main thread, Unix)."""
    seconds = budget.left()
    if seconds <= 0:
        raise OutOfTime("out of time budget")
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def free_memory() -> None:
    """Between checks: nothing of the last one (Trainers, models, optimizer state) stays allocated."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def llama(sizes: dict, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=seq_len, tie_word_embeddings=True))


def rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (n, seq_len), generator=g).tolist()
    return [{"input_ids": r, "labels": r} for r in ids]


class StepTimer:
    """A stoker callback noting when each optimizer step ends (after a device sync)."""

    def __new__(cls):
        from stoker import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.ends = []

            def on_step_end(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.ends.append(time.perf_counter())

        return _Timer()


def train(model, out: str, steps: int, batch: int, seq_len: int, warmup: int, **kw) -> dict:
    """Train `steps` steps; tokens/s over the steps after `warmup`, peak memory, final loss, and the Trainer
    (the caller drops it: a kept Trainer holds its model and optimizer state on the device)."""
    from stoker import Trainer, TrainingArguments

    timer = StepTimer()
    peft_config = kw.pop("peft_config", None)
    data = kw.pop("data", None) or rows(batch * steps, seq_len, model.config.vocab_size)
    callbacks = [timer, *kw.pop("callbacks", [])]
    resume = kw.pop("resume_from_checkpoint", None)
    kw.setdefault("logging_steps", steps)
    kw.setdefault("save_strategy", "no")
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4,
                             report_to="none", disable_tqdm=True,
                             optim=kw.pop("optim", "adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch"),
                             **kw)
    free_memory()
    trainer = Trainer(model, args, train_dataset=data, callbacks=callbacks, peft_config=peft_config)
    output = trainer.train(resume_from_checkpoint=resume)
    world = trainer.accelerator.data_parallel_size  # the ranks of a tensor-parallel group share their rows
    timed = timer.ends[warmup:]
    tokens_per_s = (len(timed) - 1) * batch * seq_len * world / (timed[-1] - timed[0]) if len(timed) > 1 else 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"trainer": trainer, "tokens_per_s": tokens_per_s, "peak_gb": peak, "loss": output.training_loss}


def mfu_of(trainer, tokens_per_s: float, seq_len: int, precision: str) -> float | None:
    from stoker import diagnostics

    if not torch.cuda.is_available():
        return None
    peak = diagnostics.peak_tflops(torch.cuda.get_device_name(), precision)
    if peak is None:
        return None
    shape = diagnostics.model_flops_shape(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    per_token = diagnostics.flops_per_token(*shape, seq_len=seq_len)
    return diagnostics.mfu(tokens_per_s, per_token, peak, trainer.accelerator.num_processes)


# ---------------------------------------------------------------------------------------------------
# the checks: each returns a list of result rows {"name", "tokens_per_s", "peak_gb", "note"}


def check_precision(name: str, sizes: dict, steps: int, batch: int, seq_len: int, **kw) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=3, **kw)
    del r["trainer"]
    return [{"name": name, **r, "note": f"loss {r['loss']:.3f}"}]


def check_fsdp2(sizes: dict, steps: int, batch: int, seq_len: int, bf16: bool = True) -> list[dict]:
    """In a torchrun child with one process: Accelerate enables FSDP only under a launcher."""
    if os.environ.get("LOCAL_RANK") is None:
        return torchrun_child("fsdp2", 1)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=3, bf16=bf16, fsdp="full_shard",
                  fsdp_config={"version": 2})
        trainer = r.pop("trainer")
        assert str(trainer.accelerator.distributed_type).endswith("FSDP"), trainer.accelerator.distributed_type
        trainer.save_model(os.path.join(out, "final"))
        del trainer
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
        params = sum(p.numel() for p in reloaded.parameters())
    return [{"name": "fsdp2", **r, "note": f"loss {r['loss']:.3f}; saved and reloaded {params / 1e6:.1f}M params"}]


def check_qlora(sizes: dict, steps: int, batch: int, seq_len: int, bf16: bool = True) -> list[dict]:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as out:
        llama(sizes, seq_len).save_pretrained(os.path.join(out, "base"))
        compute = torch.bfloat16 if bf16 else torch.float32
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=compute)
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "base"), quantization_config=quant,
                                                     dtype=compute)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        from stoker import Trainer  # noqa: F401  (imported before training so the failure is clear)

        r = train(model, os.path.join(out, "run"), steps, batch, seq_len, warmup=3, bf16=bf16, peft_config=lora)
        del model, r["trainer"]
    return [{"name": "qlora", **r, "note": f"loss {r['loss']:.3f}; 4-bit nf4 base + LoRA r=16"}]


def check_mfu(sizes: dict, steps: int, batch: int, seq_len: int) -> list[dict]:
    out_rows = []
    for compiled in (False, True):
        with tempfile.TemporaryDirectory() as out:
            r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=5, bf16=True, torch_compile=compiled)
        trainer = r.pop("trainer")
        params = sum(p.numel() for p in trainer.model.parameters())
        mfu = mfu_of(trainer, r["tokens_per_s"], seq_len, "bf16")
        del trainer  # before the next run builds its own
        note = f"{params / 1e6:.0f}M params, seq {seq_len}, batch {batch}; MFU " + (f"{mfu:.1%}" if mfu else "n/a")
        out_rows.append({"name": "mfu_100m" + ("_compile" if compiled else "_eager"), **r, "note": note})
    return out_rows


CHILD_VARIABLE = "STOKER_GPU_CHECK_CHILD"  # set in a check's own fresh process (child)


def child(check: str, rehearse: bool = False) -> list[dict]:
    """Run one check in a fresh Python process (for what it changes process-wide), with the time left in the
    budget as its timeout; its rows come back on stdout."""
    return torchrun_child(check, 0, rehearse)


def torchrun_child(check: str, processes: int, rehearse: bool = False) -> list[dict]:
    """Run one check in `processes` torchrun processes (Accelerate enables FSDP and DDP only under a launcher),
    or in one plain fresh process with `processes` 0, with the time left in the budget as its timeout; its rows
    come back on stdout."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)] if processes else []
    cmd = [sys.executable, *launcher, os.path.abspath(__file__), "--child", check]
    cmd += ["--rehearse"] if rehearse else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET.child_timeout(),
                              env={**os.environ, CHILD_VARIABLE: "1"})
    except subprocess.TimeoutExpired as e:
        raise OutOfTime(f"{'torchrun ' if processes else ''}child {check} ran out of the time left "
                        f"({e.timeout:.0f}s)") from None
    rows_ = [line[len("ROW "):] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or not rows_:
        raise RuntimeError(f"torchrun child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(r) for r in rows_]


def parameters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of parameters of the same names."""
    return max((p - b[n]).abs().max().item() for n, p in a.items())


class Snapshot:
    """A stoker callback keeping the parameters as they are at the end of optimizer step `step` (before that
    step's checkpoint is written)."""

    def __new__(cls, step: int):
        from stoker import TrainerCallback

        class _Snapshot(TrainerCallback):
            def __init__(self):
                self.params = None

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step == step:
                    self.params = parameters(model)

        return _Snapshot()


def check_checkpoint(sizes: dict, steps: int, batch: int, seq_len: int, rehearse: bool = False, **kw) -> list[dict]:
    """Checkpoints, synchronous and in the background (async_save), each against the live parameters of its step
    (exact), and resume: bit-exact under full_determinism=True, and otherwise within the device's own run-to-run
    noise, which the check measures (two identical runs) and reports. On a GPU two identical bf16 runs differ
    (non-deterministic kernels: atomics in sdpa's and the embedding's backward), so only the first two are
    exact comparisons there; on a CPU all of them are exact.

    In a fresh process of its own: full_determinism switches torch to deterministic algorithms process-wide
    (and cuBLAS reads its workspace setting once), which must not leak into the other checks."""
    if os.environ.get(CHILD_VARIABLE) is None:
        return child("checkpoint", rehearse)
    from stoker import checkpoint_format

    every, notes, diffs, async_row = steps // 2, [], {}, None
    with tempfile.TemporaryDirectory() as out:
        def run(name: str, resume_from: str | None = None, **more) -> dict:
            snapshot = Snapshot(every)
            saving = dict(save_strategy="steps", save_steps=every) if resume_from is None else {}
            r = train(llama(sizes, seq_len), os.path.join(out, name), steps, batch, seq_len, warmup=1,
                      callbacks=[snapshot], resume_from_checkpoint=resume_from, **saving, **more, **kw)
            r["final"] = parameters(r.pop("trainer").model)
            if resume_from is None:  # the checkpoint is the live state of its step, bit for bit
                folder = os.path.join(out, name, f"checkpoint-{every}")
                problem = checkpoint_format.verify(folder)
                if problem is not None:
                    raise RuntimeError(f"{name}: checkpoint-{every} does not verify: {problem}")
                saved = llama(sizes, seq_len)
                checkpoint_format.load_weights(saved, folder)
                gap = max_diff(parameters(saved), snapshot.params)
                if gap != 0:
                    raise RuntimeError(f"{name}: checkpoint-{every} is {gap:.2e} from the live parameters of "
                                       f"step {every}")
                r["folder"] = folder
            return r

        # without full_determinism first (it cannot be switched off again in this process)
        plain, plain_async = run("plain"), run("plain-async", async_save=True)
        noise = max_diff(plain["final"], plain_async["final"])
        resumed = max_diff(run("plain-resumed", plain["folder"])["final"], plain["final"])
        diffs["noise"], diffs["resumed"] = noise, resumed
        # the resumed run re-does only the steps after the checkpoint: its gap is within the noise of whole runs
        # (3x: the noise of two runs is itself a sample)
        if resumed > 3 * noise:
            raise RuntimeError(f"resumed from checkpoint-{every}: {resumed:.2e} from the run never stopped, over 3x "
                               f"the run-to-run noise ({noise:.2e})")
        exact = run("deterministic", full_determinism=True)
        exact_async = run("deterministic-async", async_save=True, full_determinism=True)
        async_row = exact_async
        for name, r in (("deterministic", exact), ("deterministic-async", exact_async)):
            gap = max_diff(run(f"{name}-resumed", r["folder"], full_determinism=True)["final"], exact["final"])
            diffs[name] = gap
            if gap != 0 or max_diff(r["final"], exact["final"]) != 0:
                raise RuntimeError(f"full_determinism=True: the run resumed from {name}'s checkpoint-{every} ends "
                                   f"{gap:.2e} from the run never stopped (expected 0)")
        notes = [f"checkpoint-{every} = live step {every} exactly (sync, async)",
                 f"full_determinism resumed max |diff| {diffs['deterministic']:.1e} sync, "
                 f"{diffs['deterministic-async']:.1e} async",
                 f"without it: run-to-run noise {noise:.1e}, resumed {resumed:.1e}"]
    row = {k: v for k, v in exact.items() if k in ("tokens_per_s", "peak_gb", "loss")}
    return [{"name": "checkpoint", **row, "note": "; ".join(notes)
             + f"; async run {async_row['tokens_per_s']:,.0f} tokens/s"}]


def overflow_verdict(steps: list[dict], injected: int) -> str | None:
    """What is wrong (None: nothing) with the records of an fp16 run whose step `injected` (1-based, > 1) had
    non-finite gradients: steps[k - 1] = {"scale", "schedule" (the schedule's step count), "params" (a
    checksum)} after step k."""
    before, at, after = steps[injected - 2], steps[injected - 1], steps[injected]
    problems = []
    if at["params"] != before["params"]:
        problems.append("the overflowed step changed the parameters")
    if not at["scale"] < before["scale"]:
        problems.append(f"the loss scale did not drop ({before['scale']} -> {at['scale']})")
    if at["schedule"] != before["schedule"]:
        problems.append(f"the schedule advanced ({before['schedule']} -> {at['schedule']})")
    if after["params"] == at["params"]:
        problems.append("the step after the overflow did not apply")
    if after["schedule"] == at["schedule"]:
        problems.append("the schedule did not advance after the overflow")
    return "; ".join(problems) or None


def check_fp16_overflow(sizes: dict, steps: int, batch: int, seq_len: int) -> list[dict]:
    """fp16 with loss scaling; step 3's gradients are made infinite by a hook in backward (before the scaler
    unscales them), and the run's records around it are judged by overflow_verdict."""
    from stoker import TrainerCallback

    injected, records = 3, []

    def record(model, trainer_scheduler, scaler):
        inner = getattr(trainer_scheduler, "scheduler", trainer_scheduler)
        records.append({"scale": float(scaler.get_scale()) if scaler is not None else None,
                        "schedule": getattr(inner, "last_epoch", None),
                        "params": float(sum(p.detach().double().sum() for p in model.parameters()))})

    class Inject(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.armed = False
            target = next(p for p in model.parameters() if p.requires_grad)
            target.register_hook(lambda g: g * float("inf") if self.armed else g)

        def on_step_begin(self, args, state, control, **kw):
            self.armed = state.global_step + 1 == injected

        def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kw):
            self.armed = False
            record(model, lr_scheduler, self.trainer.accelerator.scaler)

    inject = Inject()
    model = llama(sizes, seq_len)
    with tempfile.TemporaryDirectory() as out:
        from stoker import Trainer, TrainingArguments

        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                 learning_rate=1e-3, fp16=True, report_to="none", disable_tqdm=True,
                                 logging_steps=steps, save_strategy="no", lr_scheduler_type="linear")
        trainer = Trainer(model, args, train_dataset=rows(batch * steps, seq_len, model.config.vocab_size),
                          callbacks=[inject])
        inject.trainer = trainer
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        del trainer
    problem = overflow_verdict(records, injected)
    if problem:
        raise RuntimeError(f"fp16 overflow at step {injected}: {problem}")
    return [{"name": "fp16_overflow", "tokens_per_s": steps * batch * seq_len / seconds, "peak_gb": peak_gb(),
             "note": f"step {injected} skipped, scale {records[injected - 2]['scale']:.0f} -> "
                     f"{records[injected - 1]['scale']:.0f}, schedule held, step {injected + 1} applied"}]


def nonfinite_run(sizes: dict, steps: int, batch: int, seq_len: int, injected: int, on_device: bool) -> dict:
    """A full_determinism run with fused AdamW whose step `injected` has a NaN loss (the logits made NaN), its
    update skipped on the device (the deferred check) or by the host (`on_device` False: the synchronous check,
    as with an optimizer that has no fused kernel); its parameters at the end."""
    from stoker import Trainer, TrainerCallback, TrainingArguments
    from stoker.distributed.backends import Backend

    class Inject(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.step = 0
            model.lm_head.register_forward_hook(lambda m, i, out: out * math.nan if self.step == injected else out)

        def on_step_begin(self, args, state, control, **kw):
            self.step = state.global_step + 1

    model = llama(sizes, seq_len)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                 learning_rate=1e-3, report_to="none", disable_tqdm=True, logging_steps=steps,
                                 save_strategy="no", optim="adamw_torch_fused", full_determinism=True,
                                 bf16=torch.cuda.is_available())
        trainer = Trainer(model, args, train_dataset=rows(batch * steps, seq_len, model.config.vocab_size),
                          callbacks=[Inject()])
        if not on_device:
            trainer._backend.skips_on_device = lambda optimizer: False
        trainer.train()
        deferred = Backend.skips_on_device(trainer._backend, trainer.optimizer) if on_device else False
        skipped = trainer.state.log_history[-2].get("nonfinite_steps_skipped")
        del trainer
    return {"params": parameters(model), "deferred": deferred, "skipped": skipped}


def check_nan_skip(sizes: dict, steps: int, batch: int, seq_len: int, rehearse: bool = False) -> list[dict]:
    """A NaN at step 3 with fused AdamW: skipped on the device by the deferred check, it leaves exactly the
    parameters a synchronous skip leaves (full_determinism; bf16 on a GPU). In a fresh process of its own, as
    check_checkpoint, for full_determinism's process-wide settings."""
    if os.environ.get(CHILD_VARIABLE) is None:
        return child("nan_skip", rehearse)
    injected, t0 = 3, time.perf_counter()
    device = nonfinite_run(sizes, steps, batch, seq_len, injected, on_device=True)
    host = nonfinite_run(sizes, steps, batch, seq_len, injected, on_device=False)
    seconds = time.perf_counter() - t0
    if not device["deferred"]:
        raise RuntimeError("fused AdamW did not take the deferred check")
    if device["skipped"] != 1 or host["skipped"] != 1:
        raise RuntimeError(f"steps skipped: {device['skipped']} deferred, {host['skipped']} synchronous; expected 1")
    diff = max_diff(device["params"], host["params"])
    if diff != 0:
        raise RuntimeError(f"deferred skip against synchronous skip: max |diff| {diff:.1e}, expected 0")
    return [{"name": "nan_skip", "tokens_per_s": 2 * steps * batch * seq_len / seconds, "peak_gb": peak_gb(),
             "note": f"NaN at step {injected} skipped on the device = synchronous skip exactly (max |diff| 0)"}]


def check_syncs(sizes: dict, steps: int, batch: int, seq_len: int) -> list[dict]:
    """torch.cuda.set_sync_debug_mode("error") from the second step to the last of `steps` (no log, evaluation
    or save among them), with each loss stoker computes: the model's own, chunked_loss and label smoothing. A
    step that made the host wait for the device raises there, naming the operation."""
    from stoker import TrainerCallback

    class Strict(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:  # after the first step: its one-off reads (the first batch's check) done
                torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == steps:  # before the end's settle and log, which wait on purpose
                torch.cuda.set_sync_debug_mode("default")

    notes, t0 = [], time.perf_counter()
    for loss, kw in (("model loss", {}), ("chunked_loss", {"chunked_loss": True}),
                     ("label smoothing", {"label_smoothing_factor": 0.1})):
        with tempfile.TemporaryDirectory() as out:
            try:
                train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=1, bf16=True, logging_steps=1000,
                      callbacks=[Strict()], **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        notes.append(loss)
    seconds = time.perf_counter() - t0
    return [{"name": "syncs", "tokens_per_s": 3 * steps * batch * seq_len / seconds, "peak_gb": peak_gb(),
             "note": f"no host sync in steps 2-{steps} with each loss ({', '.join(notes)})"}]


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def check_chunked_loss(sizes: dict, steps: int, batch: int, seq_len: int, **kw) -> list[dict]:
    out_rows, losses = [], []
    for chunked in (False, True):
        with tempfile.TemporaryDirectory() as out:
            r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=1, chunked_loss=chunked, **kw)
        del r["trainer"]
        losses.append(r["loss"])
        out_rows.append(r)
    if abs(losses[0] - losses[1]) > 2e-3 * max(1.0, abs(losses[0])):
        raise RuntimeError(f"chunked_loss=True's loss {losses[1]:.5f} is not chunked_loss=False's {losses[0]:.5f}")
    return [{"name": "chunked_loss", **out_rows[1], "note": f"loss {losses[1]:.4f} (unchunked {losses[0]:.4f}); "
             f"peak {out_rows[1]['peak_gb']:.2f} GiB vs {out_rows[0]['peak_gb']:.2f} GiB unchunked"}]


def varied_rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(seq_len // 8, seq_len // 2, (n,), generator=g).tolist()
    return [{"input_ids": (ids := torch.randint(1, vocab, (k,), generator=g).tolist()), "labels": ids}
            for k in lengths]


def logged(out: str, key: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r[key] for r in map(json.loads, f) if key in r]


def check_packing(sizes: dict, steps: int, batch: int, seq_len: int, **kw) -> list[dict]:
    """Variable-length rows packed into rows of seq_len; on a GPU the training log's MFU of the packed job."""
    data = varied_rows(4 * batch * steps, seq_len, sizes["vocab_size"])
    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=2, data=data, packing=True,
                  packing_length=seq_len, logging_steps=max(1, steps // 3), **kw)
        del r["trainer"]
        mfu = logged(out, "mfu")
    if torch.cuda.is_available() and not mfu:
        raise RuntimeError("the packed job's training log has no mfu")
    return [{"name": "packing", **r, "note": f"loss {r['loss']:.3f}; logged MFU " +
             (f"{mfu[-1]:.1%} (attention per sequence)" if mfu else "n/a (CPU)")}]


def check_shared_prefix(sizes: dict, steps: int, batch: int, seq_len: int, **kw) -> list[dict]:
    """Rows that start with the same 64-token prompt (no target in it): shared_prefix=True's loss is the
    loss without it (float32 weights, no autocast, so the two differ only by summation order)."""
    from stoker.data import IGNORE_INDEX

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, sizes["vocab_size"], (64,), generator=g).tolist()
    data = []
    for _ in range(batch * steps):
        tail = torch.randint(1, sizes["vocab_size"], (seq_len - 64,), generator=g).tolist()
        data.append({"input_ids": prompt + tail, "labels": [IGNORE_INDEX] * 64 + tail})
    losses, out_rows = [], []
    for shared in (False, True):
        with tempfile.TemporaryDirectory() as out:
            r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=1, data=data, shared_prefix=shared,
                      **kw)
        del r["trainer"]
        losses.append(r["loss"])
        out_rows.append(r)
    if abs(losses[0] - losses[1]) > 1e-3 * max(1.0, abs(losses[0])):
        raise RuntimeError(f"shared_prefix=True's loss {losses[1]:.5f} is not the unshared {losses[0]:.5f}")
    return [{"name": "shared_prefix", **out_rows[1], "note": f"loss {losses[1]:.4f} (unshared {losses[0]:.4f}); "
             f"{out_rows[1]['tokens_per_s'] / max(out_rows[0]['tokens_per_s'], 1e-9):.2f}x the unshared tokens/s"}]


NOT_RUN_ON_ONE_GPU = ("one GPU here: DDP takes a device per rank (Accelerate wraps rank 1 with device_ids=[1]), so "
                     "two ranks agreeing needs 2 GPUs; on a CPU it runs in the rehearsal and tests/distributed")


def check_ddp_2proc(sizes: dict, steps: int, batch: int, seq_len: int, rehearse: bool = False) -> list[dict]:
    """DDP under torchrun, rank 0 gathering each rank's loss and device: two ranks must agree. Two ranks on one
    GPU are not a valid DDP setup (a device per rank), so with one GPU it runs what one GPU can show (one rank
    under torchrun: the launcher's path, the NCCL process group, the wrapped model, a finite loss) and reports the
    two-rank agreement as not run, with why; with two GPUs or more, two ranks over NCCL; on a CPU (the
    rehearsal), two gloo ranks."""
    if os.environ.get("LOCAL_RANK") is None:
        processes = 2 if rehearse or torch.cuda.device_count() >= 2 else 1
        (r,) = torchrun_child("ddp_2proc", processes, rehearse)
        if r["world"] != processes or len(set(r["losses"])) != 1 or not all(map(math.isfinite, r["losses"])):
            raise RuntimeError(f"{r['world']} processes, losses {r['losses']}: not {processes} ranks that agree")
        on = f"{' and '.join(r['devices'])}, {r['backend']}, {r['wrapped']}; loss {r['losses'][0]:.4f}"
        if processes == 1:
            return [{"name": "ddp_1proc", "tokens_per_s": r["tokens_per_s"], "peak_gb": r["peak_gb"],
                     "note": f"1 rank on {on}"}, {"name": "ddp_2proc", "not_run": NOT_RUN_ON_ONE_GPU}]
        return [{"name": "ddp_2proc", "tokens_per_s": r["tokens_per_s"], "peak_gb": r["peak_gb"],
                 "note": f"2 ranks on {on} on both"}]
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as out:
        # gloo on a CPU; NCCL (Accelerate's choice) on GPUs, a device per rank
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=2,
                  ddp_backend=None if torch.cuda.is_available() else "gloo")
        trainer = r.pop("trainer")
        world, rank, device = trainer.accelerator.num_processes, trainer.accelerator.process_index, \
            str(trainer.accelerator.device)
        wrapped = type(trainer.model_wrapped).__name__
        del trainer
    gathered = [None] * world
    dist.all_gather_object(gathered, (r["loss"], device))
    # one row, from rank 0 (two ranks printing to the one stdout would interleave their lines)
    return [{"name": "ddp_2proc", **r, "world": world, "backend": dist.get_backend(), "wrapped": wrapped,
             "losses": [loss for loss, _ in gathered], "devices": [d for _, d in gathered]}] if rank == 0 else []


PARALLEL_NOT_RUN_ON_ONE_GPU = {
    "tp_2gpu": "one GPU here: tensor parallelism over 2 ranks takes a device per rank; on CPU processes it is "
               "exact against one process (tests/distributed/test_parallelism.py)",
    "sp_2gpu": "one GPU here: Ulysses sequence parallelism (sp_size=2) takes a device per rank",
    "cp_2gpu": "one GPU here: context parallelism (cp_size=2, ring attention in torch's CUDA sdpa kernels) takes a "
               "device per rank; not measured",
}


def check_parallelism(sizes: dict, steps: int, batch: int, seq_len: int, rehearse: bool = False) -> list[dict]:
    """parallelism_config under torchrun, tp_size = the number of ranks (the model's tp_plan): with one GPU
    tp_size=1 (the launcher, parallelism_config on CUDA, nothing split) and what needs 2 GPUs reported as not run;
    with two GPUs or more tp_size=2 over NCCL; in the rehearsal tp_size=2 over two gloo ranks. The ranks of a
    tensor-parallel group read the same rows, so their losses must be equal."""
    if os.environ.get("LOCAL_RANK") is None:
        processes = 2 if rehearse or torch.cuda.device_count() >= 2 else 1
        (r,) = torchrun_child("parallelism", processes, rehearse)
        if r["world"] != processes or len(set(r["losses"])) != 1 or not all(map(math.isfinite, r["losses"])):
            raise RuntimeError(f"{r['world']} processes, losses {r['losses']}: not {processes} ranks that agree")
        row = {"name": f"tp_{processes}{'proc' if rehearse else 'gpu'}", "tokens_per_s": r["tokens_per_s"],
               "peak_gb": r["peak_gb"], "note": f"tp_size={processes} on {' and '.join(r['devices'])}, "
               f"{r['backend']}: {r['dtensors']} DTensor parameters; loss {r['losses'][0]:.4f} on every rank"}
        if processes == 1:
            return [row, *({"name": n, "not_run": why} for n, why in PARALLEL_NOT_RUN_ON_ONE_GPU.items())]
        return [row]
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=1, parallelism_config={"tp_size": world},
                  ddp_backend=None if torch.cuda.is_available() else "gloo")
        trainer = r.pop("trainer")
        device = str(trainer.accelerator.device)
        dtensors = sum(hasattr(p, "full_tensor") for p in trainer.model.parameters())
        del trainer
    gathered = [None] * world
    dist.all_gather_object(gathered, (r["loss"], device))
    return [{"name": "parallelism", **r, "world": world, "backend": dist.get_backend(), "dtensors": dtensors,
             "losses": [loss for loss, _ in gathered], "devices": [d for _, d in gathered]}] \
        if dist.get_rank() == 0 else []


def checks(rehearse: bool) -> dict:
    """name -> zero-argument callable. Rehearsal: tiny sizes, only what runs on a CPU."""
    if rehearse:
        s = dict(sizes=TINY, steps=6, batch=2, seq_len=16)
        long = dict(sizes=TINY, steps=4, batch=4, seq_len=96)  # rows long enough for a 64-token prompt
        return {"bf16": lambda: check_precision("bf16", bf16=True, **s),
                "nan_skip": lambda: check_nan_skip(**s, rehearse=True),
                "qlora": lambda: check_qlora(bf16=False, **s),
                "checkpoint": lambda: check_checkpoint(**s, rehearse=True),
                "chunked_loss": lambda: check_chunked_loss(**s),
                "packing": lambda: check_packing(**s),
                "shared_prefix": lambda: check_shared_prefix(**long),
                "ddp_2proc": lambda: check_ddp_2proc(**dict(s, steps=3), rehearse=True),
                "parallelism": lambda: check_parallelism(**dict(s, steps=3), rehearse=True)}
    s = dict(sizes=SMALL, steps=30, batch=8, seq_len=512)
    short = dict(s, steps=10)
    return {
        "bf16": lambda: check_precision("bf16", bf16=True, **s),
        "nan_skip": lambda: check_nan_skip(**short),
        "syncs": lambda: check_syncs(**dict(s, steps=20)),
        "fp16": lambda: check_precision("fp16", fp16=True, **s),
        "tf32": lambda: check_precision("tf32", tf32=True, **s),
        "compile": lambda: check_precision("compile", bf16=True, torch_compile=True, **s),
        "fsdp2": lambda: check_fsdp2(**s),
        "adamw_8bit": lambda: check_precision("adamw_8bit", bf16=True, optim="adamw_8bit", **s),
        "qlora": lambda: check_qlora(**s),
        "mfu_100m": lambda: check_mfu(M100, steps=25, batch=8, seq_len=1024),
        "checkpoint": lambda: check_checkpoint(**short, bf16=True),
        "fp16_overflow": lambda: check_fp16_overflow(**dict(short, steps=6)),
        "chunked_loss": lambda: check_chunked_loss(**short, bf16=True),
        "packing": lambda: check_packing(M100, steps=15, batch=8, seq_len=1024, bf16=True),
        "shared_prefix": lambda: check_shared_prefix(**short),
        "ddp_2proc": lambda: check_ddp_2proc(**short),
        "parallelism": lambda: check_parallelism(**short),
    }


def print_row(name: str, status: str, row: dict | None = None, note: str = "") -> str:
    if row is None:
        line = f"{name:<18} {status:<8} {'':>12} {'':>9}  {note}"
    else:
        line = (f"{row['name']:<18} {status:<8} {row['tokens_per_s']:>12,.0f} {row['peak_gb']:>9.2f}  "
                f"{row['note']}{note}")
    print(line, flush=True)
    return line


def run_checks(table: dict, names: list[str], budget: Budget, table_file: str | None = None) -> list[str]:
    """Run the named checks within the budget; returns the failed ones. A check not started for lack of time
    is SKIPPED, one interrupted by it is TIMEOUT (a failure); a row a check returns with "not_run" (what this
    machine cannot show, and why) is "not run", not a failure; the summary table is printed at the end, and on
    SIGTERM (gpu_check.sh's hard limit) before exiting; its rows are appended to `table_file` too (gpu_all.sh's
    one table, append_rows)."""
    failed, not_run, lines, rows = [], [], [], []

    def line(name: str, status: str, row: dict | None = None, note: str = "") -> str:
        rows.append({**(row or {}), "name": f"check {row['name'] if row else name}", "status": status,
                     "note": (row or {}).get("note", "") + note})
        return print_row(name, status, row, note)

    def summary(signum=None, frame=None):
        if table_file:
            append_rows(table_file, rows)
        print("\n" + "\n".join([f"{'check':<18} {'status':<8} {'tokens/s':>12} {'peak GiB':>9}  note", *lines]))
        print(f"gpu_check: {len(failed)} failed ({', '.join(failed) or 'none'}), {len(not_run)} not run on this "
              f"machine ({', '.join(not_run) or 'none'}) in {budget.clock() - budget.started:.0f}s", flush=True)
        if signum is not None:
            sys.exit(1)

    previous = signal.signal(signal.SIGTERM, summary)
    print(f"{'check':<18} {'status':<8} {'tokens/s':>12} {'peak GiB':>9}  note", flush=True)
    try:
        for name in names:
            if not budget.may_start():
                lines.append(line(name, "SKIPPED", note=f"out of time budget ({budget.left():.0f}s left)"))
                continue
            t0 = budget.clock()
            try:
                for row in run_within(budget, table[name]):
                    if "not_run" in row:  # what this machine cannot show: said, and not a failure
                        not_run.append(row["name"])
                        lines.append(line(row["name"], "not run", note=row["not_run"]))
                    else:
                        lines.append(line(name, "ok", row, f" ({budget.clock() - t0:.0f}s)"))
            except OutOfTime as e:
                failed.append(name)
                lines.append(line(name, "TIMEOUT", note=str(e)))
            except Exception as e:  # one failed check must not hide the others
                failed.append(name)
                lines.append(line(name, "FAILED", note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                traceback.print_exc(file=sys.stderr)
            finally:
                row = None  # no row (nor anything it refers to) outlives its check
                free_memory()
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary()
    return failed


def append_rows(path: str, rows: list[dict]) -> None:
    """Rows of a table, as JSON lines appended to `path`: {"name", "status", and where measured "tokens_per_s",
    "mfu", "peak_gb", "note"}, what `one_table` prints (gpu_all.sh gathers both scripts' rows there)."""
    keys = ("name", "status", "tokens_per_s", "mfu", "peak_gb", "note")
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in keys if isinstance(row.get(k), (str, int, float))}) + "\n")


def one_table(path: str) -> str:
    """The rows append_rows wrote to `path`, as one table, in the order they were written."""
    rows = []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    number = lambda row, key, form: format(row[key], form) if isinstance(row.get(key), (int, float)) else ""
    out = [f"{'what':<28} {'status':<8} {'tokens/s':>12} {'MFU':>6} {'peak GiB':>9}  note"]
    out += [f"{r['name']:<28} {r['status']:<8} {number(r, 'tokens_per_s', ',.0f'):>12} {number(r, 'mfu', '.1%'):>6} "
            f"{number(r, 'peak_gb', '.2f'):>9}  {r.get('note', '')}" for r in rows]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes, CPU-capable checks only")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for every check (default "
                        f"{BUDGET_S}); gpu_all.sh gives gpu_speed.py the rest of its 10 minutes")
    parser.add_argument("--table", help="also append the table's rows to this file as JSON lines (gpu_all.sh)")
    parser.add_argument("--one_table", help="print the rows of this file (gpu_all.sh's two scripts) as one table")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a check run inside torchrun or a fresh process
    a = parser.parse_args()
    if a.one_table:
        print(one_table(a.one_table))
        return 0
    global BUDGET
    if a.budget != BUDGET.total:
        BUDGET = Budget(total=a.budget)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    table = checks(a.rehearse)
    if a.list:
        print("\n".join(table))
        return 0
    if a.child:
        for row in table[a.child]():
            row.pop("trainer", None)
            print("ROW " + json.dumps(row), flush=True)
        return 0
    if not torch.cuda.is_available() and not a.rehearse:
        print("gpu_check: no CUDA GPU here; nothing to check")
        return 0
    if torch.cuda.is_available():
        print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    unknown = [n for n in a.only or [] if n not in table]
    if unknown:
        print(f"gpu_check: --only {' '.join(unknown)}: no such check; checks: {', '.join(table)}")
        return 2
    failed = run_checks(table, a.only or list(table), BUDGET, a.table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
