"""Distributed settings as transformers reads them: a dict field given as a dict or a JSON file, and booleans
written as true/false, yes/no, 1/0, on/off."""

from __future__ import annotations

import json
import os


def load_json_config(value, name: str) -> tuple[dict | None, list[str]]:
    """A dict field given as a dict, or as the path of a JSON file (TrainingArguments has already parsed a JSON
    string). Returns (config, problems)."""
    if value is None or isinstance(value, dict):
        return (dict(value) if value is not None else None), []
    if not isinstance(value, str):
        return None, [f"{name}={value!r}: must be a dict, a JSON object string or the path of a JSON file"]
    if not os.path.isfile(value):
        return None, [f"{name}={value!r}: no such file (give a JSON file, a JSON object string or a dict)"]
    try:
        with open(value) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return None, [f"{name}={value!r}: not a readable JSON file ({e})"]
    if not isinstance(config, dict):
        return None, [f"{name}={value!r}: the file must hold a JSON object, not {type(config).__name__}"]
    return config, []


def as_bool(value, name: str, problems: list[str]) -> bool | None:
    """A boolean setting as transformers reads it (str_to_bool: true/false, yes/no, 1/0, on/off); None, with a
    problem appended to `problems` naming `name`, for anything else."""
    text = str(value).lower()
    if text in ("true", "yes", "y", "t", "on", "1"):
        return True
    if text in ("false", "no", "n", "f", "off", "0"):
        return False
    problems.append(f"{name}={value!r}: must be true or false")
    return None
