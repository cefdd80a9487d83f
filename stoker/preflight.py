"""Checks of what a command reads and writes, made before any work: folders it writes to, models and datasets
it loads (local, cached, or from the hub), and local data files, line by line.

Each check returns a problem (a string naming the field, the value and what is accepted) or None, so that a
command collects every problem and reports them in one message. Nothing here writes a file, loads a model or
downloads anything; the hub is asked at most whether a repository exists.
"""

from __future__ import annotations

import json
import os
import tempfile

from .arguments import suggest
from .gguf import gguf_file, gguf_problem

HUB_TIMEOUT_S = 10
# Files one of which a tokenizer folder holds (fast tokenizers, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")
DATA_SUFFIXES = (".txt", ".json", ".jsonl")
MAX_ROW_PROBLEMS = 3  # per file: the first few bad rows tell what is wrong; the rest are counted


# ---------------------------------------------------------------------------------------------------
# folders written to


def writable_folder_problem(name: str, path: str) -> str | None:
    """Whether `path` is, or can be made, a folder this process writes into. Tried by creating (and removing)
    a scratch folder in the nearest folder that exists, because permission bits do not tell: root may write
    anywhere by them, and /proc or a read-only mount refuses everyone. The folder keeps its modification time."""
    shown = f"{name}={path!r}"
    target = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(target) and not os.path.isdir(target):
        return f"{shown}: is a file; accepted: a folder that exists or can be created"
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{shown}: cannot be created, {existing} is a file; accepted: a folder that exists or can be created"
    times = os.stat(existing)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".stoker-write-test-", dir=existing))
        os.utime(existing, ns=(times.st_atime_ns, times.st_mtime_ns))  # the folder is left as it was found
    except OSError as e:
        where = "" if existing == target else f" under {existing}"
        return (f"{shown}: cannot {'write' if existing == target else 'create folders'}{where} ({e.strerror}); "
                "accepted: a folder that exists or can be created, and that this user may write to")
    return None


# ---------------------------------------------------------------------------------------------------
# models and datasets: a local folder, the hub cache, or the hub


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~", ".\\")) or "\\" in value or os.path.exists(value)


def _hub_id_problem(value: str) -> str | None:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except ValueError as e:  # HFValidationError
        return str(e).split("\n")[0]
    return None


