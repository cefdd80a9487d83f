"""Speed on one GPU, side by side: the same jobs through a hand-written loop, transformers.Trainer, stoker with a
script's settings and stoker with its fast settings; tokens/s, MFU and peak memory, each way in a fresh process.

    python benchmarks/gpu_speed.py                 # every job and way, within --budget seconds (default 300)
    python benchmarks/gpu_speed.py --jobs full lora --ways transformers stoker
    python benchmarks/gpu_speed.py --rehearse      # tiny sizes on a CPU, a few steps each (the test suite)

Jobs (a Llama built from a config, nothing downloaded; sdpa attention, bf16 autocast, fused AdamW, lr 1e-4,
gradient clipping at 1.0, as docs/speed.md reports it):

    full     full fine-tune of a 374M Llama (hidden 1024, 24 layers, vocab 32000, untied head), rows of 2048
             tokens, batch 8
    padded   the same model on rows of 64-2048 tokens, each batch padded to its longest row
    packed   the same rows packed into rows of 2048 tokens (position_ids restarting per sequence, no padding)
    lora     LoRA r=16 on every linear layer of the same model, the frozen base in bf16, rows of 2048 tokens

Ways:

    hand           model.to(device), torch's fused AdamW, then per step: autocast forward, backward, clip, step,
                   zero_grad (what a user writes with torch alone)
    transformers   transformers.Trainer(model, TrainingArguments(bf16=True, optim="adamw_torch_fused", ...))
    stoker         stoker.Trainer with the same settings as a script gives them (bf16=True, ...)
    stoker_fast    stoker.Trainer with its fast settings: FAST_SETTINGS, each applied where stoker's
                   TrainingArguments has the field (so that settings added later are picked up by name), and
                   packing=True for the packed job

Each way runs in a fresh Python process (imports, CUDA context and compilation inside it) that runs the jobs in
JOBS' order, the most important first, each on a model built anew on the device, the memory of the one before
freed and the peak statistics reset. Each job trains WARMUP_STEPS optimizer steps that are not timed, then the
timed ones: the device is synchronised once when the warm-up ends and once after the last step, the same for every
way, so that what a way overlaps between the host and the device (the deferred check, non-blocking copies) shows in
its time; a synchronisation after every step would hide it. Tokens/s counts real tokens (padding excluded): the
job's mean real tokens per step times the steps timed, over their time. MFU is stoker.diagnostics' (6N per trained
token, 4N per frozen one, plus attention over each sequence's own length) against the card's bf16 peak.

The whole script keeps within a budget (gpu_check's Budget): each way's process gets an equal share of the time
left (a way that finishes early leaves its rest to the ways after it) and prints each job's result as it is done,
so that a way cut off by its share keeps the jobs it finished, and the rows it did not reach say so. gpu_all.sh
runs it after gpu_check.py in one 10-minute command and prints one table of both. A measurement, not a test: it
prints a table and exits 0 unless a way failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_check  # noqa: E402  (this folder: its Budget, which gpu_all.sh's two scripts share)
import torch  # noqa: E402

WARMUP_STEPS = 3
JOBS = ("full", "lora", "padded", "packed")  # in this order within the budget: the headline table first
WAYS = ("hand", "transformers", "stoker", "stoker_fast")
MODEL_374M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)  # 374M parameters
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=128, tie_word_embeddings=False)
# the fast path, by name: each applied where stoker's TrainingArguments has the field (later additions that
# speed a step up belong here); torch_compile is left out of the rehearsal (minutes of compiling on a CPU)
FAST_SETTINGS = {"torch_compile": True, "dataloader_pin_memory": True, "dataloader_num_workers": 2}
COMMON = dict(learning_rate=1e-4, max_grad_norm=1.0, weight_decay=0.0, lr_scheduler_type="constant", seed=0)


class Sizes:
    """A job's sizes: the model, the row length, the batch and the optimizer steps (warm-up included)."""

    def __init__(self, rehearse: bool, steps: int | None = None):
        self.model = TINY if rehearse else MODEL_374M
        self.seq_len, self.batch = (32, 2) if rehearse else (2048, 8)
        self.min_len = 4 if rehearse else 64
        self.steps = steps or (WARMUP_STEPS + (3 if rehearse else 8))


# ---------------------------------------------------------------------------------------------------
# the data: every way sees the same rows in the same order (no shuffling), so the same batches


def row_lengths(job: str, s: Sizes) -> list[int]:
    """The lengths of the rows a job trains on: full and lora, seq_len each; padded and packed, uniform in
    [min_len, seq_len], as many as fill steps x batch rows of seq_len."""
    if job in ("full", "lora"):
        return [s.seq_len] * (s.steps * s.batch)
    rng, lengths = random.Random(0), []
    while sum(lengths) < s.steps * s.batch * s.seq_len:
        lengths.append(rng.randint(s.min_len, s.seq_len))
    return lengths


