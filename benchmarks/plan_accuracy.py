"""How close `stoker plan` comes to the memory training really takes: predicted against measured, per setting.

Each configuration trains a Llama built from a LlamaConfig (nothing is downloaded) with stoker.Trainer for
--steps optimizer steps, float32 on the CPU, in a fresh Python process. Measured = the process's peak
resident memory (resource.getrusage(RUSAGE_SELF).ru_maxrss) minus its resident memory after every library
was imported and before the model was built: what the model, its training state and its activations took.
The children run with MALLOC_MMAP_THRESHOLD_=131072: by default glibc raises that threshold as large blocks
are freed and then keeps later freed blocks in its heap, so resident memory stays up to 50% above what is
in use (LoRA with dropout: 1395 MiB resident for 901 MiB ever in use at once); with a fixed threshold every
large block goes back to the system when freed, and peak resident memory is the peak of memory in use, the
CPU counterpart of torch.cuda.max_memory_allocated, which is what the plan predicts.
Predicted = stoker.plan.estimate(...).peak for the same model and settings. The configurations differ in
what dominates: the logits of a 32k vocabulary, activations of a wider model, optimizer state (AdamW,
8-bit AdamW, SGD, Adafactor), gradients kept through accumulation, LoRA, gradient checkpointing and the
chunked loss.

It is a measurement, not a test: it prints and exits 0. About four minutes on 2 idle CPU cores:

    python benchmarks/plan_accuracy.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

from fresh_process import run_child

# name -> (model sizes, rows per micro-batch, tokens per row, TrainingArguments extras, LoRA rank/dropout)
SMALL_32K = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "vocab_size": 32000}
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "vocab_size": 8000}
CONFIGS = {
    "AdamW, vocab 32k": (SMALL_32K, 4, 512, {}, None),
    "AdamW, vocab 32k, chunked loss": (SMALL_32K, 4, 512, {"chunked_loss": True}, None),
    "AdamW, chunked loss + checkpointing": (SMALL_32K, 4, 512, {"chunked_loss": True,
                                                                "gradient_checkpointing": True}, None),
    "SGD, accumulation 2": (SMALL_32K, 4, 512, {"optim": "sgd", "gradient_accumulation_steps": 2}, None),
    "8-bit AdamW": (SMALL_32K, 4, 512, {"optim": "adamw_8bit"}, None),
    "Adafactor, wide model": (WIDE, 2, 512, {"optim": "adafactor"}, None),
    "AdamW, wide model, checkpointing": (WIDE, 4, 512, {"gradient_checkpointing": True}, None),
    "LoRA r=16 all-linear, wide model": (WIDE, 4, 512, {}, (16, 0.05)),
}


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(name: str, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    # everything training will import, imported before the baseline is taken
    import accelerate  # noqa: F401
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers.optimization  # noqa: F401
    import transformers.trainer_utils  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM

    import stoker
    from stoker.plan import ModelShape, Setup, estimate

    sizes, batch, seq, extra, lora = CONFIGS[name]
    before = current_rss()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
                                         **sizes))
    shape = ModelShape.from_model(model)
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=lora[0], lora_alpha=2 * lora[0], lora_dropout=lora[1],
                                      target_modules="all-linear")
    accumulation = extra.get("gradient_accumulation_steps", 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, sizes["vocab_size"], (steps * batch * accumulation, seq), generator=g)
    rows = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]
    args = stoker.TrainingArguments(**{
        "output_dir": tempfile.mkdtemp(), "max_steps": steps, "per_device_train_batch_size": batch,
        "optim": "adamw_torch", "learning_rate": 1e-4, "logging_steps": 10**6, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True, "use_cpu": True, "dataloader_pin_memory": False, **extra})
    stoker.Trainer(model, args, train_dataset=rows, peft_config=peft_config).train()
    measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # KiB on Linux
    setup = Setup(micro_batch=batch, seq_len=seq, accumulation=accumulation, optim=args.optim,
                  gradient_checkpointing=args.gradient_checkpointing, chunked_loss=args.chunked_loss,
                  lora_r=lora[0] if lora else 0, lora_dropout=lora[1] if lora else 0.0)
    predicted = estimate(shape, setup)
    return {"measured": measured, "predicted": predicted.peak,
            "parts": {k: getattr(predicted, k) for k in ("weights", "gradients", "optimizer", "activations",
                                                         "logits")}}


def measure(name: str, steps: int) -> dict:
    return run_child(__file__, name, ["--steps", str(steps)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (>= 2)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = child(a.child, a.steps)
        print(json.dumps(result))
        return 0
    mib = 2**20
    lines = ["stoker.plan estimate against measured peak memory (float32, CPU; MiB above the imported libraries)",
             f"{'configuration':<38}{'predicted':>10}{'measured':>10}{'ratio':>7}   "
             "predicted parts: weights / gradients / optimizer / activations / logits"]
    worst = 0.0
    for name in CONFIGS:
        r = measure(name, a.steps)
        ratio = r["predicted"] / r["measured"]
        worst = max(worst, abs(ratio - 1))
        parts = " / ".join(f"{v / mib:.0f}" for v in r["parts"].values())
        lines.append(f"{name:<38}{r['predicted'] / mib:>10.0f}{r['measured'] / mib:>10.0f}{ratio:>7.2f}   {parts}")
    lines.append(f"largest error: {100 * worst:.0f}% (target: within 20% on each)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
