"""The recipes' data: rows from a hub dataset or local files, the generated tasks, and their encoding to token ids.

    load_rows        raw rows of a dataset id or of local .txt/.json/.jsonl files (train and held-out splits)
    require_columns  the column set the rows have, of those a recipe accepts; else an error naming what they have
    clm_rows         causal-LM rows: text (cut into blocks) or prompt/completion with the prompt masked
    sft_rows         conversations rendered by the tokenizer's chat template, loss on the last assistant turn
    generated_pairs  (prompt, answer) pairs of a generated task (records, arithmetic), train and held out

Every problem with the rows is a ConfigError naming the split and what was found, before any training.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..synthetic_tasks import arithmetic_splits, encode_completion, record_splits
from .args import RECIPES, DataArguments


def load_rows(d: DataArguments) -> tuple[list[dict], list[dict] | None]:
    """Raw rows (dicts) of the train and held-out splits of a dataset id or of local files; the held-out split is
    the 'validation' one, else 'test', else None. A loader failure is a ConfigError naming the source."""
    from datasets import load_dataset  # datasets costs seconds to import: only runs that read data pay for it

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


def require_columns(rows, columns: list[list[str]], where: str) -> list[str]:
    """The first column set of `columns` that the rows have; else a ConfigError naming the columns found."""
    found = set(rows.column_names if hasattr(rows, "column_names") else rows[0].keys()) if len(rows) else set()
    if not len(rows):
        raise ConfigError([f"{where}: has no rows"], "data")
    for option in columns:
        if set(option) <= found:
            return option
    wanted = " or ".join("+".join(repr(c) for c in option) for option in columns)
    raise ConfigError([f"{where}: rows need {wanted}; found columns {sorted(found)}"], "data")


def encode_chat(tokenizer, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """Token ids of a conversation rendered by the chat template, with labels on the last (assistant) turn up to its
    end-of-turn token, cut to `max_length`. A template whose prompt is not a prefix of the conversation is a
    ConfigError."""
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    if full[: len(prompt)] != prompt:
        raise ConfigError(["chat template: the rendered prompt is not a prefix of the rendered conversation, so "
                           "the response tokens cannot be found"], "tokenizer")
    answer = full[len(prompt):]
    # generation stops at the end-of-turn (eos) token: what the template writes after it (a newline) is neither
    # trained on nor scored, so a right answer scores as greedy generation would
    ends = [i for i, t in enumerate(answer) if t == tokenizer.eos_token_id]
    answer = answer[:ends[-1] + 1] + [-100] * (len(answer) - ends[-1] - 1) if ends else answer
    row = {"input_ids": full, "attention_mask": [1] * len(full), "labels": [-100] * len(prompt) + answer}
    return {k: v[:max_length] for k, v in row.items()}


def clm_rows(rows, tokenizer, d: DataArguments, where: str) -> tuple[list[dict], bool]:
    """Token-id rows for causal-LM training, and whether they are prompt/completion pairs (prompt masked with
    -100, so the loss and the metrics are on the answer). Text rows are cut to max_length, or with block_size
    concatenated and cut into equal blocks as transformers' run_clm does."""
    kind = require_columns(rows, RECIPES["clm"].columns(d), where)
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
    """Token-id rows for instruction fine-tuning: `messages` conversations (or prompt/completion rows as one user
    and one assistant turn) rendered by the tokenizer's chat template, labels on the last assistant turn only.
    A tokenizer without a chat template, or a conversation that does not end with the assistant, is refused."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError([f"tokenizer {type(tokenizer).__name__}: has no chat_template; sft renders "
                           "conversations with it (set tokenizer.chat_template, or use the clm recipe)"], "tokenizer")
    kind = require_columns(rows, RECIPES["sft"].columns(d), where)
    out = []
    for r in rows:
        messages = r[d.messages_column] if kind == [d.messages_column] else [
            {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
        if not messages or messages[-1].get("role") != "assistant":
            raise ConfigError([f"{where}: every conversation must end with an assistant message"], "data")
        out.append(encode_chat(tokenizer, messages, d.max_length))
    return out


def generated_pairs(task: str, d: DataArguments, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prompt, answer) pairs of a generated task ('records', 'addition', 'subtraction'): num_train_examples to
    train on and num_eval_examples held out, disjoint, drawn with `seed`."""
    if task == "records":
        return record_splits(d.num_train_examples, d.num_eval_examples, seed=seed)
    return arithmetic_splits(task, d.num_train_examples, d.num_eval_examples, seed=seed)
