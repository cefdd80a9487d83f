"""What the recipe scripts and `stoker train` share: arguments, model and data loading, and the runs.

A recipe is data -> model -> Trainer -> report. Three recipes share every piece here:

    clm             causal-LM training on text (grouped into blocks) or prompt/completion rows
    sft             instruction fine-tuning through a chat template, loss on the assistant's tokens only,
                    full or LoRA / QLoRA
    classification  sequence classification with accuracy and macro F1, LoRA optional

Each works offline on an embedded default (tiny models built from configs, tokenizers built or trained
locally, generated tasks with held-out metrics) and on real inputs: a hub id or local folder for the model,
a hub dataset or local .txt/.json/.jsonl files for the data.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from .arguments import CONFIG_SUFFIXES, ConfigError, TrainingArguments, load_config_file, parse_config
from .log import logger

RECIPES = ("clm", "sft", "classification")
GENERATED = ("addition", "subtraction", "topics")


@dataclass
class RecipeArguments:
    _argument_group_name = "recipe"

    recipe: str = field(default="sft", metadata={"help": f"What to run: {', '.join(RECIPES)}."})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch threads for the run's CPU work (torch.set_num_threads); unset: torch's choice."})

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
    _argument_group_name = "model (recipe)"

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A hub id or a local folder for from_pretrained. Unset: clm and classification build a tiny "
                "model from the sizes below; sft starts from the model the clm recipe makes (output_dir/base)."})
    hidden_size: int = field(default=128, metadata={"help": "Width of a model built from scratch."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Layers of a model built from scratch."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads of a model built from scratch."})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width of a model built from scratch."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "Linear layers to adapt by name (e.g. q_proj v_proj), or 'all-linear'."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained in full and saved with the adapter (e.g. a classification head)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base in 4 bits (QLoRA; needs use_peft)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base in 8 bits (needs use_peft)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit data type: nf4 or fp4."})
    use_bnb_nested_quant: bool = field(default=True, metadata={"help": "Double quantisation of the 4-bit scales."})
    bnb_4bit_compute_dtype: str = field(default="float32", metadata={
        "help": "dtype of 4-bit matmuls: float32, bfloat16 or float16."})
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
_COMMON = {"per_device_train_batch_size": 32, "per_device_eval_batch_size": 100, "lr_scheduler_type": "cosine",
           "warmup_steps": 0.05, "weight_decay": 0.01, "save_total_limit": 2, "eval_strategy": "steps"}
# The embedded defaults, one per recipe; `stoker train` with no config runs DEFAULT_JOBS["sft"].
DEFAULT_JOBS = {
    # a tiny Llama learns 2-digit addition from scratch: about half a minute on 2 CPU cores, exact match 0 -> ~1.
    # At 3e-3 some seeds stall at a plateau (the carries unlearned); 1e-3 over 5 epochs learns them for every seed
    "clm": {**_COMMON, "recipe": "clm", "dataset_name": "addition", "output_dir": "stoker_output/base",
            "num_train_epochs": 5, "learning_rate": 1e-3, "logging_steps": 100, "eval_steps": 250,
            "save_steps": 250},
    # LoRA teaches that model to answer in chat form (the main job; it makes the base first if needed)
    "sft": {**_COMMON, "recipe": "sft", "dataset_name": "addition", "output_dir": "stoker_output",
            "use_peft": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "num_train_examples": 4500,
            "num_train_epochs": 3, "learning_rate": 5e-3, "logging_steps": 50, "eval_steps": 100,
            "save_steps": 200, "training_report": True},
    # a tiny BERT with a locally trained word tokenizer sorts sentences into four topics
    "classification": {**_COMMON, "recipe": "classification", "dataset_name": "topics",
                       "output_dir": "stoker_output/classifier", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_train_examples": 4000, "num_train_epochs": 3,
                       "learning_rate": 1e-3, "logging_steps": 50, "eval_steps": 100, "save_steps": 100},
}


def parse_recipe_args(argv: list[str], recipe: str | None = None, prog: str | None = None,
                      checks: tuple[str, ...] = ()):
    """(RecipeArguments, ModelArguments, DataArguments, TrainingArguments) from `[CONFIG] [--flags]`.

    With no config file the recipe's embedded default fills in what the flags leave out. `checks` names the
    inputs (of INPUT_CHECKS) to check before returning; their problems are reported with the arguments'."""
    argv = list(argv)
    has_file = bool(argv) and argv[0].endswith(CONFIG_SUFFIXES)
    if recipe is None:  # from --recipe, else the file's recipe: key, else sft
        flags = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipe"]
        try:
            recipe = flags[-1] if flags else (load_config_file(argv[0]).get("recipe", "sft") if has_file else "sft")
        except ConfigError:  # parse_config reports the file's problem with the others
            recipe = "sft"
    elif "--recipe" not in argv:
        argv += ["--recipe", recipe]
    defaults = None if has_file else dict(DEFAULT_JOBS.get(recipe, {}))
    if defaults and "--train_file" in argv:  # the user's data replaces the default's generated task
        defaults.pop("dataset_name", None)
    r, m, d, args = parse_config(ARGUMENT_TYPES, argv, defaults, prog=prog,
                                 check=(lambda built: input_problems(built, checks)) if checks else None)
    if args.packing and args.packing_length is None:  # rows are cut to max_length, packed rows hold as many
        args.packing_length = max(d.max_length, 2)
    return r, m, d, args


