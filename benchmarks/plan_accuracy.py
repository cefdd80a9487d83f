"""How close `stoker plan` comes to the memory training really takes: predicted against measured, per setting.

Each configuration trains a model built from its config (nothing is downloaded) with stoker.Trainer for
--steps optimizer steps, float32 on the CPU, in a fresh Python process: eight Llama settings, then each
family the planner models (Llama, GPT-2 with eager and with sdpa attention, OPT, Qwen2, GPT-NeoX, BERT masked
LM) at one size (hidden 256, 4 layers, vocab 16k, 4 rows x 512 tokens, the config's own dropout), with full
fine-tuning, LoRA r=16 on every linear layer, and the chunked loss (causal LMs only). Measured = the process's peak
resident memory (resource.getrusage(RUSAGE_SELF).ru_maxrss) minus its resident memory after every library
was imported and before the model was built: what the model, its training state and its activations took.
The children run with MALLOC_MMAP_THRESHOLD_=131072: by default glibc raises that threshold as large blocks
are freed and then keeps later freed blocks in its heap, so resident memory stays up to 50% above what is
in use (LoRA with dropout: 1395 MiB resident for 901 MiB ever in use at once); with a fixed threshold every
large block goes back to the system when freed, and peak resident memory is the peak of memory in use, the
CPU counterpart of torch.cuda.max_memory_allocated, which is what the plan predicts.
Predicted = stoker.memory_plan.estimate(...).peak for the same model and settings. The configurations differ in
what dominates: the logits of a 32k vocabulary, activations of a wider model, optimizer state (AdamW,
8-bit AdamW, SGD, Adafactor), gradients kept through accumulation, LoRA, gradient checkpointing and the
chunked loss.

Predicted = stoker.memory_plan.estimate for the model built on the meta device from the same config, computed
in this process; --save FILE keeps the measurements and --measured FILE reuses them, so that the predictions
can be recomputed without training again (the measurements do not depend on the planner).

It is a measurement, not a test: it prints and exits 0. About ten minutes on 2 idle CPU cores:

    python benchmarks/plan_accuracy.py [--steps 3] [--only SUBSTRING] [--save FILE | --measured FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

from fresh_process import run_child

# name -> (family, model sizes, rows per micro-batch, tokens per row, TrainingArguments extras, LoRA rank/dropout)
SMALL_32K = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "vocab_size": 32000}
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "vocab_size": 8000}
FAMILY_SIZE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 16000}
CONFIGS = {
    "AdamW, vocab 32k": ("llama", SMALL_32K, 4, 512, {}, None),
    "AdamW, vocab 32k, chunked loss": ("llama", SMALL_32K, 4, 512, {"chunked_loss": True}, None),
    "AdamW, chunked loss + checkpointing": ("llama", SMALL_32K, 4, 512, {"chunked_loss": True,
                                                                         "gradient_checkpointing": True}, None),
    "SGD, accumulation 2": ("llama", SMALL_32K, 4, 512, {"optim": "sgd", "gradient_accumulation_steps": 2}, None),
    "8-bit AdamW": ("llama", SMALL_32K, 4, 512, {"optim": "adamw_8bit"}, None),
    "Adafactor, wide model": ("llama", WIDE, 2, 512, {"optim": "adafactor"}, None),
    "AdamW, wide model, checkpointing": ("llama", WIDE, 4, 512, {"gradient_checkpointing": True}, None),
    "LoRA r=16 all-linear, wide model": ("llama", WIDE, 4, 512, {}, (16, 0.05)),
}
FAMILIES = ("llama", "gpt2-eager", "gpt2-sdpa", "opt", "qwen2", "gpt-neox", "bert-mlm")
for _family in FAMILIES:
    CONFIGS[f"{_family}: full"] = (_family, FAMILY_SIZE, 4, 512, {}, None)
    CONFIGS[f"{_family}: LoRA r=16"] = (_family, FAMILY_SIZE, 4, 512, {}, (16, 0.05))
    if _family in ("llama", "opt", "qwen2", "gpt-neox"):  # stoker's chunked loss takes transformers' causal-LM
        # loss (loss_type 'ForCausalLM') only: it refuses BERT's masked-LM loss and GPT2LMHeadModel's own
        CONFIGS[f"{_family}: chunked loss"] = (_family, FAMILY_SIZE, 4, 512, {"chunked_loss": True}, None)


def make_model(family: str, sizes: dict, seq: int):
    """The model of a family at the given sizes, from its config class (dropout and the rest as configured)."""
    import transformers as t

    h, i, n, v = (sizes[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(num_attention_heads=4, num_key_value_heads=4,
                                                max_position_embeddings=seq, **sizes))
    if family.startswith("gpt2"):
        config = t.GPT2Config(n_embd=h, n_inner=i, n_layer=n, n_head=4, vocab_size=v, n_positions=seq)
        config._attn_implementation = family.removeprefix("gpt2-")
        return t.GPT2LMHeadModel(config)
    if family == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=h, ffn_dim=i, num_hidden_layers=n, num_attention_heads=4,
                                            vocab_size=v, max_position_embeddings=seq, word_embed_proj_dim=h))
    if family == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=seq, **sizes))
    if family == "gpt-neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(num_attention_heads=4, max_position_embeddings=seq, **sizes))
    if family == "bert-mlm":
        return t.BertForMaskedLM(t.BertConfig(num_attention_heads=4, max_position_embeddings=seq, **sizes))
    raise ValueError(f"family {family!r}: one of {FAMILIES}")


def training_rows(family: str, vocab: int, rows: int, seq: int) -> list[dict]:
    """Random token rows; a masked LM predicts 15% of the positions (the rest are -100), a causal LM all."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    if family == "bert-mlm":
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
    return [{"input_ids": x.tolist(), "labels": y.tolist()} for x, y in zip(ids, labels, strict=True)]


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
    import transformers  # noqa: F401
    import transformers.optimization  # noqa: F401
    import transformers.trainer_utils  # noqa: F401

    import stoker

    family, sizes, batch, seq, extra, lora = CONFIGS[name]
    make_model(family, {**sizes, "num_hidden_layers": 1, "vocab_size": 64}, 8)  # the family's modules imported
    before = current_rss()
    torch.manual_seed(0)
    model = make_model(family, sizes, seq)
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=lora[0], lora_alpha=2 * lora[0], lora_dropout=lora[1],
                                      target_modules="all-linear")
    accumulation = extra.get("gradient_accumulation_steps", 1)
    rows = training_rows(family, sizes["vocab_size"], steps * batch * accumulation, seq)
    args = stoker.TrainingArguments(**{
        "output_dir": tempfile.mkdtemp(), "max_steps": steps, "per_device_train_batch_size": batch,
        "optim": "adamw_torch", "learning_rate": 1e-4, "logging_steps": 10**6, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True, "use_cpu": True, "dataloader_pin_memory": False, **extra})
    stoker.Trainer(model, args, train_dataset=rows, peft_config=peft_config).train()
    return {"measured": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}  # KiB on Linux


