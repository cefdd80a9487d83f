"""Overhead of stoker.Trainer against a hand-written Accelerate loop and transformers.Trainer.

Measures two things and prints them as one table of medians and ratios:

1. Training-loop wall time. The same tiny Llama (built from a LlamaConfig: nothing is downloaded) learns
   the generated addition task of stoker.tasks for --steps optimizer steps, three ways:

       hand-written   Accelerator.prepare, then forward / backward / clip / step / schedule / zero_grad
       stoker         stoker.Trainer(model, stoker.TrainingArguments(...)).train()
       transformers   transformers.Trainer(model, transformers.TrainingArguments(...)).train()

   All three start from the same weights and see the same rows through the same collator
   (stoker.data.PaddingCollator), batch size and seed, with non-fused torch AdamW (same lr, betas, eps,
   weight decay and decay/no-decay split), the linear schedule of transformers.get_scheduler and the same
   gradient clipping. Only the train call is timed: building the model, data, arguments and Accelerator is
   not. Each way runs once untimed as a warm-up, then --repeats times interleaved (hand, stoker,
   transformers, hand, ...) so that drift in machine speed hits all three alike; medians are reported. The
   loss of each trained model on a fixed held-out batch is printed to show the three did the same work.

2. Import time of `import torch, accelerate`, `import stoker` and `from transformers import Trainer`, each
   timed with time.perf_counter inside a fresh interpreter (interpreter start-up excluded), median of 5.

It is a measurement, not a test: it prints and exits 0. About two minutes on 2 CPU cores:

    python benchmarks/overhead.py [--steps 60] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import stoker
from stoker.data import PaddingCollator
from stoker.optim import parameter_groups
from stoker.tasks import arithmetic_splits, char_tokenizer, encode_completion

NUM_TRAIN_ROWS = 4096  # 128 batches of 32: the default 60 steps stay inside one epoch
NUM_EVAL_ROWS = 256    # the fixed held-out batch whose loss is compared after training
NEVER = 10**6          # logging_steps that never comes due (both trainers still log once, at the end)
IMPORT_REPEATS = 5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Job:
    """What the three runs share; every field maps onto a TrainingArguments field of the same meaning."""

    steps: int                  # optimizer steps (max_steps)
    batch_size: int = 32        # rows per optimizer step (gradient_accumulation_steps=1)
    learning_rate: float = 3e-3
    weight_decay: float = 0.01  # not applied to biases and norm weights, by all three
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0


@dataclass
class Data:
    tokenizer: Any
    train: list[dict]                    # encoded rows, shared read-only by every run
    held_out: dict[str, torch.Tensor]    # one padded batch
    collator: PaddingCollator


def build_data(seed: int) -> Data:
    tokenizer = char_tokenizer()
    train_pairs, eval_pairs = arithmetic_splits("addition", NUM_TRAIN_ROWS, NUM_EVAL_ROWS, seed=seed)
    encode = lambda pairs: [encode_completion(tokenizer, p, a) for p, a in pairs]
    collator = PaddingCollator(tokenizer.pad_token_id)
    return Data(tokenizer, encode(train_pairs), collator(encode(eval_pairs)), collator)


def build_model(tokenizer, seed: int) -> torch.nn.Module:
    """A fresh tiny Llama (about 0.5M parameters); seeded, so every run starts from the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def reset_accelerate_state() -> None:
    # AcceleratorState is a process-wide singleton that refuses a second, different configuration.
    # stoker.Trainer resets it itself; the other two runs must do it before building their Accelerator.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def trainer_arguments(job: Job, output_dir: str) -> dict[str, Any]:
    """Keyword arguments that stoker.TrainingArguments and transformers.TrainingArguments read alike."""
    return dict(
        output_dir=output_dir, max_steps=job.steps, per_device_train_batch_size=job.batch_size,
        gradient_accumulation_steps=1, learning_rate=job.learning_rate, weight_decay=job.weight_decay,
        adam_beta1=job.adam_betas[0], adam_beta2=job.adam_betas[1], adam_epsilon=job.adam_epsilon,
        max_grad_norm=job.max_grad_norm, optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=0,
        seed=job.seed, data_seed=job.seed, logging_steps=NEVER, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)


# ---------------------------------------------------------------------------------------------------
# The three ways. Each builds everything a user builds before calling train (untimed) and returns
# (train, model): the callable that is timed, and the model it trains in place.


