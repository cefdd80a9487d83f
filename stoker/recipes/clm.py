"""The clm recipe: causal-LM training on plain text (cut into blocks) or on prompt/completion rows.

    python -m stoker.recipes.clm                                   # the embedded default, offline (below)
    python -m stoker.recipes.clm recipes/clm.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 -m stoker.recipes.clm recipes/clm.yaml
    stoker train --recipe clm [CONFIG] [--field value ...]         # the same run through the command

With nothing given, a tiny Llama (built from ModelArguments' sizes, with a character tokenizer) learns 2-digit
addition from scratch ("37+45=" -> "082"), scored by exact match on 500 problems it never saw: the base model of
the main job, which the sft recipe then adapts.

To change more than a setting, fork it: `stoker cp clm my_clm.py` writes this file, which runs as it is with
`python my_clm.py CONFIG.yaml`. It reads top to bottom: setup (arguments, tokenizer and model, data, Trainer),
train, evaluate, save, report; the pieces it calls live in stoker.recipes (args, data, models, results).
"""

from __future__ import annotations

import os
import sys

from stoker.arguments import TrainingArguments
from stoker.lora import merge_adapter
from stoker.recipes.args import GENERATED, DataArguments, ModelArguments, recipe_main
from stoker.recipes.data import clm_rows, generated_pairs, load_rows
from stoker.recipes.models import build_causal_lm, lora_base_in_bf16, peft_config_for
from stoker.recipes.results import final_metrics, generate_sample, summary, write_results
from stoker.synthetic_tasks import answer_metrics, argmax_logits
from stoker.trainer import Trainer

RECIPE = "clm"


def run(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Train a causal LM as the arguments say; save it and report. Returns {'before', 'after', 'train'} metrics,
    with 'sample' (a generated answer) for prompt/completion data and 'merged' for a LoRA run."""
    # --- setup: tokenizer and model (its weights drawn from the seed when it is built from scratch)
    tokenizer, model = build_causal_lm(m, args.seed, args.bf16, args.fp16)
    lora = peft_config_for(m, model)
    lora_base_in_bf16(m, args.bf16, model, lora)  # with LoRA under bf16, the frozen base in bf16

    # --- setup: data. Local files or a hub dataset hold text (cut into blocks with block_size) or
    # prompt/completion rows; a generated task gives prompt/completion pairs and held-out problems
    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        train, paired = clm_rows(train_raw, tokenizer, d, "train data")
        held = clm_rows(held_raw, tokenizer, d, "validation data")[0] if held_raw is not None else None
    else:
        train_pairs, held_pairs = generated_pairs(d.dataset_name or "addition", d, args.seed)
        as_rows = lambda pairs: [{"prompt": p, "completion": a} for p, a in pairs]
        train, paired = clm_rows(as_rows(train_pairs), tokenizer, d, "generated data")
        held = clm_rows(as_rows(held_pairs), tokenizer, d, "generated data")[0]

    # --- setup: the Trainer. Prompt/completion rows are scored on the answer (exact match, token accuracy), from
    # the logits' argmax, so evaluation never holds a whole vocabulary of logits per token
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=answer_metrics if paired else None,
                      preprocess_logits_for_metrics=argmax_logits if paired else None,
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
    if paired and held:  # on every process: a sharded model (ZeRO-3, FSDP) generates with all of them
        results["sample"] = generate_sample(trainer, tokenizer, held[0])
    if not trainer.accelerator.is_main_process:
        return results
    if m.use_peft and m.merge_adapter and m.model_name_or_path:
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
