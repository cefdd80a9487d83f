"""Overhead of stoker.Trainer against a hand-written Accelerate loop (and transformers.Trainer), in fresh processes.

Every measurement is one fresh Python process that runs one whole script: imports, a tiny Llama built from a
LlamaConfig (nothing is downloaded), generated addition rows, and --steps optimizer steps of training, three
ways:

    hand-written   Accelerator.prepare, then forward / backward / clip / step / schedule / zero_grad, with
                   torch's AdamW and a linear LambdaLR: what a user writes with torch and Accelerate alone
    stoker         stoker.Trainer(model, stoker.TrainingArguments(...)).train()
    transformers   transformers.Trainer(model, transformers.TrainingArguments(...)).train()

All three start from the same weights and see the same rows through the same collate function, batch size
and data seed, with non-fused AdamW (same lr, betas, eps, weight decay on the same parameters), a linear
schedule and the same clipping. Two numbers come from each process:

    loop     the train call alone, timed inside the process: the loader, optimizer, schedule, prepare and the
             steps, and whatever the call imports the first time (which is why it runs in a fresh process)
    script   the process's whole wall time, interpreter start-up included: what `python train.py` costs

The ways run alternately (hand, stoker, transformers, then the order rotates), --repeats times each, and
medians are reported with ratios against the hand-written loop. The held-out loss of each trained model is
printed to show that the three did the same work. A measurement, not a test: it prints and exits 0.

    python benchmarks/overhead.py [--steps 40] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

NUM_TRAIN_ROWS = 2048
NUM_EVAL_ROWS = 128
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.01
SEED = 0
NEVER = 10**6  # logging_steps that never comes due
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("hand-written", "stoker", "transformers")
TARGETS = {("loop", "stoker"): "(target <= 1.03)", ("script", "stoker"): "(target <= 1.05)"}


# ---------------------------------------------------------------------------------------------------
# what every child builds, with nothing but torch and transformers' model classes (the hand-written script
# must not pay for importing stoker)

VOCAB = {c: i for i, c in enumerate("_0123456789+=", start=1)}  # 0 is padding


def rows(n: int, offset: int) -> list[dict]:
    """Addition problems '37+45=082' as token ids, with the loss on the answer only."""
    rng = random.Random(SEED + offset)
    out = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, answer = [VOCAB[c] for c in f"{a:02d}+{b:02d}="], [VOCAB[c] for c in f"{a + b:03d}"]
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def collate(features: list[dict]) -> dict:
    import torch

    width = max(len(f["input_ids"]) for f in features)
    pad = lambda key, value: torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])
    ids = pad("input_ids", 0)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad("labels", -100)}


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(VOCAB) + 1, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def decay_split(model) -> list[dict]:
    """Weight decay on weights, none on biases and norm weights, each parameter once (as both trainers do)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:  # a tied weight appears under two modules
                seen.add(id(p))
                (no_decay if name == "bias" or "norm" in type(module).__name__.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def hand_written(model, train: list[dict], steps: int, output_dir: str):
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, RandomSampler

    def run():
        torch.manual_seed(SEED)  # as both trainers seed at the start of train()
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                      data_seed=SEED))
        sampler = RandomSampler(train, generator=torch.Generator().manual_seed(SEED))
        loader = DataLoader(train, batch_size=BATCH_SIZE, sampler=sampler, collate_fn=collate)
        optimizer = torch.optim.AdamW(decay_split(model), lr=LEARNING_RATE)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, (steps - step) / steps))
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        prepared.train()
        step, epoch = 0, 0
        while step < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                accelerator.backward(prepared(**batch).loss)
                accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step == steps:
                    break
            epoch += 1

    return run


def trainer_arguments(steps: int, output_dir: str) -> dict:
    """Keyword arguments that stoker.TrainingArguments and transformers.TrainingArguments read alike."""
    return dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=BATCH_SIZE,
                learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, optim="adamw_torch", lr_scheduler_type="linear",
                seed=SEED, data_seed=SEED, logging_steps=NEVER, save_strategy="no", report_to="none",
                disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)


