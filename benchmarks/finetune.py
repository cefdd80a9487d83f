"""The main job's speed and memory: LoRA on SmolLM2-135M-Instruct through stoker, transformers.Trainer and TRL.

Every way trains the same LoRA (r 16 on q_proj and v_proj, from the same initial adapter) on the same rows of the
main job (the generated `records` conversations rendered by the model's chat template, loss on the assistant's
answer only), batch 8, the same learning rate, bf16 autocast where the CPU runs it fast (as the main job chooses),
each in a fresh process of its own:

    transformers.Trainer         dynamic padding: each batch padded to its longest row (DataCollatorForSeq2Seq),
                                 transformers' default attention (sdpa)
    transformers.Trainer, eager  the same with eager attention (what the main job uses: a CPU's SDPA backward
                                 is the slower one for short rows), to show what the attention alone gives
    trl.SFTTrainer               packing (its default best-fit strategy, padding-free), completion-only loss
    stoker                       the main job's settings: dynamic padding, eager attention, chunked_loss (the loss
                                 from hidden states in chunks, logits of the answer tokens only), shared_prefix
                                 (the system prompt and instruction every row starts with run once per batch)
    stoker, no shared prefix     the same without shared_prefix, to show what each part gives
    stoker, packing              the same with TrainingArguments(packing=True): rows packed, padding-free

"target tokens per second" is the labelled tokens of the rows (the same for every way) over the seconds of the
train() call; the first steps' cost is in it for every way alike. "peak growth" is the process's peak resident
memory (ru_maxrss) minus its resident memory just before train(): what training adds on top of the loaded model.

It is a measurement, not a test: it prints and exits 0. About twenty minutes on 2 CPU cores, with TRL installed
(`pip install -e ".[benchmarks]"`):

    python benchmarks/finetune.py [--rows 96] [--threads 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import run_child  # noqa: E402

WAYS = ("transformers.Trainer", "transformers.Trainer, eager", "trl.SFTTrainer (packing)", "stoker",
        "stoker, no shared prefix", "stoker, packing")
BATCH, LR, SEED = 8, 1e-3, 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(way: str, rows: int, threads: int) -> dict:
    """Train one way in this process; its target tokens/s and peak memory growth."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker.gguf import local_model, packaged_model
    from stoker.log import third_party_output
    from stoker.recipes.args import DataArguments, fast_bf16
    from stoker.recipes.data import sft_rows
    from stoker.synthetic_tasks import record_splits

    torch.set_num_threads(threads)
    folder = local_model(packaged_model())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = record_splits(rows, 1, seed=SEED)[0]
    chats = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} for p, a in pairs]
    encoded = sft_rows(chats, tokenizer, DataArguments(), "benchmark rows")
    targets = sum(sum(label != -100 for label in r["labels"][1:]) for r in encoded)
    bf16 = fast_bf16(torch.device("cpu"))[0]
    out = tempfile.mkdtemp()
    common = dict(output_dir=out, per_device_train_batch_size=BATCH, learning_rate=LR, num_train_epochs=1,
                  lr_scheduler_type="constant", logging_steps=1000, save_strategy="no", report_to=[],
                  disable_tqdm=True, bf16=bf16, seed=SEED, data_seed=SEED, use_cpu=True, dataloader_num_workers=0)
    with third_party_output():
        model = AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager" if way.startswith("stoker") or "eager" in way else "sdpa")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    torch.manual_seed(SEED)
    if way.startswith("transformers.Trainer"):
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        trainer = Trainer(get_peft_model(model, lora), TrainingArguments(**common), train_dataset=encoded,
                          data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    elif way.startswith("trl"):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}],
                                   "completion": [{"role": "assistant", "content": a}]} for p, a in pairs])
        trainer = SFTTrainer(model, SFTConfig(**common, packing=True, max_length=512, completion_only_loss=True),
                             train_dataset=data, processing_class=tokenizer, peft_config=lora)
    else:
        from stoker import Trainer, TrainingArguments

        extra = ({"packing": True, "packing_length": 512} if "packing" in way
                 else {} if "no shared prefix" in way else {"shared_prefix": True})
        trainer = Trainer(model, TrainingArguments(**common, **extra, chunked_loss=True),
                          train_dataset=encoded, processing_class=tokenizer, peft_config=lora)
    before = rss_bytes()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens_per_s": targets / seconds, "seconds": seconds, "growth_mib": max(peak - before, 0) / 2**20,
            "bf16": bf16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=96, help="training rows (12 steps of 8 with the default)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each way's process")
    p.add_argument("--repeats", type=int, default=1, help="runs of each way, interleaved; medians are shown")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.threads)))
        return
    runs = {way: [] for way in WAYS}
    for _ in range(a.repeats):
        for way in WAYS:
            runs[way].append(run_child(__file__, way, ["--rows", str(a.rows), "--threads", str(a.threads)]))
    med = {way: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "growth_mib")}
           for way, rs in runs.items()}
    base, trl = med["transformers.Trainer"], med["trl.SFTTrainer (packing)"]
    print(f"LoRA on SmolLM2-135M-Instruct, {a.rows} rows of the main job, batch {BATCH}, {a.threads} thread(s), "
          f"bf16 autocast: {runs['stoker'][0]['bf16']}; medians of {a.repeats} run(s), each in a fresh process")
    print(f"{'way':<30}{'target tok/s':>14}{'vs HF':>8}{'vs TRL':>8}{'peak growth MiB':>17}{'vs TRL':>8}")
    for way, m in med.items():
        print(f"{way:<30}{m['tokens_per_s']:>14.1f}{m['tokens_per_s'] / base['tokens_per_s']:>7.2f}x"
              f"{m['tokens_per_s'] / trl['tokens_per_s']:>7.2f}x{m['growth_mib']:>17.0f}"
              f"{m['growth_mib'] / max(trl['growth_mib'], 1):>7.2f}x")


if __name__ == "__main__":
    main()
