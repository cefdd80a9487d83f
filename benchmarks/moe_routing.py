"""What moe_aux_loss_scope='global_batch' costs: the routing pass (stoker.loss.load_balancing), one forward of the
model's body without gradients per micro-batch before the window's first backward, against 'micro_batch', which
has none.

A Qwen2-MoE built from a config (nothing is downloaded: 4 layers, hidden 128, 8 experts of which 2 are routed to
per token, a shared expert, vocabulary 4096, output_router_logits=True) trains on rows of 64 to 192 tokens, batch
4 x accumulation 4, SGD. Each scope runs in a fresh process of its own (imports and allocator state count the same
for both), --repeats times, interleaved; a run's step time is the median over its optimizer steps after the first
(the warm-up), in wall-clock and in process CPU seconds (with one torch thread the CPU seconds are the work
done, and hardly move when other processes load the machine). Reported: the median step time of each scope and
their ratio. The pass skips the lm_head (logits_to_keep=1), so a large vocabulary adds little to it.

It is a measurement, not a test: it prints and exits 0. About a minute on 2 idle CPU cores:

    python benchmarks/moe_routing.py [--steps 6] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fresh_process import run_child  # noqa: E402

SCOPES = ("micro_batch", "global_batch")


def child(scope: str, steps: int, threads: int) -> dict:
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from stoker import Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.01, pad_token_id=0))
    rng = random.Random(1)
    rows = []
    for _ in range(16 * steps):
        ids = [rng.randrange(3, 4096) for _ in range(rng.randint(64, 192))]
        rows.append({"input_ids": ids, "labels": ids})

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []  # (wall, cpu) seconds at the first step's start and at each step's end

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                self.ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, save_strategy="no",
                                 logging_strategy="no", optim="sgd", learning_rate=0.01, max_steps=steps,
                                 per_device_train_batch_size=4, gradient_accumulation_steps=4, use_cpu=True,
                                 moe_aux_loss_scope=scope, seed=3)
        Trainer(model, args, train_dataset=rows, callbacks=[clock]).train()
    steps_after_first = list(zip(clock.ends[1:], clock.ends[2:], strict=False))
    return {"wall": statistics.median(b[0] - a[0] for a, b in steps_after_first),
            "cpu": statistics.median(b[1] - a[1] for a, b in steps_after_first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", default=None)
    a = parser.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.threads)))
        return
    runs = {scope: [] for scope in SCOPES}
    for _ in range(a.repeats):
        for scope in SCOPES:
            runs[scope].append(run_child(__file__, scope, ["--steps", str(a.steps), "--threads", str(a.threads)],
                                         fixed_malloc=False))
    median = {(scope, k): statistics.median(r[k] for r in runs[scope]) for scope in SCOPES for k in ("wall", "cpu")}
    print(f"Qwen2-MoE (4 layers, 8 experts, top 2), batch 4 x accumulation 4, {a.threads} thread(s), "
          f"median of {a.repeats} fresh processes; seconds per optimizer step")
    print(f"  {'moe_aux_loss_scope':20} {'wall':>8} {'cpu':>8}")
    for scope in SCOPES:
        print(f"  {scope:20} {median[scope, 'wall']:8.3f} {median[scope, 'cpu']:8.3f}")
    print("  global_batch / micro_batch (the routing pass): "
          + ", ".join(f"{median['global_batch', k] / median['micro_batch', k]:.2f}x {k}" for k in ("wall", "cpu")))


if __name__ == "__main__":
    main()