def main(argv: list[str] | None = None, recipe: str | None = None) -> int:
    """The body of `stoker train` and of the scripts in recipes/: parse, check, run, return an exit code."""
    from .checkpoint import CheckpointError
    from .cli import report

    try:
        r, m, d, args = parse_recipe_args(sys.argv[1:] if argv is None else argv, recipe,
                                          prog=f"stoker train ({recipe or 'any recipe'})", checks=INPUT_CHECKS)
        if r.num_threads:
            import torch

            torch.set_num_threads(r.num_threads)
        RUNS[r.recipe](m, d, args)
    except (ConfigError, CheckpointError) as e:
        return report(e)
    from accelerate.state import PartialState

    # under a launcher, leave the process group before the interpreter exits: a gloo group torn down by
    # interpreter shutdown can abort the process after a successful run
    PartialState().destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------
# inputs, checked before any work: the model, the data, and the folders the run writes

INPUT_CHECKS = ("model", "data", "output")


def input_problems(built: dict, checks: tuple[str, ...] = INPUT_CHECKS) -> list[str]:
    """Problems with what a run reads and writes, for the arguments that parsed ({type: instance})."""
    from . import checkpoint as ckpt
    from .inputs import data_file_problems, dataset_source_problem, model_source_problem, writable_folder_problem

    r, m, d, args = (built.get(t) for t in ARGUMENT_TYPES)
    recipe = r.recipe if r else None
    p = []
    if m and m.model_name_or_path and "model" in checks:
        head = "sequence_classification" if recipe == "classification" else "causal_lm"
        # a run that reads data tokenizes it with the model's tokenizer; a plan needs the config only
        p.append(model_source_problem("model_name_or_path", m.model_name_or_path, head, tokenizer="data" in checks))
    if d and "data" in checks:
        if d.dataset_name is not None:
            p.append(dataset_source_problem("dataset_name", d.dataset_name, GENERATED))
        for name in ("train_file", "validation_file"):
            if getattr(d, name):
                p += data_file_problems(name, getattr(d, name), row_columns(recipe, d) if recipe else None,
                                        lambda column, value: _row_value_problem(d, column, value))
    if args and "output" in checks:
        p.append(writable_folder_problem("output_dir", args.output_dir))
        outside = os.path.relpath(os.path.abspath(args.logging_dir), os.path.abspath(args.output_dir)).startswith("..")
        if "tensorboard" in args.report_to and outside:
            p.append(writable_folder_problem("logging_dir", args.logging_dir))
        resume = args.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() not in ("true", "false"):
            # names and sizes only: the Trainer checks every byte against the manifest when it loads it
            problem = ckpt.verify(resume, hashes=False)
            if problem:
                p.append(f"resume_from_checkpoint={resume!r}: {problem}")
        elif (resume is None or str(resume).lower() == "false") and not args.overwrite_output_dir:
            existing = ckpt.list_checkpoints(args.output_dir)
            if existing:
                p.append(f"output_dir={args.output_dir!r}: already holds {len(existing)} checkpoint(s) (newest "
                         f"{os.path.basename(existing[-1])}); resume with resume_from_checkpoint=true, or set "
                         "overwrite_output_dir=true")
    return [problem for problem in p if problem]


