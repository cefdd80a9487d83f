"""Causal-LM training, HF-style: model arguments, data arguments and TrainingArguments from flags or a file.

    python recipes/clm.py                                   # the embedded default (generated addition task)
    python recipes/clm.py recipes/clm_addition.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 recipes/clm.py recipes/clm_addition.yaml
    python recipes/clm.py --model_name_or_path gpt2 --train_file train.jsonl --validation_file dev.jsonl

Everything it does lives in stoker.recipes, which `stoker train` runs too.
"""

import sys

from stoker.arguments import CONFIG_SUFFIXES, ConfigError, TrainingArguments, parse_config
from stoker.recipes import DEFAULT_JOB, DataArguments, ModelArguments, run_clm


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    defaults = None if argv and argv[0].endswith(CONFIG_SUFFIXES) else DEFAULT_JOB
    try:
        model_args, data_args, training_args = parse_config(
            (ModelArguments, DataArguments, TrainingArguments), argv, defaults, prog="clm.py")
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    run_clm(model_args, data_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
