"""torch_compile's three ways side by side, each in a fresh process: eager, the decoder layers compiled in place
(compile_scope="blocks", stoker's default scope for a transformers decoder) and the whole model ("model",
transformers.Trainer's torch_compile). A Llama built from a config, sdpa attention, rows of one length (or of many
lengths with --lengths varied), stoker.Trainer with its plain settings. Prints, per way: the first step (which
compiles), the median of the steps after the warm-up, and what compiling cost over eager in seconds.

    python benchmarks/compile.py                       # tiny sizes, a few minutes on a CPU
    python benchmarks/compile.py --hidden 1024 --layers 24 --seq 2048 --batch 8 --bf16   # the GPU job

Never pass/fail. On a CPU the figures are CPU evidence only: inductor's CPU code, no flash kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fresh_process import run_child  # noqa: E402

WAYS = {"eager": {}, "blocks": {"compile_scope": "blocks"}, "model": {"compile_scope": "model"}}


def child(way: str, o) -> dict:
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stoker import Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=o.hidden * 4,
                         num_hidden_layers=o.layers, num_attention_heads=max(o.hidden // 64, 4),
                         num_key_value_heads=max(o.hidden // 64, 4), max_position_embeddings=o.seq,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    rng = random.Random(0)
    steps = o.warmup + o.steps
    rows = []
    for _ in range(steps * o.batch):
        n = o.seq if o.lengths == "equal" else rng.randint(o.seq // 4, o.seq)
        ids = [rng.randint(1, o.vocab - 1) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": ids})
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    args = TrainingArguments(output_dir=o.out, report_to="none", disable_tqdm=True, save_strategy="no",
                             logging_steps=10_000, per_device_train_batch_size=o.batch, max_steps=steps,
                             bf16=o.bf16, **({"torch_compile": True, **WAYS[way]} if way != "eager" else {}))
    Trainer(model, args, train_dataset=rows, callbacks=[Clock()]).train()
    return {"first": times[0], "median": statistics.median(times[o.warmup:]), "warm_up": sum(times[:o.warmup])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="steps not timed (the first compiles)")
    p.add_argument("--lengths", choices=["equal", "varied"], default="equal")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--ways", default="eager,blocks,model")
    p.add_argument("--out", default="/tmp/stoker_compile_bench")
    o = p.parse_args()
    if o.child:
        print(json.dumps(child(o.child, o)))
        return
    forwarded = sys.argv[1:]
    results = {way: run_child(__file__, way, forwarded) for way in o.ways.split(",")}
    eager = results.get("eager")
    print(f"{'way':8} {'first step s':>13} {'median step s':>14} {'x eager':>8} {'warm-up over eager s':>21}")
    for way, r in results.items():
        ratio = eager["median"] / r["median"] if eager else float("nan")
        extra = r["warm_up"] - eager["warm_up"] if eager else float("nan")
        print(f"{way:8} {r['first']:13.3f} {r['median']:14.4f} {ratio:8.2f} {extra:21.1f}")


if __name__ == "__main__":
    main()