def row_columns(recipe: str, d: DataArguments) -> list[list[str]]:
    """The column sets a recipe trains on, the first one the rows have being used."""
    return {"clm": [["prompt", "completion"], [d.text_column]],
            "sft": [[d.messages_column], ["prompt", "completion"]],
            "classification": [[d.text_column, d.label_column]]}[recipe]


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


# ---------------------------------------------------------------------------------------------------
# models


def build_causal_lm(m: ModelArguments, seed: int, vocab_from=None):
    """(tokenizer, model): from model_name_or_path (k-bit if asked), or a tiny Llama built from the sizes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from .lora import quantization_config

    if m.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(m.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        quant = quantization_config(m.load_in_4bit, m.load_in_8bit, m.bnb_4bit_quant_type, m.use_bnb_nested_quant,
                                    m.bnb_4bit_compute_dtype)
        return tokenizer, AutoModelForCausalLM.from_pretrained(m.model_name_or_path, quantization_config=quant)
    if m.load_in_4bit or m.load_in_8bit:
        raise ConfigError(["load_in_4bit/load_in_8bit: quantise a pretrained model (set model_name_or_path); a "
                           "model built from scratch has nothing to keep frozen"], "ModelArguments")
    from .tasks import char_tokenizer

    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)  # the initial weights are part of the run's seed
    return tokenizer, LlamaForCausalLM(config)


def peft_config_for(m: ModelArguments, model):
    if not m.use_peft:
        return None
    from .lora import lora_config

    return lora_config(model, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules, m.lora_modules_to_save)


# ---------------------------------------------------------------------------------------------------
# data


def load_rows(d: DataArguments) -> tuple[list[dict], list[dict] | None]:
    """Raw rows (dicts) of the train and held-out splits of a dataset id or of local files."""
    from datasets import load_dataset

    try:
        if d.train_file:
            files = {"train": d.train_file, **({"validation": d.validation_file} if d.validation_file else {})}
            raw = load_dataset("text" if d.train_file.endswith(".txt") else "json", data_files=files)
        else:
            raw = load_dataset(d.dataset_name)
    except Exception as e:  # noqa: BLE001 - what input_problems could not foresee, still named as bad input
        cause = e.__cause__ or e  # datasets wraps the reader's error in DatasetGenerationError
        source = f"train_file={d.train_file!r}" if d.train_file else f"dataset_name={d.dataset_name!r}"
        raise ConfigError([f"{source}: datasets cannot load it ({type(cause).__name__}: "
                           f"{(str(cause).strip().splitlines() or [''])[0]})"], "data") from e
    held = next((raw[s] for s in ("validation", "test") if s in raw), None)
    return raw["train"], held


def _require(rows, columns: list[list[str]], where: str) -> list[str]:
    """The first column set that the rows have; else an error naming the columns found."""
    found = set(rows.column_names if hasattr(rows, "column_names") else rows[0].keys()) if len(rows) else set()
    if not len(rows):
        raise ConfigError([f"{where}: has no rows"], "data")
    for option in columns:
        if set(option) <= found:
            return option
    wanted = " or ".join("+".join(repr(c) for c in option) for option in columns)
    raise ConfigError([f"{where}: rows need {wanted}; found columns {sorted(found)}"], "data")


def encode_chat(tokenizer, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """Token ids of a conversation rendered by the chat template, with labels on the last (assistant) turn."""
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    if full[: len(prompt)] != prompt:
        raise ConfigError(["chat template: the rendered prompt is not a prefix of the rendered conversation, so "
                           "the response tokens cannot be found"], "tokenizer")
    row = {"input_ids": full, "attention_mask": [1] * len(full), "labels": [-100] * len(prompt) + full[len(prompt):]}
    return {k: v[:max_length] for k, v in row.items()}


def clm_rows(rows, tokenizer, d: DataArguments, where: str) -> tuple[list[dict], bool]:
    """Token-id rows for causal-LM training, and whether they are prompt/completion pairs (masked prompts)."""
    from .tasks import encode_completion

    kind = _require(rows, row_columns("clm", d), where)
    if kind == ["prompt", "completion"]:
        return [{k: v[: d.max_length] for k, v in encode_completion(tokenizer, r["prompt"], r["completion"]).items()}
                for r in rows], True
    ids = [tokenizer(r[d.text_column], truncation=d.block_size is None, max_length=d.max_length)["input_ids"]
           for r in rows]
    if d.block_size:  # as transformers' run_clm: one token stream cut into equal blocks, the tail dropped
        stream = [t for row in ids for t in row]
        ids = [stream[i:i + d.block_size] for i in range(0, len(stream) - d.block_size + 1, d.block_size)]
        if not ids:
            raise ConfigError([f"block_size={d.block_size}: {where} has only {len(stream)} tokens"], "data")
    return [{"input_ids": r, "attention_mask": [1] * len(r), "labels": list(r)} for r in ids], False


def sft_rows(rows, tokenizer, d: DataArguments, where: str) -> list[dict]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError([f"tokenizer {type(tokenizer).__name__}: has no chat_template; sft renders "
                           "conversations with it (set tokenizer.chat_template, or use the clm recipe)"], "tokenizer")
    kind = _require(rows, row_columns("sft", d), where)
    out = []
    for r in rows:
        messages = r[d.messages_column] if kind == [d.messages_column] else [
            {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
        if not messages or messages[-1].get("role") != "assistant":
            raise ConfigError([f"{where}: every conversation must end with an assistant message"], "data")
        out.append(encode_chat(tokenizer, messages, d.max_length))
    return out


def generated_pairs(task: str, d: DataArguments, seed: int):
    from .tasks import arithmetic_splits

    return arithmetic_splits(task, d.num_train_examples, d.num_eval_examples, seed=seed)


# ---------------------------------------------------------------------------------------------------
# runs


def run_clm(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Causal-LM training on text or prompt/completion rows."""
    tokenizer, model = build_causal_lm(m, args.seed)
    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        train, paired = clm_rows(train_raw, tokenizer, d, "train data")
        held = clm_rows(held_raw, tokenizer, d, "validation data")[0] if held_raw is not None else None
    else:
        train_pairs, held_pairs = generated_pairs(d.dataset_name or "addition", d, args.seed)
        as_rows = lambda pairs: [{"prompt": p, "completion": a} for p, a in pairs]
        train, paired = clm_rows(as_rows(train_pairs), tokenizer, d, "generated data")
        held = clm_rows(as_rows(held_pairs), tokenizer, d, "generated data")[0]
    return _train_causal_lm(m, model, tokenizer, train, held, paired, args)


