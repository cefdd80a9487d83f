"""The sft recipe: instruction fine-tuning through the tokenizer's chat template, the loss on the assistant's
answer only; full, LoRA (use_peft) or QLoRA (load_in_4bit).

    python -m stoker.recipes.sft                                   # the main job, offline (below)
    python -m stoker.recipes.sft recipes/sft.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 -m stoker.recipes.sft recipes/sft.yaml
    stoker train [CONFIG] [--field value ...]                      # the same run through the command

With nothing given (`stoker train`), this is the main job: a LoRA adapter teaches the tiny Llama that the clm
recipe pre-trained on "37+45=082" lines (made first into output_dir/base, with this run's seed, when it is not
there) to answer in chat form: the user's "37+45" on one line, "082" on the next. Exact match on 500 held-out
problems goes from about 0.01 to about 1.0; the adapter, the adapter merged into the base, report.html and
results.json land in output_dir.

To change more than a setting, fork it: `stoker cp sft my_sft.py` writes this file, which runs as it is with
`python my_sft.py CONFIG.yaml`. It reads top to bottom: setup (arguments, tokenizer and model, data, Trainer),
train, evaluate, save, report; the pieces it calls live in stoker.recipes (args, data, models, results).
"""

from __future__ import annotations

import os
import sys

from stoker.arguments import TrainingArguments
from stoker.lora import merge_adapter
from stoker.recipes import clm
from stoker.recipes.args import GENERATED, DataArguments, ModelArguments, recipe_main
from stoker.recipes.data import generated_pairs, load_rows, sft_rows
from stoker.recipes.models import build_causal_lm, peft_config_for
from stoker.recipes.results import generate_sample, summary, write_results
from stoker.tasks import answer_metrics, argmax_logits
from stoker.trainer import Trainer

RECIPE = "sft"


def run(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Fine-tune a causal LM on conversations as the arguments say; save it and report. Returns {'before',
    'after', 'train'} metrics, 'sample' (a generated answer) when anything is held out and 'merged' for LoRA."""
    # --- setup: the model to fine-tune. Unset, the clm recipe's model (the main job's first stage), made
    # first when output_dir/base holds none
    if m.model_name_or_path is None:
        m.model_name_or_path = clm.make_base_model(os.path.join(args.output_dir, "base"), args.seed)
    tokenizer, model = build_causal_lm(m, args.seed)

    # --- setup: data. Local files or a hub dataset hold `messages` conversations or prompt/completion rows; a
    # generated task gives one-turn conversations (the user's "37+45", the assistant's "082"), some held out
    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        train = sft_rows(train_raw, tokenizer, d, "train data")
        held = sft_rows(held_raw, tokenizer, d, "validation data") if held_raw is not None else None
    else:
        train_pairs, held_pairs = generated_pairs(d.dataset_name or "addition", d, args.seed)
        chats = lambda pairs: [{d.messages_column: [{"role": "user", "content": p.rstrip("=")},
                                                    {"role": "assistant", "content": a}]} for p, a in pairs]
        train = sft_rows(chats(train_pairs), tokenizer, d, "generated data")
        held = sft_rows(chats(held_pairs), tokenizer, d, "generated data")

    # --- setup: the Trainer; answers are scored by exact match and token accuracy from the logits' argmax.
    # With use_peft the Trainer wraps the model with the LoRA adapter (only the adapter trains)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=answer_metrics, preprocess_logits_for_metrics=argmax_logits,
                      peft_config=peft_config_for(m, model))

    # --- train, with the held-out metrics before and after (nothing held out: train without evaluating)
    if held is None and args.eval_strategy != "no":
        args.eval_strategy = "no"
    before = trainer.evaluate() if held else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate() if held else {}

    # --- save: the model into output_dir (a LoRA run: the adapter only, and the adapter merged into its base)
    trainer.save_model()
    results = {"before": before, "after": after, "train": result.metrics}
    if held:  # on every process: a sharded model (ZeRO-3, FSDP) generates with all of them
        results["sample"] = generate_sample(trainer, tokenizer, held[0])
    if not trainer.accelerator.is_main_process:
        return results
    if m.use_peft and m.merge_adapter:
        # a k-bit base is merged from its full-precision files, which is what merge_adapter loads
        results["merged"] = merge_adapter(m.model_name_or_path, args.output_dir,
                                          os.path.join(args.output_dir, "merged"))

    # --- report: results.json (with the generated answer), what was learned and where it is
    write_results(args.output_dir, results)
    print(summary(results, args, m, len(held or [])))
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line: `[CONFIG.yaml|json] [--field value ...]`; exit code 2 for bad input, 0 when done."""
    return recipe_main(RECIPE, run, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
