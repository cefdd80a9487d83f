"""What a recipe reports after training: a generated answer, results.json, and a summary of what was learned
(held-out metrics before and after) and where the outputs are."""

from __future__ import annotations

import json
import os

import torch

from ..arguments import TrainingArguments
from .args import ModelArguments


def generate_sample(trainer, tokenizer, row: dict, prompt: str | None = None) -> dict:
    """Greedy completion (up to the expected answer's length and 8 tokens more) of one held-out row's prompt (its
    tokens before the first label) by the trained model: {'prompt', 'generated', 'expected'}, decoded without
    special tokens and the whitespace around them (a chat template's newline after its end-of-turn token is in the
    labels, and generation stops before it). `prompt` is shown instead of the decoded prompt tokens (which hold
    the whole chat template) when given. Every process of a multi-process run must call it: a model sharded over
    them (ZeRO-3, FSDP) gathers each layer's parameters in its forward, so all generate in step (synced_gpus), at
    the cost of one tiny all-reduce per token."""
    prompt_len = next(i for i, label in enumerate(row["labels"]) if label != -100)
    answer_len = sum(label != -100 for label in row["labels"])
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    model.eval()
    ids = torch.tensor([row["input_ids"][:prompt_len]], device=trainer.accelerator.device)
    with torch.no_grad(), trainer.accelerator.autocast():  # the precision the held-out metrics were taken in
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer_len + 8,
                             do_sample=False, synced_gpus=trainer.accelerator.num_processes > 1,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True).strip()
    return {"prompt": prompt or decode(ids[0]), "generated": decode(out[0, prompt_len:]),
            "expected": decode([t for t in row["labels"] if t != -100])}


def write_results(output_dir: str, results: dict) -> str:
    """Write `results` (before, after, train metrics; merged model, sample) to output_dir/results.json; its path."""
    path = os.path.join(output_dir, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return path


def summary(results: dict, args: TrainingArguments, m: ModelArguments, held_rows: int) -> str:
    """What the run learned (held-out metrics before and after, a generated answer) and where its outputs are."""
    lines = [format_before_after(results["before"], results["after"], held_rows)]
    for s in results.get("samples", [results["sample"]] if "sample" in results else []):
        right = "right" if s["generated"] == s["expected"] else f"expected {s['expected']!r}"
        lines.append(f"sample: {s['prompt']!r}\n    -> {s['generated']!r} ({right})")
    out = args.output_dir
    lines.append(f"{'adapter' if m.use_peft else 'model'}: {out}"
                 + (" (peft.PeftModel.from_pretrained)" if m.use_peft else " (from_pretrained)"))
    if "merged" in results:
        lines.append(f"merged model: {results['merged']} (transformers' from_pretrained)")
    report = os.path.join(out, "report.html")
    if args.training_report and os.path.isfile(report):
        lines.append(f"report: {report} (loss, evaluation and learning-rate curves)")
    lines.append(f"results: {os.path.join(out, 'results.json')}")
    return "\n".join(line for line in lines if line)


def format_before_after(before: dict, after: dict, n: int) -> str:
    """A table of the metrics both evaluations have (timings left out), before and after, over `n` held-out rows;
    empty when there is nothing to compare."""
    keys = [k for k in before if k in after and not k.endswith(("_runtime", "_per_second"))]
    if not keys:
        return ""
    width = max(len(k) for k in keys)
    lines = [f"{'held-out (' + str(n) + ' rows)':<{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"{k:<{width}}  {before[k]:>8.4f}  {after[k]:>8.4f}" for k in keys]
    return "\n".join(lines)


def final_metrics(trainer) -> dict:
    """The held-out metrics of the trained model: those of the evaluation the run made at its last step, when it
    made one (evaluating the same model again would cost as much for the same numbers), else a new evaluation."""
    last = next((r for r in reversed(trainer.state.log_history) if "eval_loss" in r), None)
    if last is not None and last["step"] == trainer.state.global_step:
        return {k: v for k, v in last.items() if k not in ("epoch", "step")}
    return trainer.evaluate()