def sequences(job: str, s: Sizes) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1, s.model["vocab_size"]) for _ in range(n)] for n in row_lengths(job, s)]


def pack(seqs: list[list[int]], seq_len: int) -> list[dict]:
    """Sequences packed in order into rows of exactly seq_len tokens (the last sequence of a row cut at its
    end), position_ids restarting at each sequence, its first token not a target of the previous one."""
    out, ids, pos, labels = [], [], [], []
    for seq in seqs:
        for start in range(0, len(seq), seq_len):
            piece = seq[start:start + seq_len]
            while piece:
                room = seq_len - len(ids)
                take, piece = piece[:room], piece[room:]
                ids += take
                pos += list(range(len(take)))
                labels += [-100] + take[1:]
                if len(ids) == seq_len:
                    out.append({"input_ids": ids, "position_ids": pos, "labels": labels})
                    ids, pos, labels = [], [], []
    return out


def rows(job: str, s: Sizes) -> list[dict]:
    """The rows a way trains on, steps x batch of them (the packed job's fit in fewer steps: cycled)."""
    seqs = sequences(job, s)
    if job == "packed":
        packed = pack(seqs, s.seq_len)
        return [packed[i % len(packed)] for i in range(s.steps * s.batch)]
    return [{"input_ids": q, "labels": q} for q in seqs[:s.steps * s.batch]]


def pad(batch: list[dict]) -> dict:
    """Right-padding to the batch's longest row (labels -100 and attention_mask 0 on padding): what a script's
    collator does; rows of one length come out as they are, with a mask of ones."""
    longest = max(len(r["input_ids"]) for r in batch)
    out = {"input_ids": [], "labels": [], "attention_mask": []}
    for r in batch:
        n = longest - len(r["input_ids"])
        out["input_ids"].append(r["input_ids"] + [0] * n)
        out["labels"].append(r["labels"] + [-100] * n)
        out["attention_mask"].append([1] * len(r["input_ids"]) + [0] * n)
    if "position_ids" in batch[0]:  # packed rows, all of seq_len: no mask (sdpa finds the sequences)
        out = {"input_ids": out["input_ids"], "labels": out["labels"],
               "position_ids": [r["position_ids"] for r in batch]}
    return {k: torch.tensor(v) for k, v in out.items()}


def tokens_and_attention(job: str, s: Sizes, stoker_packs: bool = False) -> tuple[float, float]:
    """(real tokens per optimizer step, the mean over tokens of their own sequence's length) of a job. Packed
    rows are all real tokens; rows stoker packs itself (best-fit-decreasing) hold what its packer put there."""
    lengths = row_lengths(job, s)
    attention = sum(n * n for n in lengths) / sum(lengths)
    if job == "padded":
        trained = lengths[:s.steps * s.batch]
        return sum(trained) / s.steps, sum(n * n for n in trained) / sum(trained)
    if job == "packed" and stoker_packs:
        from stoker.packing import pack_rows

        packed = pack_rows([{"input_ids": q} for q in sequences(job, s)], s.seq_len)
        return sum(lengths) / (len(packed) / s.batch), attention
    return float(s.batch * s.seq_len), attention


# ---------------------------------------------------------------------------------------------------
# one way, in its own process


def build_model(job: str, s: Sizes, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**s.model, max_position_embeddings=s.seq_len)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # initialised on the device: seconds less per job on a GPU than on its host
        model = LlamaForCausalLM(config)
    peft_config = None
    if job == "lora":
        from peft import LoraConfig

        model.to(torch.bfloat16)  # the frozen base in bf16; peft keeps the adapters in float32
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    return model, peft_config


