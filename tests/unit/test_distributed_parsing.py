"""stoker.distributed.parsing: a dict setting given as a dict or a JSON file, each wrong form one problem naming
the field; booleans read as transformers reads them."""

from __future__ import annotations

import json

import pytest

from stoker.distributed.parsing import as_bool, load_json_config


def test_a_dict_is_copied_and_none_stays_none():
    given = {"zero_optimization": {"stage": 2}}
    config, problems = load_json_config(given, "deepspeed")
    assert config == given and config is not given and problems == []
    assert load_json_config(None, "deepspeed") == (None, [])


def test_a_json_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto"}))
    assert load_json_config(str(path), "deepspeed") == ({"train_micro_batch_size_per_gpu": "auto"}, [])


def test_each_wrong_form_is_one_problem_naming_the_field(tmp_path):
    missing = str(tmp_path / "missing.json")
    config, problems = load_json_config(missing, "fsdp_config")
    assert config is None and problems == [f"fsdp_config={missing!r}: no such file (give a JSON file, a JSON object "
                                           "string or a dict)"]
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    config, problems = load_json_config(str(broken), "fsdp_config")
    assert config is None and len(problems) == 1 and "not a readable JSON file" in problems[0]
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert load_json_config(str(listed), "deepspeed") == (
        None, [f"deepspeed={str(listed)!r}: the file must hold a JSON object, not list"])
    config, problems = load_json_config(3, "deepspeed")
    assert config is None and problems[0].startswith("deepspeed=3: must be a dict")


@pytest.mark.parametrize("value, expected", [("true", True), ("Yes", True), ("1", True), (True, True), ("on", True),
                                             ("false", False), ("NO", False), (0, False), ("off", False)])
def test_booleans_are_read_as_transformers_reads_them(value, expected):
    problems = []
    assert as_bool(value, "use_orig_params", problems) is expected and problems == []


def test_anything_else_is_none_with_a_problem_naming_the_setting():
    problems = []
    assert as_bool("maybe", "sync_module_states", problems) is None
    assert problems == ["sync_module_states='maybe': must be true or false"]
