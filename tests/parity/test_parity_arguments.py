"""TrainingArguments normalised and checked as transformers.TrainingArguments does it: each case is made with
both classes and compared (a refusal is a ValueError in both, with transformers' phrase in stoker's message)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import stoker
from stoker.errors import ConfigError


def both(**kw):
    return transformers.TrainingArguments(**kw), stoker.TrainingArguments(**kw)


def test_output_dir_with_a_tilde_is_expanded():
    hf, ours = both(output_dir="~/stoker_parity_out")
    assert ours.output_dir == hf.output_dir == os.path.join(os.path.expanduser("~"), "stoker_parity_out")


def test_a_trainer_without_arguments_writes_where_transformers_writes(tmp_path, monkeypatch):
    """Trainer(model) without args: transformers makes TrainingArguments(output_dir="tmp_trainer"), not the
    dataclass's own default folder."""
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 1)
    assert stoker.Trainer(model).args.output_dir == transformers.Trainer(model).args.output_dir == "tmp_trainer"


def test_use_cpu_turns_pinned_memory_off():
    hf, ours = both(output_dir="x", use_cpu=True)
    assert ours.dataloader_pin_memory is hf.dataloader_pin_memory is False
    hf, ours = both(output_dir="x")
    assert ours.dataloader_pin_memory is hf.dataloader_pin_memory is True


@pytest.mark.parametrize("settings, phrase", [
    (dict(bf16=True, fp16=True), "At most one of fp16 and bf16 can be True, but not both"),
    (dict(bf16_full_eval=True, fp16_full_eval=True), "At most one of fp16 and bf16 can be True for full eval"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "lr_scheduler_type reduce_lr_on_plateau requires an eval "
                                                     "strategy"),
], ids=["fp16_and_bf16", "full_eval_fp16_and_bf16", "plateau_without_evaluation"])
def test_refusals_are_value_errors_in_transformers_words(settings, phrase):
    with pytest.raises(ValueError, match=phrase):
        transformers.TrainingArguments(output_dir="x", use_cpu=True, **settings)
    with pytest.raises(ValueError, match=phrase) as caught:
        stoker.TrainingArguments(output_dir="x", use_cpu=True, **settings)
    assert isinstance(caught.value, ConfigError)


def test_save_strategy_best_without_a_metric_is_refused_in_transformers_words(tmp_path):
    phrase = "`args.metric_for_best_model` must be provided when using 'best' save_strategy"
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=phrase):
        hf = transformers.TrainingArguments(output_dir=str(tmp_path), save_strategy="best", eval_strategy="steps")
        transformers.Trainer(model, hf, eval_dataset=[{"x": 1}])
    with pytest.raises(ValueError, match=phrase):
        stoker.TrainingArguments(output_dir=str(tmp_path), save_strategy="best", eval_strategy="steps")


def test_torch_dtypes_are_written_as_their_names():
    hf = transformers.TrainingArguments(output_dir="x", lr_scheduler_kwargs={"dtype": torch.float32})
    ours = stoker.TrainingArguments(output_dir="x", lr_scheduler_kwargs={"dtype": torch.float32})
    assert ours.to_dict()["lr_scheduler_kwargs"] == hf.to_dict()["lr_scheduler_kwargs"] == {"dtype": "float32"}
    assert json.loads(ours.to_json_string())["lr_scheduler_kwargs"] == {"dtype": "float32"}
    assert ours.lr_scheduler_kwargs == {"dtype": torch.float32}  # the arguments themselves are left as they are


def test_a_subclass_dtype_field_is_written_as_its_name():
    import dataclasses

    @dataclasses.dataclass
    class WithDtype(stoker.TrainingArguments):
        dtype: object = None

    assert WithDtype(output_dir="x", dtype=torch.bfloat16).to_dict()["dtype"] == "bfloat16"


ACCELERATOR_ATTRIBUTES = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                          "non_blocking", "gradient_accumulation_kwargs", "use_configured_state")


def accelerator_configs(value):
    """accelerator_config=value read by both classes, as dicts of the attributes."""
    hf, ours = (cls(output_dir="x", accelerator_config=value).accelerator_config
                for cls in (transformers.TrainingArguments, stoker.TrainingArguments))
    return ({k: getattr(hf, k) for k in ACCELERATOR_ATTRIBUTES}, {k: getattr(ours, k) for k in ACCELERATOR_ATTRIBUTES})


