"""The `stoker` command.

    stoker train [CONFIG.yaml|json] [--field value ...]

With no config file, `stoker train` runs the embedded default job (stoker.recipes.DEFAULT_JOB): a tiny
Llama learns 2-digit addition from generated data, offline, in about a minute on 2 CPU cores. Flags
override the file or the default; `stoker train --help` lists every field by group.
"""

from __future__ import annotations

import sys

from .arguments import CONFIG_SUFFIXES, ConfigError, TrainingArguments, parse_config
from .checkpoint import CheckpointError

USAGE = """usage: stoker <command> [args]

commands:
  train [CONFIG.yaml|json] [--field value ...]   train a causal LM (the embedded default with no config)
"""


def train(argv: list[str]) -> int:
    from .recipes import DEFAULT_JOB, DataArguments, ModelArguments, run_clm

    defaults = None if argv and argv[0].endswith(CONFIG_SUFFIXES) else DEFAULT_JOB
    model_args, data_args, training_args = parse_config(
        (ModelArguments, DataArguments, TrainingArguments), argv, defaults, prog="stoker train")
    run_clm(model_args, data_args, training_args)
    return 0


COMMANDS = {"train": train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"stoker: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except (ConfigError, CheckpointError) as e:
        print(f"stoker: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