class StepTimes:
    """The time of the timed steps: `mark()` is called as each optimizer step is queued; the device is synchronised
    only where the warm-up ends and after the last of `steps`, the clock read there, so that the host and the device
    overlap between them as they do in training."""

    def __init__(self, device: torch.device, steps: int):
        self.device, self.steps, self.done, self.ends = device, steps, 0, []

    def mark(self) -> None:
        self.done += 1
        if self.done in (WARMUP_STEPS, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    @property
    def steps_timed(self) -> int:
        return self.done - WARMUP_STEPS

    def seconds_per_step(self) -> float:
        return (self.ends[-1] - self.ends[0]) / self.steps_timed


def run_hand(job: str, s: Sizes, device: torch.device, times: StepTimes):
    model, peft_config = build_model(job, s, device)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=COMMON["learning_rate"], weight_decay=0.0, fused=True)
    data, losses = rows(job, s), []
    for step in range(s.steps):
        batch = {k: v.to(device, non_blocking=True)
                 for k, v in pad(data[step * s.batch:(step + 1) * s.batch]).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, COMMON["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        times.mark()
    return model, float(torch.stack(losses).float().mean())  # the mean, as the Trainers' training_loss


def run_transformers(job: str, s: Sizes, device: torch.device, times: StepTimes, out: str):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.mark()

    model, peft_config = build_model(job, s, device)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    args = TrainingArguments(output_dir=out, max_steps=s.steps, per_device_train_batch_size=s.batch, bf16=True,
                             optim="adamw_torch_fused", report_to="none", disable_tqdm=True, save_strategy="no",
                             logging_steps=s.steps, use_cpu=device.type == "cpu", **COMMON)
    trainer = Trainer(model, args, train_dataset=rows(job, s), data_collator=pad, callbacks=[Mark()])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    result = trainer.train()
    return trainer.model, result.training_loss


def fast_settings(rehearse: bool) -> tuple[dict, list[str]]:
    """FAST_SETTINGS that stoker's TrainingArguments has (and not torch_compile in the rehearsal), and the names
    it lacks."""
    import dataclasses

    from stoker import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    wanted = {k: v for k, v in FAST_SETTINGS.items() if not (rehearse and k == "torch_compile")}
    return {k: v for k, v in wanted.items() if k in fields}, [k for k in wanted if k not in fields]


def run_stoker(job: str, s: Sizes, device: torch.device, times: StepTimes, out: str, fast: bool, rehearse: bool):
    from stoker import Trainer, TrainerCallback, TrainingArguments

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.mark()

    model, peft_config = build_model(job, s, device)
    extra, collator, data = {}, pad, rows(job, s)
    if fast:
        extra = fast_settings(rehearse)[0]
        collator = None  # stoker's own collator (it pads, and counts tokens on the host)
        if job == "packed":  # stoker packs the raw sequences itself
            extra.update(packing=True, packing_length=s.seq_len)
            data = [{"input_ids": q, "labels": q} for q in sequences(job, s)]
    args = TrainingArguments(output_dir=out, max_steps=s.steps, per_device_train_batch_size=s.batch, bf16=True,
                             optim="adamw_torch_fused", report_to="none", disable_tqdm=True, save_strategy="no",
                             logging_steps=s.steps, use_cpu=device.type == "cpu", dataloader_in_order=True,
                             **COMMON, **extra)
    trainer = Trainer(model, args, train_dataset=data, data_collator=collator, callbacks=[Mark()],
                      peft_config=peft_config)
    result = trainer.train()
    return trainer.accelerator.unwrap_model(trainer.model_wrapped), result.training_loss


def child(job: str, way: str, rehearse: bool, steps: int | None) -> dict:
    """One way of one job in this process: its tokens/s, MFU, peak memory and last loss."""
    import gc
    import tempfile

    from stoker import diagnostics

    s = Sizes(rehearse, steps)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    times = StepTimes(device, s.steps)
    gc.collect()  # the job before it in this process: its model, optimizer and Trainer gone, its peak forgotten
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # TF32 as each way leaves it: stoker turns it on for what bf16 autocast leaves in float32 (gpu_defaults), the
    # others keep torch's setting; the matmuls that count run in bf16 in every way
    with tempfile.TemporaryDirectory() as out:
        if way == "hand":
            model, loss = run_hand(job, s, device, times)
        elif way == "transformers":
            model, loss = run_transformers(job, s, device, times, out)
        else:
            model, loss = run_stoker(job, s, device, times, out, way == "stoker_fast", rehearse)
    per_step, attention = tokens_and_attention(job, s, way == "stoker_fast")
    tokens_per_s = per_step / times.seconds_per_step()
    peak = diagnostics.peak_tflops(torch.cuda.get_device_name(), "bf16") if device.type == "cuda" else None
    mfu = None
    if peak is not None:
        per_token = diagnostics.flops_per_token(*diagnostics.model_flops_shape(model), seq_len=attention)
        mfu = diagnostics.mfu(tokens_per_s, per_token, peak, 1)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"job": job, "way": way, "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_gb": peak_gb, "loss": loss,
            "steps_timed": times.steps_timed}


# ---------------------------------------------------------------------------------------------------
# the parent: every (job, way) in a fresh process, within the budget


def measure(jobs: list[str], way: str, rehearse: bool, steps: int | None, timeout: float) -> tuple[list[dict], str]:
    """The results of `way` on `jobs` in order, in one fresh process within `timeout` seconds, and why it stopped
    short of the last job ("" if it did not): the jobs it finished before its time ran out are kept."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(jobs), way] \
        + (["--rehearse"] if rehearse else []) + (["--steps", str(steps)] if steps else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, returncode, stopped = done.stdout, done.stderr, done.returncode, ""
    except subprocess.TimeoutExpired as e:  # what it printed before: the jobs it finished
        stdout, stderr, returncode = (_text(e.stdout), _text(e.stderr), None)
        stopped = f"out of this way's share of the budget ({e.timeout:.0f}s)"
    results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if returncode not in (0, None) or (returncode == 0 and len(results) < len(jobs)):
        raise RuntimeError(f"the child failed ({returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return results, stopped


def _text(output) -> str:
    """A timed-out child's output so far (bytes, whatever `text` asked for, or None)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def row_text(job: str, way: str, status: str, r: dict | None, base: dict) -> str:
    if r is None:
        return f"{job:<8} {way:<13} {status}"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
    ratios = " ".join(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x {name}" for name, b in base.items()
                      if name != way and b.get("tokens_per_s"))
    return (f"{job:<8} {way:<13} {r['tokens_per_s']:>11,.0f} {mfu:>7} {r['peak_gb']:>9.2f} {r['loss']:>8.4f}  "
            f"{ratios}")


def table_rows(results: dict, skipped: dict, failed: list[str]) -> list[dict]:
    """The rows of gpu_all.sh's one table (gpu_check.append_rows): each (job, way) measured, skipped or failed."""
    rows = []
    for job, done in results.items():
        for way, r in done.items():
            ratios = " ".join(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x {name}" for name, b in done.items()
                              if name != way and b.get("tokens_per_s"))
            rows.append({"name": f"speed {job}/{way}", "status": "ok", "tokens_per_s": r["tokens_per_s"],
                         "mfu": r["mfu"], "peak_gb": r["peak_gb"], "note": f"loss {r['loss']:.4f}; {ratios}"})
    rows += [{"name": f"speed {job}/{way}", "status": "SKIPPED", "note": why} for (job, way), why in skipped.items()]
    return rows + [{"name": f"speed {name}", "status": "FAILED", "note": "see above"} for name in failed]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="*", choices=JOBS, default=list(JOBS))
    parser.add_argument("--ways", nargs="*", choices=WAYS, default=list(WAYS))
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes on a CPU, a few steps")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per way, {WARMUP_STEPS} warm-up ones included")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the whole script")
    parser.add_argument("--table", help="also append the table's rows to this file as JSON lines (gpu_all.sh)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.steps is not None and a.steps < WARMUP_STEPS + 2:
        parser.error(f"--steps {a.steps}: at least {WARMUP_STEPS + 2} (the warm-up and two timed steps)")
    if a.child:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        jobs, way = a.child
        for job in jobs.split(","):
            print("RESULT " + json.dumps(child(job, way, a.rehearse, a.steps)), flush=True)
        return 0
    if not torch.cuda.is_available() and not a.rehearse:
        print("gpu_speed: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure "
              "(--rehearse runs tiny sizes on the CPU)")
        return 0
    budget = gpu_check.Budget(total=a.budget, reserve=5.0)
    where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
             if torch.cuda.is_available() else f"CPU rehearsal, torch {torch.__version__}")
    applied, missing = fast_settings(a.rehearse)
    print(f"gpu_speed: {where}; stoker_fast adds {applied}" + (f" (not in stoker: {missing})" if missing else ""))
    failed, skipped, results = [], {}, {job: {} for job in a.jobs}
    for i, way in enumerate(a.ways):  # each way in its own process, the jobs in order, an equal share of what is left
        if not budget.may_start():
            skipped.update({(job, way): f"out of time budget, {budget.left():.0f}s left" for job in a.jobs})
            continue
        try:
            done, stopped = measure(a.jobs, way, a.rehearse, a.steps, budget.left() / (len(a.ways) - i))
        except Exception as e:  # one failed way must not hide the others
            failed += [f"{job}/{way}" for job in a.jobs]
            print(row_text(",".join(a.jobs), way, f"FAILED {type(e).__name__}: {str(e).strip()[-600:]}", None, {}),
                  flush=True)
            continue
        for r in done:
            results[r["job"]][way] = r
        skipped.update({(job, way): stopped for job in a.jobs if way not in results[job]})
    for (job, way), why in skipped.items():
        print(row_text(job, way, f"SKIPPED ({why})", None, {}), flush=True)
    print(f"\n{'job':<8} {'way':<13} {'tokens/s':>11} {'MFU':>7} {'peak GiB':>9} {'loss':>8}  speed against the "
          "others")
    for job, done in results.items():
        for way, r in done.items():
            print(row_text(job, way, "ok", r, done))
    if a.table:
        gpu_check.append_rows(a.table, table_rows(results, skipped, failed))
    print(f"gpu_speed: {len(failed)} failed ({', '.join(failed) or 'none'}) in "
          f"{budget.clock() - budget.started:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