def build_hand_loop(job: Job, data: Data, output_dir: str) -> tuple[Callable[[], None], torch.nn.Module]:
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler

    reset_accelerate_state()
    # the seedable sampler with data_seed gives the same data order as stoker's loader
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=job.seed))
    model = build_model(data.tokenizer, job.seed)

    def train() -> None:
        # as inside Trainer.train: the loader, optimizer, schedule and prepare count as training time
        sampler = RandomSampler(data.train, generator=torch.Generator().manual_seed(job.seed))
        loader = DataLoader(data.train, batch_size=job.batch_size, sampler=sampler, collate_fn=data.collator)
        # the decay/no-decay split that stoker and transformers both make, so the updates are the same
        optimizer = torch.optim.AdamW(parameter_groups(model, job.weight_decay), lr=job.learning_rate,
                                      betas=job.adam_betas, eps=job.adam_epsilon)
        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=job.steps)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        prepared.train()
        step, epoch = 0, 0
        while step < job.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                loss = prepared(**batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(prepared.parameters(), job.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step == job.steps:
                    break
            epoch += 1

    return train, model


def build_stoker(job: Job, data: Data, output_dir: str) -> tuple[Callable[[], None], torch.nn.Module]:
    model = build_model(data.tokenizer, job.seed)
    args = stoker.TrainingArguments(**trainer_arguments(job, output_dir))
    trainer = stoker.Trainer(model, args, train_dataset=data.train, data_collator=data.collator)
    return trainer.train, model


def build_transformers(job: Job, data: Data, output_dir: str) -> tuple[Callable[[], None], torch.nn.Module]:
    import transformers

    reset_accelerate_state()
    model = build_model(data.tokenizer, job.seed)
    args = transformers.TrainingArguments(**trainer_arguments(job, output_dir))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data.train, data_collator=data.collator)
    return trainer.train, model


# label in the table -> builder; the first is the baseline of the ratios
LOOPS = {
    "hand-written Accelerate loop": build_hand_loop,
    "stoker.Trainer": build_stoker,
    "transformers.Trainer": build_transformers,
}
LOOP_TARGETS = {"stoker.Trainer": "(target <= 1.02)"}


# ---------------------------------------------------------------------------------------------------
# measuring


@contextlib.contextmanager
def quiet():
    """Swallow what the runs print (stoker's progress lines, transformers' final metrics, warnings) so the
    report stays readable; all three are silenced alike. Printed back if the run fails."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise


def held_out_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def run_once(build, job: Job, data: Data, output_dir: str) -> tuple[float, float]:
    """(seconds of the train call, held-out loss of the trained model)."""
    with quiet():
        train, model = build(job, data, output_dir)
        gc.collect()  # collect the previous run's garbage now, not inside the timed region
        started = time.perf_counter()
        train()
        seconds = time.perf_counter() - started
        return seconds, held_out_loss(model, data.held_out)


def time_loops(job: Job, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per way: the seconds of each timed repeat, and the held-out loss after the last one."""
    data = build_data(job.seed)
    seconds = {name: [] for name in LOOPS}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeats + 1):  # round 0 is the untimed warm-up
            for name, build in LOOPS.items():
                elapsed, losses[name] = run_once(build, job, data, os.path.join(tmp, build.__name__))
                if round_:
                    seconds[name].append(elapsed)
    return seconds, losses


IMPORTS = ("import torch, accelerate", "import stoker", "from transformers import Trainer")


def import_seconds(statement: str) -> float:
    """Seconds a fresh interpreter spends on `statement`, timed inside the child (start-up excluded)."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    # cwd=REPO so that `import stoker` finds this checkout
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def time_imports(repeats: int) -> dict[str, list[float]]:
    for statement in IMPORTS:  # untimed: warms the OS file cache, so the first statement is not penalised
        import_seconds(statement)
    seconds = {statement: [] for statement in IMPORTS}
    for _ in range(repeats):
        for statement in IMPORTS:
            seconds[statement].append(import_seconds(statement))
    return seconds


# ---------------------------------------------------------------------------------------------------
# report


def format_table(title: str, baseline: str, medians: dict[str, float], targets: dict[str, str]) -> list[str]:
    base = next(iter(medians.values()))
    lines = [f"{title:<44}{'seconds':>9}   ratio vs {baseline}"]
    for label, value in medians.items():
        lines.append(f"{label:<44}{value:>9.3f}   {value / base:>5.3f}   {targets.get(label, '')}".rstrip())
    return lines


def format_runs(seconds: dict[str, list[float]]) -> list[str]:
    return [f"  {label}: " + ", ".join(f"{s:.3f}" for s in runs) for label, runs in seconds.items()]


def loss_check(losses: dict[str, float]) -> list[str]:
    lines = ["held-out loss after training (similar values = the three did the same work):"]
    lines += [f"  {label:<42}{loss:>9.4f}" for label, loss in losses.items()]
    low, high = min(losses.values()), max(losses.values())
    if high > 1.1 * low:  # an order or update that differs would show up here; timing noise cannot
        lines.append(f"  WARNING: losses differ by {100 * (high / low - 1):.0f}%: the runs are not like for like")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run (>= 40 advised)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way, after one warm-up")
    # one thread by default: with as many threads as cores, any other busy process on the machine stalls
    # torch's thread pool and slows a run several-fold, which swamps a 2% difference
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every run")
    a = parser.parse_args(argv)
    if a.steps < 1 or a.repeats < 1 or a.threads < 1:
        parser.error("--steps, --repeats and --threads must be positive integers")
    torch.set_num_threads(a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its handler holds the real stderr, which quiet() cannot redirect

    job = Job(steps=a.steps)
    load_before = os.getloadavg()[0]
    loop_seconds, losses = time_loops(job, a.repeats)
    import_secs = time_imports(IMPORT_REPEATS)
    load_after = os.getloadavg()[0]

    median = lambda runs: {label: statistics.median(v) for label, v in runs.items()}
    lines = format_table(f"loop ({job.steps} optimizer steps, median of {a.repeats})", "hand-written",
                         median(loop_seconds), LOOP_TARGETS)
    lines += [""] + format_table(f"import (fresh interpreter, median of {IMPORT_REPEATS})", "torch+accelerate",
                                 median(import_secs), {"import stoker": "(target <= 1.2)"})
    # the load average and the spread of the runs show whether other work on the machine disturbed them
    lines += ["", f"timed loop runs (seconds; torch threads = {a.threads}; 1-minute load average "
                  f"{load_before:.2f} before, {load_after:.2f} after on {os.cpu_count()} cores):"]
    lines += format_runs(loop_seconds)
    lines += ["", *loss_check(losses)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
