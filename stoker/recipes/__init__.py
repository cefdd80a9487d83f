"""The recipes, and the pieces they share.

A recipe is one readable script, top to bottom: setup (arguments, tokenizer and model, data, Trainer), train,
evaluate, save, report. Three ship with stoker, each a module here with `main(argv)`, run by `stoker train` and by
`python -m stoker.recipes.<name> [CONFIG.yaml] [--field value ...]`:

    clm             causal-LM training on text (cut into blocks) or prompt/completion rows
    sft             instruction fine-tuning through a chat template, loss on the assistant's tokens only; full,
                    LoRA or QLoRA. With nothing given: the main job of `stoker train`
    classification  sequence classification with accuracy and macro F1, LoRA optional

`stoker cp RECIPE DEST` copies one out to fork it; the copy runs with `python DEST CONFIG.yaml`. The shared pieces
(what every recipe needs, and what a fork keeps using from the installed package):

    args      RecipeArguments, ModelArguments, DataArguments, the embedded default jobs, parsing, input checks
    data      loading rows (hub datasets, local files), generated tasks, clm / chat encoding
    models    building or loading the model and tokenizer (k-bit for QLoRA), the LoRA config
    results   a generated sample, results.json, the before/after summary

Each recipe works offline on an embedded default (tiny models built from configs, tokenizers built or trained
locally, generated tasks with held-out metrics) and on real inputs: a hub id or local folder for the model, a hub
dataset or local .txt/.json/.jsonl files for the data.

This package does not import the recipe modules: `python -m stoker.recipes.sft` runs the module once, as the
script; the `stoker` command imports them (stoker.cli).
"""

from .args import (
    GENERATED,
    INPUT_CHECKS,
    RECIPES,
    DataArguments,
    ModelArguments,
    RecipeArguments,
    input_problems,
    parse_recipe_args,
    recipe_of,
)
from .data import clm_rows, generated_pairs, load_rows, sft_rows
from .models import build_causal_lm, build_classifier, peft_config_for
from .results import format_before_after, generate_sample, summary, write_results

__all__ = ["GENERATED", "INPUT_CHECKS", "RECIPES", "DataArguments", "ModelArguments",
           "RecipeArguments", "build_causal_lm", "build_classifier", "clm_rows", "format_before_after",
           "generate_sample", "generated_pairs", "input_problems", "load_rows", "parse_recipe_args", "peft_config_for",
           "recipe_of", "sft_rows", "summary", "write_results"]
