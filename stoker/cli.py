"""The `stoker` command.

    stoker train [CONFIG.yaml|json] [--field value ...]     run a recipe (clm, sft, classification)
    stoker merge --base DIR --adapter DIR --out DIR           fold a LoRA adapter into its base model
    stoker consolidate CHECKPOINT --out DIR                 the full model of an FSDP run's sharded checkpoint
    stoker plan [CONFIG.yaml|json] [--budget_gb N] [--world_size N] [--field value ...]
                                                              peak memory per device, and settings that fit

With no config file, `stoker train` runs the embedded default job: LoRA fine-tuning of a tiny Llama
(pre-trained on addition by the clm recipe, first, if it is not there yet) on subtraction, offline, in a
few minutes on 2 CPU cores. Flags override the file or the default; `stoker train --help` lists every
field by group.
"""

from __future__ import annotations

import sys

from .arguments import CollectingParser, ConfigError

USAGE = """usage: stoker <command> [args]    (stoker --version: the installed version)

commands:
  train [CONFIG.yaml|json] [--field value ...]   run a recipe; with no config, the embedded LoRA job
  merge --base DIR --adapter DIR --out DIR        merge a LoRA adapter into its base and save the result
  consolidate CHECKPOINT --out DIR                save the full model of a sharded (FSDP) checkpoint
  plan [CONFIG.yaml|json] [--budget_gb N] [--world_size N] [--field value ...]
                                                  estimate peak memory per device; propose settings that fit
"""


def train(argv: list[str]) -> int:
    from .recipes import main as run_recipe

    return run_recipe(argv)


def merge(argv: list[str]) -> int:
    parser = CollectingParser(prog="stoker merge", description="Merge a LoRA adapter into its base model.")
    parser.add_argument("--base", required=True, help="folder (or hub id) of the base model")
    parser.add_argument("--adapter", required=True, help="folder holding adapter_config.json")
    parser.add_argument("--out", required=True, help="where to save the merged model")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype to load the base in")

    def check(a) -> list[str | None]:
        from .inputs import adapter_folder_problem, model_source_problem, writable_folder_problem

        return [model_source_problem("--base", a.base), adapter_folder_problem("--adapter", a.adapter),
                writable_folder_problem("--out", a.out)]

    def save(a):
        from .lora import merge_adapter

        return merge_adapter(a.base, a.adapter, a.out, a.dtype)

    return _saved("merged model", parser, argv, check, save)


def consolidate(argv: list[str]) -> int:
    parser = CollectingParser(prog="stoker consolidate",
                              description="Save the full model of a sharded (FSDP) checkpoint for transformers.")
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder holding model_shards/")
    parser.add_argument("--out", required=True, help="where to save the model")

    def check(a) -> list[str | None]:
        from .checkpoint import verify
        from .inputs import writable_folder_problem

        problem = verify(a.checkpoint, hashes=False)  # by its manifest first: nothing else is read otherwise
        return [f"checkpoint={a.checkpoint!r}: {problem}" if problem else None, writable_folder_problem("--out", a.out)]

    def save(a):
        from .distributed import consolidate as run

        return run(a.checkpoint, a.out)

    return _saved("model", parser, argv, check, save)


def _saved(what: str, parser: CollectingParser, argv: list[str], check, save) -> int:
    """Parse `argv`, check the inputs (`check` returns problems, or None for each input that is fine), run
    `save` (it returns the folder it wrote) and say where; bad input is reported, with exit code 2, before any
    work."""
    try:
        a = parser.parse_args(argv)
        problems = parser.flag_problems() + [p for p in check(a) if p]
        if problems:
            raise ConfigError(problems, "command line")
        print(f"{what} saved to {save(a)}")
    except ConfigError as e:
        return report(e)
    return 0


def report(error: Exception) -> int:
    """Print bad input (a ConfigError's problems, or a CheckpointError) as one line per problem, with no
    traceback; return the exit code for it, 2 (as argparse uses)."""
    problems = getattr(error, "problems", None) or [str(error)]
    if len(problems) == 1:
        print(f"stoker: {problems[0]}", file=sys.stderr)
    else:
        print(f"stoker: {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    return 2


def plan(argv: list[str]) -> int:
    from .plan import main as run_plan

    return run_plan(argv)


COMMANDS = {"train": train, "merge": merge, "consolidate": consolidate, "plan": plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"stoker {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"stoker: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