def _offline(*extra_variables: str) -> str | None:
    """The environment variable that forbids asking the hub, if one does."""
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE"
    return next((v for v in extra_variables if os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")), None)


def _ask_hub(repo_id: str, repo_type: str) -> str | None:
    """None if the hub has `repo_id`, else what the hub (or the network) said, in words."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import ENDPOINT
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    api = HfApi()
    info = api.model_info if repo_type == "model" else api.dataset_info
    try:
        info(repo_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        page = repo_id if repo_type == "model" else f"datasets/{repo_id}"
        return f"is gated on the hub: accept its terms on {ENDPOINT}/{page} and log in (hf auth login)"
    except RepositoryNotFoundError:
        return (f"no such {repo_type} on the hub ({ENDPOINT}) and no such local folder; check the id (a private "
                "repository needs a login: hf auth login)")
    except HfHubHTTPError as e:
        return f"the hub ({ENDPOINT}) answered {str(e).strip().splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - the HTTP client's own network errors (DNS, refused, timeout, TLS)
        first = (str(e).strip().splitlines() or [""])[0]
        return (f"not a local folder, not in the local cache, and the hub ({ENDPOINT}) is unreachable "
                f"({type(e).__name__}: {first}); connect to it, download the {repo_type} where there is a network, "
                "or give a local folder")
    return None


def model_source_problem(name: str, value: str, head: str | None = None, tokenizer: bool = False) -> str | None:
    """Whether `value` names a model that from_pretrained can load: a local folder with a config (and a
    tokenizer, if asked), a hub id in the local cache, or a hub id the hub has (asked only when online).

    `head` ('causal_lm', 'sequence_classification') is the head the command builds on the model; a model type
    that transformers has no such head for is refused."""
    shown = f"{name}={value!r}"
    accepted = "accepted: a local model folder (with config.json), a .gguf file, or a hub id such as 'org/name'"
    if gguf_file(value) is not None:  # converted when the model is built (stoker.gguf)
        return gguf_problem(name, value)
    if os.path.isdir(value):
        return _model_folder_problem(shown, value, head, tokenizer)
    if _looks_like_path(value):
        what = "is a file, not a folder" if os.path.exists(value) else "no such folder"
        return f"{shown}: {what}; {accepted}"
    invalid = _hub_id_problem(value)
    if invalid:
        return f"{shown}: no such local folder, and not a valid hub id ({invalid}); {accepted}"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(value, "config.json")
    if isinstance(cached, str):
        return _model_folder_problem(shown, os.path.dirname(cached), head, tokenizer)
    offline = _offline("TRANSFORMERS_OFFLINE")
    if offline:
        return (f"{shown}: no such local folder, not in the local hub cache, and {offline}=1 forbids downloading "
                f"it (unset {offline} to download it); {accepted}")
    answer = _ask_hub(value, "model")
    return f"{shown}: {answer}" if answer else None


def _model_folder_problem(shown: str, folder: str, head: str | None, tokenizer: bool) -> str | None:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return f"{shown}: the folder has no config.json (not a transformers model folder)"
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{shown}: config.json is not valid JSON ({e})"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return f"{shown}: config.json has no model_type (a transformers config names its model type)"
    if head is not None:
        from transformers.models.auto import modeling_auto

        types = getattr(modeling_auto, f"MODEL_FOR_{head.upper()}_MAPPING_NAMES")
        if model_type not in types:
            examples = [t for t in ("llama", "qwen2", "gpt2", "bert", "roberta", "mistral") if t in types][:4]
            return (f"{shown}: transformers has no {head.replace('_', '-')} head for model_type {model_type!r}; "
                    f"accepted: one of the {len(types)} model types that have one, e.g. {', '.join(examples)}")
    if tokenizer and not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return f"{shown}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    return None


def adapter_folder_problem(name: str, path: str) -> str | None:
    """Whether `path` is a folder holding a peft adapter (adapter_config.json naming its peft_type)."""
    shown = f"{name}={path!r}"
    if not os.path.isdir(path):
        return f"{shown}: no such folder; accepted: a folder holding adapter_config.json (a trained LoRA adapter)"
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        return f"{shown}: no adapter_config.json (not a peft adapter folder)"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{shown}: adapter_config.json is not valid JSON ({e})"
    if not (isinstance(config, dict) and isinstance(config.get("peft_type"), str)):
        return f"{shown}: adapter_config.json names no peft_type (not a peft adapter config)"
    return None


def dataset_source_problem(name: str, value: str, generated: tuple[str, ...]) -> str | None:
    """Whether `value` is a generated task, a local dataset folder, a cached hub dataset, or one the hub has."""
    shown = f"{name}={value!r}"
    accepted = (f"accepted: a generated task ({', '.join(generated)}), a local dataset folder, or a hub dataset id "
                "such as 'org/name' (local files: train_file)")
    if value in generated or os.path.isdir(value):
        return None
    if value.endswith(DATA_SUFFIXES + (".csv", ".parquet")) or _looks_like_path(value):
        what = "is a file: give data files as train_file" if os.path.isfile(value) else "no such folder"
        return f"{shown}: {what}; {accepted}"
    invalid = _hub_id_problem(value)
    if invalid:
        return f"{shown}: not a valid hub id ({invalid}){suggest(value, generated)}; {accepted}"
    from huggingface_hub.constants import HF_HOME, HF_HUB_CACHE

    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(HF_HOME, "datasets")  # as datasets has it
    if (os.path.isdir(os.path.join(HF_HUB_CACHE, "datasets--" + value.replace("/", "--")))
            or os.path.isdir(os.path.join(datasets_cache, value.replace("/", "___")))):
        return None
    offline = _offline("HF_DATASETS_OFFLINE")
    if offline:
        return (f"{shown}: not a generated task, a local folder or a cached dataset, and {offline}=1 forbids "
                f"downloading it (unset {offline} to download it){suggest(value, generated)}; {accepted}")
    answer = _ask_hub(value, "dataset")
    return f"{shown}: {answer}{suggest(value, generated)}" if answer else None


# ---------------------------------------------------------------------------------------------------
# local data files


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


def read_rows(path: str) -> list[tuple[str, object]]:
    """(where, row) for every row of a .json/.jsonl file, `where` being 'line N' (or 'row N' of a JSON array);
    raises ValueError naming the line of the first thing that is not JSON. As datasets reads them, a .json file
    is one document (an array of rows, or one row) or else JSON Lines; a .jsonl file is JSON Lines."""
    text = _read_text(path)
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return []
    if not path.endswith(".jsonl"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as e:
            try:
                json.loads(lines[first])
            except ValueError:  # not JSON Lines either: the document's own error says where it breaks
                raise ValueError(f"line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None
        else:
            rows = document if isinstance(document, list) else [document]
            return [(f"row {i + 1}", row) for i, row in enumerate(rows)]
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((f"line {i + 1}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"line {i + 1}, column {e.colno}: not valid JSON ({e.msg})") from None
    return out


def data_file_problems(name: str, path: str, columns: list[list[str]] | None, value_problem) -> list[str]:
    """Every problem with one local data file: that it is missing, not text, not JSON at some line, empty, or
    that its rows lack every column set of `columns` (the first set the rows have is used), or hold a value
    `value_problem(column, value)` refuses (a reason, or None)."""
    shown = f"{name}={path!r}"
    if not path.endswith(DATA_SUFFIXES):
        return [f"{shown}: accepted formats are {', '.join(DATA_SUFFIXES)}"]
    if not os.path.isfile(path):
        return [f"{shown}: {'is a folder' if os.path.isdir(path) else 'no such file'}; accepted: a "
                f"{'/'.join(DATA_SUFFIXES)} file"]
    try:
        if path.endswith(".txt"):  # datasets' text loader: one row per line, in column 'text'
            rows = [(f"line {i + 1}", {"text": line}) for i, line in enumerate(_read_text(path).splitlines())]
        else:
            rows = read_rows(path)
    except OSError as e:
        return [f"{shown}: cannot be read ({e.strerror})"]
    except ValueError as e:
        return [f"{shown}: {e}"]
    if not rows:
        return [f"{shown}: has no rows"]
    not_objects = [where for where, row in rows if not isinstance(row, dict)]
    if not_objects:
        return [f"{shown}: {_listed(not_objects)}: a row must be a JSON object of column: value, e.g. "
                '{"text": "..."}']
    if columns is None:
        return []
    found = sorted({k for _, row in rows for k in row})
    option = next((o for o in columns if set(o) <= set(found)), None)
    if option is None:
        wanted = " or ".join("+".join(repr(c) for c in o) for o in columns)
        return [f"{shown}: rows need {wanted}; found columns {found}"]
    bad = []
    for where, row in rows:
        for column in option:
            why = "missing" if column not in row else value_problem(column, row[column])
            if why:
                bad.append(f"{where}: {column!r} {why}")
                break
    if bad:
        more = f" (and {len(bad) - MAX_ROW_PROBLEMS} more rows)" if len(bad) > MAX_ROW_PROBLEMS else ""
        return [f"{shown}: {'; '.join(bad[:MAX_ROW_PROBLEMS])}{more}"]
    return []


def _listed(wheres: list[str]) -> str:
    more = f" (and {len(wheres) - MAX_ROW_PROBLEMS} more)" if len(wheres) > MAX_ROW_PROBLEMS else ""
    return ", ".join(wheres[:MAX_ROW_PROBLEMS]) + more
