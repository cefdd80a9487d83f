"""What the recipe scripts and `stoker train` share: model and data arguments, loading, and the run.

A recipe is data -> model -> Trainer. Each piece here works offline on its embedded default (a tiny Llama
built from a config, a character tokenizer and a generated task) and on real inputs (a hub id or a local
folder for the model; a hub dataset or local text/JSON files for the data).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from .arguments import ConfigError, TrainingArguments


@dataclass
class ModelArguments:
    _argument_group_name = "model (recipe)"

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A hub id or a local folder to load with from_pretrained; unset builds a tiny Llama from the "
                "sizes below (trained from scratch)."})
    hidden_size: int = field(default=128, metadata={"help": "Width of the tiny Llama built from scratch."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers of the tiny Llama built from scratch."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads of the tiny Llama."})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width of the tiny Llama."})

    def __post_init__(self):
        p = [f"{n}={getattr(self, n)!r}: must be a positive integer"
             for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
             if getattr(self, n) < 1]
        if not p and self.hidden_size % self.num_attention_heads:
            p.append(f"hidden_size={self.hidden_size}: must be divisible by num_attention_heads="
                     f"{self.num_attention_heads}")
        if p:
            raise ConfigError(p, "ModelArguments")


@dataclass
class DataArguments:
    _argument_group_name = "dataset (recipe)"

    dataset_name: str | None = field(default=None, metadata={
        "help": "'addition' (generated here), or a dataset id for datasets.load_dataset; unset with no files "
                "means 'addition'."})
    train_file: str | None = field(default=None, metadata={
        "help": "Local .txt/.json/.jsonl training file: rows with 'text', or 'prompt' and 'completion'."})
    validation_file: str | None = field(default=None, metadata={"help": "Local held-out file, same format."})
    text_column: str = field(default="text", metadata={"help": "Column holding plain text."})
    max_length: int = field(default=512, metadata={"help": "Truncate every row to this many tokens."})
    num_train_examples: int = field(default=9000, metadata={"help": "Generated training problems."})
    num_eval_examples: int = field(default=500, metadata={"help": "Generated held-out problems."})

    def __post_init__(self):
        p = []
        if self.dataset_name not in (None, "addition") and self.train_file:
            p.append(f"dataset_name={self.dataset_name!r} and train_file={self.train_file!r}: give one of them")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not path.endswith((".txt", ".json", ".jsonl")):
                p.append(f"{name}={path!r}: accepted formats are .txt, .json and .jsonl")
            elif path is not None and not os.path.isfile(path):
                p.append(f"{name}={path!r}: no such file")
        for name in ("max_length", "num_train_examples", "num_eval_examples"):
            if getattr(self, name) < 1:
                p.append(f"{name}={getattr(self, name)!r}: must be a positive integer")
        if p:
            raise ConfigError(p, "DataArguments")


# The embedded default of `stoker train`: about a minute on 2 CPU cores, answer exact match 0% -> ~80%.
DEFAULT_JOB = {
    "dataset_name": "addition",
    "output_dir": "stoker_output",
    "num_train_epochs": 8,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 100,
    "learning_rate": 3e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.05,
    "weight_decay": 0.01,
    "logging_steps": 100,
    "eval_strategy": "steps",
    "eval_steps": 500,
    "save_steps": 500,
    "save_total_limit": 2,
}


def build_tokenizer_and_model(m: ModelArguments, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if m.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(m.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer, AutoModelForCausalLM.from_pretrained(m.model_name_or_path)
    from .tasks import char_tokenizer

    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)  # the initial weights are part of the run's seed
    return tokenizer, LlamaForCausalLM(config)


def _encode_rows(rows, tokenizer, d: DataArguments, where: str) -> list[dict]:
    from .tasks import encode_completion

    if len(rows) == 0:
        raise ConfigError([f"{where}: has no rows"], "data")
    columns = set(rows[0].keys())
    out = []
    if {"prompt", "completion"} <= columns:
        for r in rows:
            out.append({k: v[: d.max_length] for k, v in encode_completion(tokenizer, r["prompt"],
                                                                           r["completion"]).items()})
    elif d.text_column in columns:
        for r in rows:
            ids = tokenizer(r[d.text_column], truncation=True, max_length=d.max_length)["input_ids"]
            out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    else:
        raise ConfigError([f"{where}: rows need a {d.text_column!r} column or 'prompt' and 'completion'; "
                           f"found columns {sorted(columns)}"], "data")
    return out


def load_data(d: DataArguments, tokenizer, seed: int) -> tuple[list[dict], list[dict] | None, bool]:
    """(train rows, held-out rows, whether rows are prompt/completion pairs) as token-id dicts."""
    if d.train_file or (d.dataset_name not in (None, "addition")):
        from datasets import load_dataset

        if d.train_file:
            files = {"train": d.train_file, **({"validation": d.validation_file} if d.validation_file else {})}
            kind = "text" if d.train_file.endswith(".txt") else "json"
            raw = load_dataset(kind, data_files=files)
        else:
            raw = load_dataset(d.dataset_name)
        train_rows = raw["train"]
        eval_rows = raw["validation"] if "validation" in raw else raw["test"] if "test" in raw else None
        paired = {"prompt", "completion"} <= set(train_rows.column_names)
        train = _encode_rows(train_rows, tokenizer, d, "train data")
        held = _encode_rows(eval_rows, tokenizer, d, "validation data") if eval_rows is not None else None
        return train, held, paired
    from .tasks import addition_splits

    train_pairs, eval_pairs = addition_splits(d.num_train_examples, d.num_eval_examples, seed=seed)
    rows = lambda pairs: [{"prompt": p, "completion": a} for p, a in pairs]
    return (_encode_rows(rows(train_pairs), tokenizer, d, "generated train data"),
            _encode_rows(rows(eval_pairs), tokenizer, d, "generated eval data"), True)


def run_clm(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Train a causal LM, evaluate before and after, save the model and tokenizer into output_dir."""
    from .tasks import answer_metrics, argmax_logits
    from .trainer import Trainer

    tokenizer, model = build_tokenizer_and_model(m, args.seed)
    train, held, paired = load_data(d, tokenizer, args.seed)
    if held is None and args.eval_strategy != "no":
        args.eval_strategy = "no"  # nothing held out: train without evaluation rather than fail late
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=answer_metrics if paired else None,
                      preprocess_logits_for_metrics=argmax_logits if paired else None)
    params = sum(p.numel() for p in model.parameters())
    print(f"[stoker] {type(model).__name__}: {params / 1e6:.2f}M parameters; {len(train)} training rows"
          + (f", {len(held)} held out" if held else ""), file=sys.stderr)
    before = trainer.evaluate() if held else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate() if held else {}
    trainer.save_model()
    results = {"before": before, "after": after, "train": result.metrics}
    if trainer.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(format_before_after(before, after, len(held or [])))
        print(f"model and tokenizer saved to {args.output_dir} (transformers from_pretrained loads them)")
    return results


def format_before_after(before: dict, after: dict, n: int) -> str:
    keys = [k for k in before if k in after and not k.endswith(("_runtime", "_per_second"))]
    if not keys:
        return ""
    width = max(len(k) for k in keys)
    lines = [f"{'held-out (' + str(n) + ' rows)':<{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"{k:<{width}}  {before[k]:>8.4f}  {after[k]:>8.4f}" for k in keys]
    return "\n".join(lines)
