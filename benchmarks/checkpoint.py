"""What a checkpoint costs the training loop, synchronous against asynchronous (async_save), in fresh processes.

Each mode is one fresh Python process that trains a Llama of about 106M parameters in float32 with AdamW (a
checkpoint of about 1.2 GiB: weights and two moments) on one thread (torch.set_num_threads(1): the second core
stands for the host CPUs a GPU job leaves idle, where the writer thread runs), saving every --save_steps steps
into a temporary folder on disk (fsync included). Three numbers come from each process:

    save stall     the time a save step keeps the loop from its next step (on_step_end of the save step to
                   on_step_begin of the next), less the same gap after a step without a save: the whole save when
                   synchronous, the snapshot (host copies) with async_save
    write step     the mean time of the steps that run while a checkpoint is being written in the background,
                   against the median step when none is (async_save only); the steps while async_save's host
                   buffers are allocated and touched (once, after step 1, in a thread) are shown on their own
    end            from the last step's end to train()'s return: the last checkpoint committed either way

printed side by side with ratios (targets: stall <= 0.25x the synchronous save, write steps <= 1.2x a normal
step). A measurement, not a test: it prints and exits 0.

    python benchmarks/checkpoint.py [--steps 31] [--save_steps 10] [--quick]

A save every 10 steps by default: a 1.2 GiB write spans several steps on a CPU (it is bound by memory and disk
bandwidth, a step by compute), and a save interval shorter than a write makes every save wait for the previous one
(async_save warns to raise save_steps).

--quick trains a 2-layer model (a 0.7 GiB checkpoint) for 7 steps, to see that the benchmark runs (its figures
mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fresh_process import run_child  # noqa: E402

SEQ_LEN, BATCH = 32, 2
MODES = ("sync", "async")


def model(layers: int):
    """A Llama of about 106M parameters with 8 layers: vocab 32000, hidden 768, MLP 2048, untied head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=12,
                                        max_position_embeddings=SEQ_LEN, tie_word_embeddings=False))


def child(mode: str, steps: int, save_steps: int, layers: int) -> dict:
    import random

    import torch
    from accelerate.utils.other import extract_model_from_parallel

    from stoker import Trainer, TrainerCallback, TrainingArguments
    from stoker import checkpoint_format as ckpt

    torch.set_num_threads(1)
    # the first unwrap_model imports deepspeed where it is installed (seconds): paid once per process, not per save
    extract_model_from_parallel(torch.nn.Linear(1, 1))
    rng = random.Random(0)
    rows = [{"input_ids": (ids := [rng.randrange(1, 32000) for _ in range(SEQ_LEN)]), "labels": ids}
            for _ in range(BATCH * steps)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.in_flight, self.writing, self.reserving = {}, {}, {}, {}, {}

        def on_step_begin(self, args, state, control, **kw):
            self.begin[state.global_step + 1] = time.perf_counter()
            self.in_flight[state.global_step + 1] = trainer._checkpoint_writer.in_flight
            self.reserving[state.global_step + 1] = trainer._checkpoint_writer.copies.reserving

        def on_step_end(self, args, state, control, **kw):
            self.end[state.global_step] = time.perf_counter()
            self.writing[state.global_step] = trainer._checkpoint_writer.busy  # a save now would wait for it

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as out:
        args = TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, logging_strategy="no",
                                 save_strategy="steps", save_steps=save_steps, max_steps=steps,
                                 per_device_train_batch_size=BATCH, optim="adamw_torch", learning_rate=1e-4,
                                 async_save=mode == "async", skip_memory_metrics=True, log_level="error")
        clock = Clock()
        trainer = Trainer(model(layers), args, train_dataset=rows, callbacks=[clock])
        trainer.train()
        returned = time.perf_counter()
        last = ckpt.list_checkpoints(out)[-1]
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(last) for f in files)
    saves = [s for s in range(save_steps, steps, save_steps)]
    gaps = {s: clock.begin[s + 1] - clock.end[s] for s in range(1, steps)}
    plain_gap = statistics.median(g for s, g in gaps.items() if s not in saves)
    durations = {s: clock.end[s] - clock.begin[s] for s in range(2, steps + 1)}  # step 1 warms up
    writing = [d for s, d in durations.items() if clock.in_flight[s]]
    reserving = [d for s, d in durations.items() if clock.reserving[s] and not clock.in_flight[s]]
    normal = [d for s, d in durations.items() if not clock.in_flight[s] and not clock.reserving[s]]
    stalls = [gaps[s] - plain_gap for s in saves]
    return {"stall": statistics.mean(stalls), "stalls": stalls, "waited": sum(clock.writing[s] for s in saves),
            "normal_step": statistics.median(normal) if normal else None,
            "write_step": statistics.mean(writing) if writing else None, "write_steps": len(writing),
            "reserve_step": statistics.mean(reserving) if reserving else None, "reserve_steps": len(reserving),
            "end": returned - clock.end[steps], "size": size, "saves": len(saves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", default=None)
    parser.add_argument("--layers", type=int, default=8)
    a = parser.parse_args()
    if a.quick:
        a.steps, a.save_steps, a.layers = 7, 3, 2
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.save_steps, a.layers)))
        return
    flags = ["--steps", str(a.steps), "--save_steps", str(a.save_steps), "--layers", str(a.layers)]
    results = {mode: run_child(__file__, mode, flags, fixed_malloc=False) for mode in MODES}
    sync, background = results["sync"], results["async"]
    print(f"checkpoint of {sync['size'] / 2**30:.2f} GiB ({a.layers}-layer Llama, float32, AdamW), training on 1 "
          f"thread; {sync['saves']} saves measured (every {a.save_steps} of {a.steps} steps), each mode in a fresh "
          "process")
    print(f"{'':<34}{'sync':>10}{'async':>10}{'ratio':>10}")

    def row(name: str, s, b, ratio: str = "") -> None:
        shown = [f"{v:>9.3f}s" if v is not None else f"{'-':>10}" for v in (s, b)]
        print(f"{name:<34}{shown[0]}{shown[1]}{ratio:>10}")

    row("save stall (out of the loop)", sync["stall"], background["stall"],
        f"{background['stall'] / sync['stall']:.3f}x")
    print(f"{'':<54}async / sync save (target <= 0.25x)")
    for mode, r in results.items():
        print(f"  {mode} stalls: {', '.join(f'{v:.3f}s' for v in r['stalls'])}"
              + (f" ({r['waited']} waited for the previous write)" if r["waited"] else ""))
    row("normal step", sync["normal_step"], background["normal_step"])
    ratio = (background["write_step"] / background["normal_step"] if background["write_step"]
             and background["normal_step"] else None)
    row(f"step during a write ({background['write_steps']} steps)", None, background["write_step"],
        f"{ratio:.3f}x" if ratio else "-")
    print(f"{'':<54}of a normal step (target <= 1.2x)")
    if background["reserve_step"] and background["normal_step"]:
        row(f"step while reserving ({background['reserve_steps']} steps)", None, background["reserve_step"],
            f"{background['reserve_step'] / background['normal_step']:.3f}x")
        print(f"{'':<54}of a normal step (host buffers allocated once, after step 1)")
    row("end of run (last save committed)", sync["end"], background["end"])


if __name__ == "__main__":
    main()
