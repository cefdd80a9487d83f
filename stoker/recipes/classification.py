"""The classification recipe: sequence classification of `text` + `label` rows, scored by accuracy and macro F1;
LoRA optional (with lora_modules_to_save for the new head).

    python -m stoker.recipes.classification                        # the embedded default, offline (below)
    python -m stoker.recipes.classification recipes/classification.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 -m stoker.recipes.classification recipes/classification.yaml
    stoker train --recipe classification [CONFIG] [--field value ...]

With nothing given, a tiny BERT with a word tokenizer trained on the data sorts generated sentences into four
topics. With model_name_or_path, that model gets a new classification head, one class per label the train
rows hold (sorted by name).

To change more than a setting, fork it: `stoker cp classification my_classifier.py` writes this file, which runs
as it is with `python my_classifier.py CONFIG.yaml`. It reads top to bottom: setup (arguments, data, tokenizer
and model, Trainer), train, evaluate, save, report; the pieces it calls live in stoker.recipes.
"""

from __future__ import annotations

import os
import sys

from stoker.arguments import TrainingArguments
from stoker.lora import merge_adapter
from stoker.recipes.args import GENERATED, RECIPES, DataArguments, ModelArguments, recipe_main
from stoker.recipes.data import load_rows, require_columns
from stoker.recipes.models import build_classifier, lora_base_in_bf16, peft_config_for
from stoker.recipes.results import summary, write_results
from stoker.synthetic_tasks import TOPICS, classification_metrics, topic_sentences
from stoker.trainer import Trainer

RECIPE = "classification"


def run(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Train a sequence classifier as the arguments say; save it and report. Returns {'before', 'after', 'train'}
    metrics, and 'merged' for a LoRA run on a pretrained model."""
    # --- setup: data, first: the labels decide the head's size, and a model built from scratch trains its word
    # tokenizer on the train texts. Local files or a hub dataset: the class names are the labels found in the
    # train rows, sorted; else generated sentences about four topics
    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        require_columns(train_raw, RECIPES[RECIPE].columns(d), "train data")
        if held_raw is not None:
            require_columns(held_raw, RECIPES[RECIPE].columns(d), "validation data")
        texts = [r[d.text_column] for r in train_raw]
        names = sorted({str(r[d.label_column]) for r in train_raw})
        label_of = {n: i for i, n in enumerate(names)}
        as_pairs = lambda rows: [(r[d.text_column], label_of[str(r[d.label_column])]) for r in rows]
        train_pairs, held_pairs = as_pairs(train_raw), as_pairs(held_raw) if held_raw is not None else None
    else:
        pairs = topic_sentences(d.num_train_examples + d.num_eval_examples, seed=args.seed)
        train_pairs, held_pairs = pairs[: d.num_train_examples], pairs[d.num_train_examples:]
        texts, names = [t for t, _ in train_pairs], list(TOPICS)

    # --- setup: tokenizer and model (the new head drawn from the seed), then the rows as token ids
    tokenizer, model = build_classifier(m, names, texts, d.max_length, args.seed)
    lora = peft_config_for(m, model)
    lora_base_in_bf16(m, args.bf16, model, lora)  # with LoRA under bf16, the frozen base in bf16 (not the head)
    encode = lambda pairs: [{**tokenizer(t, truncation=True, max_length=d.max_length), "labels": y}
                            for t, y in pairs]
    train = encode(train_pairs)
    held = encode(held_pairs) if held_pairs else None

    # --- setup: the Trainer, scoring accuracy and macro F1
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=classification_metrics, peft_config=lora)

    # --- train, with the held-out metrics before and after (nothing held out: train without evaluating)
    if held is None and args.eval_strategy != "no":
        args.eval_strategy = "no"
    before = trainer.evaluate() if held else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate() if held else {}

    # --- save: the model into output_dir (a LoRA run: the adapter and the head, and both merged into the base)
    trainer.save_model()
    results = {"before": before, "after": after, "train": result.metrics}
    if not trainer.accelerator.is_main_process:
        return results
    if m.use_peft and m.merge_adapter and m.model_name_or_path:
        results["merged"] = merge_adapter(m.model_name_or_path, args.output_dir,
                                          os.path.join(args.output_dir, "merged"))

    # --- report: results.json, what was learned and where it is
    write_results(args.output_dir, results)
    print(summary(results, args, m, len(held or [])))
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line: `[CONFIG.yaml|json] [--field value ...]`; exit code 2 for bad input, 0 when done."""
    return recipe_main(RECIPE, run, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