def with_stoker(model, train, steps, output_dir):
    import stoker

    args = stoker.TrainingArguments(**trainer_arguments(steps, output_dir))
    return stoker.Trainer(model, args, train_dataset=train, data_collator=collate).train


def with_transformers(model, train, steps, output_dir):
    import transformers

    args = transformers.TrainingArguments(**trainer_arguments(steps, output_dir))
    return transformers.Trainer(model=model, args=args, train_dataset=train, data_collator=collate).train


def child(way: str, steps: int, threads: int, output_dir: str) -> None:
    """One measurement: build, train (timed), and print {"loop": seconds, "loss": held-out loss} as JSON."""
    import torch

    torch.set_num_threads(threads)
    model, train = build_model(), rows(NUM_TRAIN_ROWS, 0)
    build = {"hand-written": hand_written, "stoker": with_stoker, "transformers": with_transformers}[way]
    train_call = build(model, train, steps, output_dir)
    started = time.perf_counter()
    train_call()
    loop = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        loss = model(**{k: v.to(model.device) for k, v in collate(rows(NUM_EVAL_ROWS, 1)).items()}).loss.item()
    print(json.dumps({"loop": loop, "loss": loss}))


# ---------------------------------------------------------------------------------------------------
# the parent: alternate fresh processes, then report medians and ratios


def measure(way: str, steps: int, threads: int, output_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "TRANSFORMERS_VERBOSITY": "error"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", way, "--steps", str(steps),
                           "--threads", str(threads), "--output_dir", output_dir],
                          capture_output=True, text=True, env=env, cwd=REPO)
    script = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"{way}: the measured process failed ({done.returncode})")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "script": script}


def table(part: str, results: dict[str, list[dict]]) -> list[str]:
    medians = {way: statistics.median(r[part] for r in runs) for way, runs in results.items()}
    base = medians["hand-written"]
    lines = [f"{part + ' (median seconds)':<28}{'seconds':>9}   ratio vs hand-written"]
    for way, value in medians.items():
        lines.append(f"  {way:<26}{value:>9.3f}   {value / base:>5.3f}   {TARGETS.get((part, way), '')}".rstrip())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per training run")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per way")
    # one thread by default: with as many threads as cores, any other busy process on the machine stalls
    # torch's thread pool and slows a run several-fold, which swamps a few per cent of difference
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every measured process")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.steps < 1 or a.repeats < 1 or a.threads < 1:
        parser.error("--steps, --repeats and --threads must be positive integers")
    if a.child:
        child(a.child, a.steps, a.threads, a.output_dir)
        return 0
    ways = ["hand-written"] + [w for w in a.ways if w != "hand-written"]
    results = {way: [] for way in ways}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        measure("hand-written", a.steps, a.threads, tmp)  # untimed: warms the OS file cache for every way
        for repeat in range(a.repeats):
            order = ways[repeat % len(ways):] + ways[:repeat % len(ways)]
            for way in order:
                results[way].append(measure(way, a.steps, a.threads, os.path.join(tmp, f"{way}-{repeat}")))
    lines = [f"{a.steps} optimizer steps of a tiny Llama, {a.repeats} fresh processes per way, alternating; "
             f"torch threads = {a.threads}", ""]
    lines += table("loop", results) + [""] + table("script", results)
    lines += ["", f"runs (loop / script seconds; 1-minute load average {load_before:.2f} before, "
                  f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores):"]
    lines += [f"  {way}: " + ", ".join(f"{r['loop']:.2f}/{r['script']:.2f}" for r in runs) for way, runs in
              results.items()]
    losses = {way: runs[-1]["loss"] for way, runs in results.items()}
    lines += ["", "held-out loss after training (equal values = the ways did the same work):"]
    lines += [f"  {way:<26}{loss:>9.4f}" for way, loss in losses.items()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