def predict(name: str):
    """stoker.memory_plan's estimate for a configuration, from its model built on the meta device."""
    import torch

    from stoker.memory_plan import ModelShape, Setup, estimate

    family, sizes, batch, seq, extra, lora = CONFIGS[name]
    with torch.device("meta"):
        shape = ModelShape.from_model(make_model(family, sizes, seq))
    setup = Setup(micro_batch=batch, seq_len=seq, accumulation=extra.get("gradient_accumulation_steps", 1),
                  optim=extra.get("optim", "adamw_torch"), chunked_loss=extra.get("chunked_loss", False),
                  gradient_checkpointing=extra.get("gradient_checkpointing", False),
                  lora_r=lora[0] if lora else 0, lora_dropout=lora[1] if lora else 0.0, device="cpu")
    return estimate(shape, setup)


def measure(name: str, steps: int) -> dict:
    return run_child(__file__, name, ["--steps", str(steps)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (>= 2)")
    parser.add_argument("--only", default="", help="run the configurations whose name contains this")
    parser.add_argument("--save", help="write the measurements to this JSON file")
    parser.add_argument("--measured", help="reuse the measurements in this JSON file (from --save); measure only "
                        "the configurations it lacks")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = child(a.child, a.steps)
        print(json.dumps(result))
        return 0
    measured = {}
    if a.measured:
        with open(a.measured) as f:
            measured = json.load(f)
    mib = 2**20
    lines = ["stoker.memory_plan estimate against measured peak memory (float32, CPU; MiB above the imported "
             "libraries)",
             f"{'configuration':<38}{'predicted':>10}{'measured':>10}{'ratio':>7}   "
             "predicted parts: weights / gradients / optimizer / activations / logits"]
    worst = 0.0
    for name in CONFIGS:
        if a.only not in name:
            continue
        if name not in measured:
            measured[name] = measure(name, a.steps)["measured"]
            if a.save:
                with open(a.save, "w") as f:
                    json.dump(measured, f, indent=1)
        e = predict(name)
        ratio = e.peak / measured[name]
        worst = max(worst, abs(ratio - 1))
        parts = " / ".join(f"{getattr(e, k) / mib:.0f}" for k in ("weights", "gradients", "optimizer",
                                                                    "activations", "logits"))
        lines.append(f"{name:<38}{e.peak / mib:>10.0f}{measured[name] / mib:>10.0f}{ratio:>7.2f}   {parts}")
        print(lines[-1], file=sys.stderr, flush=True)
    lines.append(f"largest error: {100 * worst:.0f}% (target: within 20% on each)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
