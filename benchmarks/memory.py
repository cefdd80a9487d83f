"""Peak memory and tokens per second: chunked loss, gradient checkpointing and 8-bit AdamW, side by side
with transformers.Trainer and a hand-written Accelerate loop.

One Llama (hidden 256, 2 layers, vocab 32000, built from a LlamaConfig: nothing is downloaded) trains
--steps optimizer steps on micro-batches of --batch rows of 512 tokens, each configuration in a fresh
Python process, so that its peak resident memory (resource.getrusage(RUSAGE_SELF).ru_maxrss) is its own:

    transformers.Trainer              transformers.Trainer(model, transformers.TrainingArguments(...)).train()
    hand-written Accelerate loop      Accelerator.prepare, then forward / backward / clip / step / zero_grad
    stoker.Trainer                    the same arguments through stoker
    stoker + chunked_loss             the loss from the hidden states in chunks (stoker.loss.chunked)
    stoker + gradient_checkpointing   activations recomputed in backward
    stoker + adamw_8bit               bitsandbytes' 8-bit AdamW states instead of float32 ones
    stoker + all three

At vocab 32k and 2048 tokens per micro-batch the float32 logits are 250 MiB, and transformers' loss holds
them, their log-softmax and their gradient: the largest allocation of the step for a model this size. Every
run uses the same weights, data, non-fused AdamW (but the 8-bit rows), learning rate and seed, float32 on
the CPU. Reported: peak RSS of the process, the part of it added by training (peak minus the RSS after the
model and trainer are built: imports and weights are common to all), and target tokens per second of the
train call (wall clock, and process CPU time, which other load on the machine hardly moves).

The children run with MALLOC_MMAP_THRESHOLD_=131072 (unless --default-malloc): by default glibc raises its
mmap threshold as large blocks are freed and then keeps later freed blocks in its heap, so peak RSS carries
up to tens of percent of retained, unused memory that varies from run to run (here +-90 MiB); with a fixed
threshold every large block returns to the system when freed and peak RSS is the peak of memory in use,
the CPU counterpart of torch.cuda.max_memory_allocated.

It is a measurement, not a test: it prints and exits 0. About four minutes on 2 idle CPU cores:

    python benchmarks/memory.py [--steps 6] [--batch 4] [--threads 1] [--default-malloc]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
from fresh_process import run_child

SEQ_LEN = 512
VOCAB = 32000

# label -> (builder name, TrainingArguments extras); the first is the baseline of the ratios
CONFIGS = {
    "transformers.Trainer": ("transformers", {}),
    "hand-written Accelerate loop": ("hand", {}),
    "stoker.Trainer": ("stoker", {}),
    "stoker + chunked_loss": ("stoker", {"chunked_loss": True}),
    "stoker + gradient_checkpointing": ("stoker", {"gradient_checkpointing": True}),
    "stoker + adamw_8bit": ("stoker", {"optim": "adamw_8bit"}),
    "stoker + all three": ("stoker", {"chunked_loss": True, "gradient_checkpointing": True, "optim": "adamw_8bit"}),
}
TARGETS = {"stoker + chunked_loss": "(targets: peak <= 0.6, tokens/s >= 0.9)"}


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def trainer_arguments(steps: int, batch: int, output_dir: str) -> dict:
    """Keyword arguments that stoker.TrainingArguments and transformers.TrainingArguments read alike."""
    return dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
                optim="adamw_torch", lr_scheduler_type="constant", seed=0, data_seed=0, logging_steps=10**6,
                save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                dataloader_pin_memory=False)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(label: str, steps: int, batch: int, threads: int) -> dict:
    """Run one configuration in this (fresh) process; returns its measurements."""
    torch.set_num_threads(threads)
    # modules that one trainer imports in its constructor and another inside train(): imported here, so
    # that no timed call pays for an import (transformers.trainer_utils alone pulls in peft, seconds)
    import transformers.optimization  # noqa: F401
    import transformers.trainer_utils  # noqa: F401

    from stoker.data import PaddingCollator

    kind, extra = CONFIGS[label]
    rows = build_rows(steps * batch)
    collator = PaddingCollator(0)
    out = tempfile.mkdtemp()
    if kind == "transformers":
        import transformers

        trainer = transformers.Trainer(model=build_model(), args=transformers.TrainingArguments(
            **trainer_arguments(steps, batch, out)), train_dataset=rows, data_collator=collator)
        train = trainer.train
    elif kind == "stoker":
        import stoker

        args = stoker.TrainingArguments(**{**trainer_arguments(steps, batch, out), **extra})
        train = stoker.Trainer(build_model(), args, train_dataset=rows, data_collator=collator).train
    else:
        from accelerate import Accelerator
        from torch.utils.data import DataLoader

        accelerator = Accelerator(cpu=True)
        model = build_model()

        def train():
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loader = DataLoader(rows, batch_size=batch, shuffle=True, collate_fn=collator)
            prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            prepared.train()
            for batch_ in loader:
                accelerator.backward(prepared(**batch_).loss)
                accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    before = current_rss()
    started, started_cpu = time.perf_counter(), time.process_time()
    train()
    wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    targets = steps * batch * (SEQ_LEN - 1)
    return {"peak": peak, "before": before, "wall": wall, "cpu": cpu, "targets": targets}


def measure(label: str, steps: int, batch: int, threads: int, default_malloc: bool) -> dict:
    return run_child(__file__, label, ["--steps", str(steps), "--batch", str(batch), "--threads", str(threads)],
                     fixed_malloc=not default_malloc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per configuration")
    parser.add_argument("--batch", type=int, default=4, help="rows of 512 tokens per micro-batch")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every child")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = child(a.child, a.steps, a.batch, a.threads)
        print(json.dumps(result))
        return 0
    load_before = os.getloadavg()[0]
    results = {label: measure(label, a.steps, a.batch, a.threads, a.default_malloc) for label in CONFIGS}
    load_after = os.getloadavg()[0]

    gib = 2**30
    base = next(iter(results.values()))
    base_added = base["peak"] - base["before"]
    lines = [f"Llama hidden 256 x 2 layers, vocab {VOCAB}, {a.batch} x {SEQ_LEN} tokens per micro-batch, "
             f"{a.steps} steps, float32 on the CPU, one fresh process each, "
             + ("glibc's default malloc" if a.default_malloc else "MALLOC_MMAP_THRESHOLD_=131072"),
             f"{'':<34}{'peak GiB':>9}{'added GiB':>10}{'tok/s':>8}{'tok/CPU s':>10}"
             "   ratio vs transformers: peak, added, tok/s, tok/CPU s"]
    base_tps, base_tpc = base["targets"] / base["wall"], base["targets"] / base["cpu"]
    for label, r in results.items():
        added = r["peak"] - r["before"]
        tps, tpc = r["targets"] / r["wall"], r["targets"] / r["cpu"]
        lines.append(
            f"{label:<34}{r['peak'] / gib:>9.3f}{added / gib:>10.3f}{tps:>8.0f}{tpc:>10.0f}   "
            f"{r['peak'] / base['peak']:>5.2f} {added / base_added:>6.2f} {tps / base_tps:>6.2f} "
            f"{tpc / base_tpc:>6.2f}   {TARGETS.get(label, '')}".rstrip())
    lines += ["", f"torch threads = {a.threads}; 1-minute load average {load_before:.2f} before, {load_after:.2f} "
                  f"after on {os.cpu_count()} cores"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