def run_sft(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Instruction fine-tuning through the tokenizer's chat template; loss on the assistant turn only."""
    if m.model_name_or_path is None:
        m.model_name_or_path = ensure_base_model(os.path.join(args.output_dir, "base"), args.seed)
    tokenizer, model = build_causal_lm(m, args.seed)
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
    return _train_causal_lm(m, model, tokenizer, train, held, True, args)


def ensure_base_model(folder: str, seed: int) -> str:
    """The model that the clm recipe's default job makes (with this run's seed), trained into `folder` unless it
    is already there."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        logger.info(f"no base model in {folder}: training one with the clm recipe first")
        _, m, d, args = parse_recipe_args(["--output_dir", folder, "--overwrite_output_dir", "true",
                                           "--disable_tqdm", "true", "--seed", str(seed)], "clm")
        run_clm(m, d, args)
    return folder


def _train_causal_lm(m, model, tokenizer, train, held, paired, args) -> dict:
    from .tasks import answer_metrics, argmax_logits
    from .trainer import Trainer

    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=answer_metrics if paired else None,
                      preprocess_logits_for_metrics=argmax_logits if paired else None,
                      peft_config=peft_config_for(m, model))
    return _train_and_report(trainer, m, held, sample_row=held[0] if paired and held else None)


def generate_sample(trainer, tokenizer, row: dict) -> dict:
    """Greedy completion of one held-out prompt by the trained model."""
    import torch

    prompt_len = next(i for i, label in enumerate(row["labels"]) if label != -100)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    model.eval()
    ids = torch.tensor([row["input_ids"][:prompt_len]], device=trainer.accelerator.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)
    return {"prompt": decode(ids[0]), "generated": decode(out[0, prompt_len:]),
            "expected": decode([t for t in row["labels"] if t != -100])}


def run_classification(m: ModelArguments, d: DataArguments, args: TrainingArguments) -> dict:
    """Sequence classification with accuracy and macro F1."""
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
    )

    from .tasks import TOPICS, classification_metrics, topic_sentences, train_word_tokenizer
    from .trainer import Trainer

    if d.train_file or d.dataset_name not in (None, *GENERATED):
        train_raw, held_raw = load_rows(d)
        _require(train_raw, row_columns("classification", d), "train data")
        if held_raw is not None:
            _require(held_raw, row_columns("classification", d), "validation data")
        texts = [r[d.text_column] for r in train_raw]
        names = sorted({str(r[d.label_column]) for r in train_raw})
        label_of = {n: i for i, n in enumerate(names)}
        as_pairs = lambda rows: [(r[d.text_column], label_of[str(r[d.label_column])]) for r in rows]
        train_pairs, held_pairs = as_pairs(train_raw), as_pairs(held_raw) if held_raw is not None else None
    else:
        pairs = topic_sentences(d.num_train_examples + d.num_eval_examples, seed=args.seed)
        train_pairs, held_pairs = pairs[: d.num_train_examples], pairs[d.num_train_examples:]
        texts, names = [t for t, _ in train_pairs], list(TOPICS)
    torch.manual_seed(args.seed)  # a new classification head is initialised from the seed
    if m.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(m.model_name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            m.model_name_or_path, num_labels=len(names), id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)})
    else:
        tokenizer = train_word_tokenizer(texts, max_length=d.max_length)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=len(tokenizer), hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size,
            max_position_embeddings=max(d.max_length, 64), num_labels=len(names),
            id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
            pad_token_id=tokenizer.pad_token_id))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    encode = lambda pairs: [{**tokenizer(t, truncation=True, max_length=d.max_length), "labels": y}
                            for t, y in pairs]
    held = encode(held_pairs) if held_pairs else None
    trainer = Trainer(model, args, train_dataset=encode(train_pairs), eval_dataset=held, processing_class=tokenizer,
                      compute_metrics=classification_metrics, peft_config=peft_config_for(m, model))
    return _train_and_report(trainer, m, held)


def _train_and_report(trainer, m: ModelArguments, held, sample_row: dict | None = None) -> dict:
    """Evaluate, train, evaluate again; save the model (and a merged copy of a LoRA adapter); generate a sample
    answer to `sample_row`'s prompt; write results.json and print what was learned and where everything is."""
    args = trainer.args
    if held is None and args.eval_strategy != "no":
        args.eval_strategy = "no"  # nothing held out: train without evaluation rather than fail late
    before = trainer.evaluate() if held else {}
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate() if held else {}
    trainer.save_model()
    results = {"before": before, "after": after, "train": result.metrics}
    if trainer.accelerator.is_main_process:
        # a k-bit base is merged from its full-precision files, which is what merge_adapter loads
        if m.use_peft and m.merge_adapter and m.model_name_or_path:
            from .lora import merge_adapter

            results["merged"] = merge_adapter(m.model_name_or_path, args.output_dir,
                                              os.path.join(args.output_dir, "merged"))
        if sample_row is not None:
            results["sample"] = generate_sample(trainer, trainer.processing_class, sample_row)
        _write_results(args.output_dir, results)
        print(summary(results, args, m, len(held or [])))
    return results


def summary(results: dict, args: TrainingArguments, m: ModelArguments, held_rows: int) -> str:
    """What the run learned (held-out metrics before and after, a generated answer) and where its outputs are."""
    lines = [format_before_after(results["before"], results["after"], held_rows)]
    if "sample" in results:
        s = results["sample"]
        lines.append(f"sample: {s['prompt']!r} -> {s['generated']!r} (expected {s['expected']!r})")
    out = args.output_dir
    lines.append(f"{'adapter' if m.use_peft else 'model'}: {out}"
                 + (" (peft.PeftModel.from_pretrained)" if m.use_peft else " (from_pretrained)"))
    if "merged" in results:
        lines.append(f"merged model: {results['merged']} (transformers' from_pretrained)")
    report = os.path.join(out, "report.html")
    if args.training_report and os.path.isfile(report):
        lines.append(f"report: {report} (loss, evaluation and learning-rate curves)")
    lines.append(f"results: {os.path.join(out, 'results.json')}")
    return "\n".join(line for line in lines if line)


def _write_results(output_dir: str, results: dict) -> None:
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)


def format_before_after(before: dict, after: dict, n: int) -> str:
    keys = [k for k in before if k in after and not k.endswith(("_runtime", "_per_second"))]
    if not keys:
        return ""
    width = max(len(k) for k in keys)
    lines = [f"{'held-out (' + str(n) + ' rows)':<{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"{k:<{width}}  {before[k]:>8.4f}  {after[k]:>8.4f}" for k in keys]
    return "\n".join(lines)


RUNS = {"clm": run_clm, "sft": run_sft, "classification": run_classification}