@pytest.mark.parametrize("kind", ["none", "dict", "partial_dict", "json_file", "json_string", "transformers_object"])
def test_accelerator_config_is_read_as_transformers_reads_it(tmp_path, kind):
    from transformers.trainer_pt_utils import AcceleratorConfig

    values = {"split_batches": True, "dispatch_batches": False, "even_batches": False,
              "use_seedable_sampler": False, "non_blocking": True}
    path = tmp_path / "accelerate.json"
    path.write_text(json.dumps(values))
    value = {"none": None, "dict": values, "partial_dict": {"even_batches": False}, "json_file": str(path),
             "json_string": json.dumps(values), "transformers_object": AcceleratorConfig(**values)}[kind]
    if kind == "json_string":  # transformers reads a string as a path only; stoker also takes JSON text
        hf = {k: getattr(AcceleratorConfig(**values), k) for k in ACCELERATOR_ATTRIBUTES}
        ours = {k: getattr(stoker.TrainingArguments(output_dir="x", accelerator_config=value).accelerator_config, k)
                for k in ACCELERATOR_ATTRIBUTES}
    else:
        hf, ours = accelerator_configs(value)
    assert ours == hf
    if kind == "none":
        assert ours["dispatch_batches"] is None and ours["even_batches"] is True


def test_accelerator_config_reaches_the_accelerator_and_the_saved_arguments(tmp_path):
    from tests.helpers.tiny_jobs import Regressor

    args = stoker.TrainingArguments(output_dir=str(tmp_path), accelerator_config={"even_batches": False},
                                    report_to="none")
    trainer = stoker.Trainer(Regressor(), args)
    config = trainer.accelerator.dataloader_config
    assert config.even_batches is False and config.dispatch_batches is None and config.use_seedable_sampler
    assert args.to_dict()["accelerator_config"]["even_batches"] is False
    again = stoker.TrainingArguments(**json.loads(args.to_json_string()))
    assert again.accelerator_config.to_dict() == args.accelerator_config.to_dict()


def test_accelerator_config_refusals_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as caught:
        stoker.TrainingArguments(output_dir="x", accelerator_config={"split_batch": True})
    assert "'split_batches'" in str(caught.value)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        stoker.TrainingArguments(output_dir="x", accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}})
    with pytest.raises(ConfigError, match="cannot read the JSON file"):
        stoker.TrainingArguments(output_dir="x", accelerator_config=str(tmp_path / "missing.json"))


@pytest.mark.parametrize("kind", ["none", "empty", "partial", "pathlib_path", "dispatch_set"])
def test_accelerator_config_reaches_the_trainers_accelerator_as_in_transformers(tmp_path, kind):
    from tests.helpers.tiny_jobs import Regressor, regression_rows

    path = tmp_path / "accelerate.json"
    path.write_text(json.dumps({"split_batches": True, "even_batches": False, "use_seedable_sampler": False}))
    value = {"none": None, "empty": {}, "partial": {"even_batches": False}, "pathlib_path": path,
             "dispatch_set": {"dispatch_batches": True}}[kind]
    seen = {}
    for name, module in (("hf", transformers), ("stoker", stoker)):
        args = module.TrainingArguments(output_dir=str(tmp_path / name), report_to="none", use_cpu=True,
                                        accelerator_config=value)
        accelerator = module.Trainer(Regressor(as_dict=True), args, train_dataset=regression_rows(4)).accelerator
        seen[name] = {k: getattr(accelerator, k) for k in ("split_batches", "dispatch_batches", "even_batches",
                                                             "use_seedable_sampler", "non_blocking")}
        seen[name]["args"] = {k: getattr(args.accelerator_config, k) for k in ACCELERATOR_ATTRIBUTES}
    if kind == "pathlib_path":
        assert seen["hf"]["split_batches"] is True and seen["hf"]["even_batches"] is False
    if kind != "dispatch_set":
        # left None, the Accelerator holds None as transformers' does (stoker prepares its loaders as with False:
        # the documented difference, tests/parity/test_parity_hf_behaviours.py)
        assert seen["hf"]["dispatch_batches"] is None and seen["stoker"]["dispatch_batches"] is None
        assert seen["stoker"]["args"]["dispatch_batches"] is None
    assert seen["stoker"] == seen["hf"]
