"""TrainingArguments: parity with transformers, one-shot validation, derived values, serialisation, import cost."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
import torch

from stoker import ConfigError, TrainingArguments
from stoker.arguments import NOT_YET_SUPPORTED, SCHEDULER_NAMES
from stoker.optim import OPTIMIZERS

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")

# Fields that both dataclasses define (transformers 5.x). A field renamed or dropped on either side fails
# test_field_names_overlap_transformers. A field stoker adds later under a transformers name joins the overlap
# and test_declared_defaults_match_transformers checks its default too.
OVERLAP = {
    "accelerator_config", "adam_beta1", "adam_beta2", "adam_epsilon", "auto_find_batch_size", "bf16", "data_seed",
    "dataloader_drop_last", "dataloader_num_workers", "dataloader_persistent_workers", "dataloader_pin_memory",
    "dataloader_prefetch_factor", "ddp_backend", "ddp_broadcast_buffers", "ddp_bucket_cap_mb",
    "ddp_find_unused_parameters", "ddp_timeout", "deepspeed", "disable_tqdm", "eval_accumulation_steps",
    "eval_on_start", "eval_steps", "eval_strategy", "fp16", "fsdp", "fsdp_config", "gradient_accumulation_steps",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "greater_is_better", "include_num_input_tokens_seen",
    "label_names", "learning_rate", "length_column_name", "load_best_model_at_end", "logging_first_step",
    "logging_steps", "logging_strategy", "lr_scheduler_kwargs", "lr_scheduler_type", "max_grad_norm", "max_steps",
    "metric_for_best_model", "num_train_epochs", "optim", "optim_args", "output_dir", "per_device_eval_batch_size",
    "per_device_train_batch_size", "remove_unused_columns", "report_to", "resume_from_checkpoint", "run_name",
    "save_steps", "save_strategy", "save_total_limit", "seed", "tf32", "torch_compile", "torch_compile_backend",
    "torch_compile_mode", "use_cpu", "warmup_steps", "weight_decay",
}
# Fields transformers 5 dropped and stoker keeps, with the defaults transformers 4 had.
KEPT_FROM_TRANSFORMERS_4 = {"overwrite_output_dir": False, "warmup_ratio": 0.0, "group_by_length": False,
                            "logging_dir": None}
# Intentional differences in the declared default: bf16 is None, "not given", so that a CUDA GPU with bf16 trains
# in it (gpu_defaults) while an explicit bf16=False keeps float32; it resolves to a bool, False off such GPUs.
DEFAULT_EXCEPTIONS: set[str] = {"bf16"}
# The groups STYLE.md names for the fields (plus where the run writes); stoker may add groups of its own.
GROUPS = {"output", "duration", "batch", "optimizer", "precision", "memory", "data", "logging", "evaluation",
          "saving", "distributed"}


def _declared_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# ---------------------------------------------------------------------------------------------------
# parity with transformers


def test_field_names_overlap_transformers():
    import transformers

    hf = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert OVERLAP - (ours & hf) == set()
    assert set(KEPT_FROM_TRANSFORMERS_4) <= ours - hf


def test_stoker_only_fields_are_not_near_misses_of_transformers_names():
    # a field of stoker's own must not look like a misspelt transformers field ('warmup_step', 'eval_stategy'),
    # or a YAML written for transformers would be rejected or, worse, mean something else
    import difflib

    import transformers

    hf = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    ours = [f.name for f in dataclasses.fields(TrainingArguments)]
    near = {n: difflib.get_close_matches(n, hf, n=1, cutoff=0.8) for n in ours if n not in hf}
    assert {n: m for n, m in near.items() if m} == {}


def test_declared_defaults_match_transformers():
    import transformers

    hf = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    mismatches = {}
    for name in sorted((set(ours) & set(hf)) - DEFAULT_EXCEPTIONS):
        a, b = _declared_default(hf[name]), _declared_default(ours[name])
        if a != b or type(a) is not type(b):
            mismatches[name] = (a, b)
    assert mismatches == {}
    for name, default in KEPT_FROM_TRANSFORMERS_4.items():
        assert _declared_default(ours[name]) == default, name


def test_include_num_input_tokens_seen_takes_transformers_values():
    assert TrainingArguments(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    assert TrainingArguments(include_num_input_tokens_seen=False).include_num_input_tokens_seen == "no"
    assert TrainingArguments(include_num_input_tokens_seen="non_padding").include_num_input_tokens_seen == "non_padding"
    with pytest.raises(ConfigError, match="include_num_input_tokens_seen='some'"):
        TrainingArguments(include_num_input_tokens_seen="some")


def test_resolved_defaults_match_transformers():
    import transformers

    hf, ours = transformers.TrainingArguments(), TrainingArguments()
    assert ours.output_dir == hf.output_dir == "trainer_output"
    assert ours.gradient_checkpointing is hf.gradient_checkpointing is False
    for name in ("per_device_train_batch_size", "learning_rate", "optim", "lr_scheduler_type", "save_steps",
                 "logging_steps", "num_train_epochs", "max_steps", "seed", "weight_decay", "max_grad_norm"):
        assert getattr(ours, name) == getattr(hf, name), name


def test_scheduler_names_follow_transformers():
    from transformers.trainer_utils import SchedulerType

    assert len(set(SCHEDULER_NAMES)) == len(SCHEDULER_NAMES)
    assert set(SCHEDULER_NAMES) == {s.value for s in SchedulerType}


# optimizers transformers (5.x) does not build: Muon (stoker/muon.py; tested in tests/unit/test_muon.py)
BEYOND_TRANSFORMERS = {"muon"}


def test_optimizer_names_are_transformers_names():
    from transformers.training_args import OptimizerNames

    assert len(set(OPTIMIZERS)) == len(OPTIMIZERS)
    assert set(OPTIMIZERS) - {o.value for o in OptimizerNames} == BEYOND_TRANSFORMERS


def test_every_field_has_help_and_one_group():
    from stoker.arguments import FIELD_GROUPS
    from stoker.seq2seq import Seq2SeqTrainingArguments

    for f in dataclasses.fields(TrainingArguments):
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f.name
    listed = [name for names in FIELD_GROUPS.values() for name in names]
    assert len(listed) == len(set(listed))  # no field in two groups
    assert set(listed) == {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    assert GROUPS <= set(FIELD_GROUPS)


def test_the_class_banners_are_the_field_groups_in_order():
    """The `# --- name ---` banners that section TrainingArguments' source are FIELD_GROUPS' groups, in order, and
    every field stands under the banner of its group, so that the two cannot drift apart."""
    import inspect
    import re

    from stoker.arguments import FIELD_GROUPS, GROUP_OF

    banners, misplaced = [], []
    for line in inspect.getsource(TrainingArguments).splitlines():
        if m := re.match(r"    # --- (.+?) -+$", line):
            banners.append(m.group(1))
        elif (m := re.match(r"    (\w+): .+ = field\(", line)) and banners:
            if GROUP_OF[m.group(1)] != list(FIELD_GROUPS)[len(banners) - 1]:
                misplaced.append(f"{m.group(1)} (under {banners[-1]!r}, in group {GROUP_OF[m.group(1)]!r})")
    assert len(banners) == len(FIELD_GROUPS) - 1  # all but Seq2SeqTrainingArguments' generation group
    assert misplaced == []


def test_metadata_is_what_argparse_accepts():
    # transformers' parser hands each field's metadata to argparse.add_argument as keyword arguments
    import argparse

    accepted = set(inspect.signature(argparse.Action.__init__).parameters) - {"self", "option_strings", "dest"}
    for f in dataclasses.fields(TrainingArguments):
        assert set(f.metadata) <= accepted, f.name


def test_transformers_parser_reads_flags_and_json(tmp_path):
    from transformers import HfArgumentParser

    @dataclasses.dataclass
    class ModelArguments:
        model_name_or_path: str = "tiny"

    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses(
        ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--do_train", "--gradient_checkpointing",
         "--include_for_metrics", "inputs", "loss", "--log_level", "error", "--learning_rate", "3e-4"])
    assert model_args.model_name_or_path == "m" and isinstance(args, TrainingArguments)
    assert (args.do_train, args.do_eval, args.gradient_checkpointing, args.activation_checkpointing) == (
        True, False, True, True)
    assert args.include_for_metrics == ["inputs", "loss"] and args.learning_rate == 3e-4
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "eval_strategy": "steps", "eval_steps": 3,
                                "label_smoothing_factor": 0.1}))
    _, from_file = parser.parse_json_file(str(path))
    assert from_file.do_eval is True  # set by eval_strategy, as transformers does
    assert from_file.label_smoothing_factor == 0.1 and from_file.eval_steps == 3


# ---------------------------------------------------------------------------------------------------
# validation: every problem, once


def _problems(**kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        TrainingArguments(**kwargs)
    return info.value


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_all_problems_reported_in_one_error():
    err = _problems(bf16=True, fp16=True, per_device_train_batch_size=0, gradient_accumulation_steps=-1,
                    optim="adamw_torh", lr_scheduler_type="cosin")
    message = str(err)
    for name in ("bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps", "optim=",
                 "lr_scheduler_type"):
        assert name in message, name
    # one problem entry per offending field, each naming its field
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "optim", "lr_scheduler_type"):
        assert any(p.startswith(f"{name}=") for p in err.problems), name
    assert any("bf16" in p and "fp16" in p for p in err.problems)
    assert len(err.problems) >= 5
    assert "'adamw_torch'" in message
    assert "'cosine'" in message
    assert message.count("invalid TrainingArguments") == 1


def test_valid_defaults_raise_nothing():
    args = TrainingArguments()
    assert args.problems() == []


def test_load_best_model_needs_evaluation():
    err = _problems(load_best_model_at_end=True, eval_strategy="no")
    assert "load_best_model_at_end" in str(err) and "eval_strategy" in str(err)


def test_load_best_model_needs_matching_strategies():
    err = _problems(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch")
    assert "save_strategy" in str(err) and "eval_strategy" in str(err)
    TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")


def test_load_best_model_needs_save_steps_multiple_of_eval_steps():
    err = _problems(load_best_model_at_end=True, eval_strategy="steps", eval_steps=30, save_steps=50)
    assert "save_steps" in str(err) and "eval_steps" in str(err) and "multiple" in str(err)
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=30, save_steps=60)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False


def test_save_best_needs_a_metric():
    err = _problems(save_strategy="best", eval_strategy="steps")
    assert "metric_for_best_model" in str(err)
    TrainingArguments(save_strategy="best", eval_strategy="steps", metric_for_best_model="loss")


@needs_no_cuda
def test_fp16_on_cpu_is_rejected():
    err = _problems(fp16=True)
    assert "fp16" in str(err) and "CUDA GPU" in str(err)


@needs_no_cuda
def test_tf32_on_cpu_is_rejected():
    err = _problems(tf32=True)
    assert "tf32" in str(err)
    TrainingArguments(tf32=False)  # turning it off is always fine


def test_worker_options_need_workers():
    err = _problems(dataloader_persistent_workers=True, dataloader_prefetch_factor=2)
    assert any(p.startswith("dataloader_persistent_workers=") for p in err.problems)
    assert any(p.startswith("dataloader_prefetch_factor=") for p in err.problems)
    TrainingArguments(dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_prefetch_factor=2)


def test_unknown_report_to():
    err = _problems(report_to="wandbb")
    assert "report_to=['wandbb']: unknown tracker 'wandbb' (did you mean 'wandb'?)" in str(err)


# A value that turns each feature on. The fields still in NOT_YET_SUPPORTED are checked; one that is built
# leaves that list (and its help text), which test_not_yet_supported_list_matches_help_texts keeps in step.
FEATURE_ON = {"fsdp": "full_shard", "deepspeed": "ds.json", "auto_find_batch_size": True,
              "fsdp_config": {"min_num_params": 1}}


def test_not_yet_supported_fields():
    # a loop, not a parametrisation: the list may be empty (fsdp, fsdp_config and deepspeed left it), and an
    # empty parametrisation would be reported as a skipped test
    for name in sorted(NOT_YET_SUPPORTED):
        err = _problems(**{name: FEATURE_ON[name]})  # a KeyError here: add the new field to FEATURE_ON
        assert len(err.problems) == 1
        assert err.problems[0].startswith(f"{name}=") and "not yet supported" in err.problems[0]


def test_not_yet_supported_list_matches_help_texts():
    assert set(NOT_YET_SUPPORTED) <= set(FEATURE_ON)  # every unsupported field has a value to test it with
    flagged = {f.name for f in dataclasses.fields(TrainingArguments) if "not yet supported" in f.metadata["help"]}
    assert flagged == set(NOT_YET_SUPPORTED)
    # fsdp, fsdp_config and deepspeed are checked by stoker.distributed (tests/unit/test_distributed_config.py)
    assert not {"fsdp", "fsdp_config", "deepspeed"} & flagged


def test_unknown_accelerator_config_key():
    err = _problems(accelerator_config={"split_batch": True})
    assert "accelerator_config" in str(err) and "'split_batches'" in str(err)
    args = TrainingArguments(accelerator_config='{"split_batches": false}')
    assert args.accelerator_config.split_batches is False and args.accelerator_config.even_batches is True


def test_invalid_json_for_scheduler_kwargs():
    err = _problems(lr_scheduler_kwargs="{num_cycles: 2}")
    assert "lr_scheduler_kwargs" in str(err) and "JSON" in str(err)
    assert TrainingArguments(lr_scheduler_kwargs='{"num_cycles": 2}').lr_scheduler_kwargs == {"num_cycles": 2}


# ---------------------------------------------------------------------------------------------------
# derived values


def test_eval_steps_defaults_to_logging_steps():
    assert TrainingArguments(logging_steps=7).eval_steps == 7
    assert TrainingArguments(logging_steps=7, eval_steps=3).eval_steps == 3


def test_data_seed_defaults_to_seed():
    assert TrainingArguments(seed=5).data_seed == 5
    assert TrainingArguments(seed=5, data_seed=9).data_seed == 9


def test_a_data_seed_not_given_follows_a_later_seed_and_a_given_one_stays():
    # transformers shuffles by "data_seed, else seed" when it shuffles, so a seed set after construction counts
    args = TrainingArguments(seed=5)
    args.seed = 7
    assert args.data_seed == 7
    args.set_training(seed=11)
    assert (args.seed, args.data_seed) == (11, 11)
    given = TrainingArguments(seed=5, data_seed=9)
    given.seed = 7
    given.set_training(seed=11)
    assert given.data_seed == 9
    args.data_seed = 3  # set by hand: it no longer follows
    args.seed = 1
    assert args.data_seed == 3
    assert "_data_seed_is_seed" not in TrainingArguments(seed=5).to_dict()


def test_torch_compile_mode_implies_compile():
    plain = TrainingArguments()
    assert plain.torch_compile is False and plain.torch_compile_backend is None
    args = TrainingArguments(torch_compile_mode="reduce-overhead")
    assert args.torch_compile is True and args.torch_compile_backend == "inductor"
    args = TrainingArguments(torch_compile_backend="eager")
    assert args.torch_compile is True and args.torch_compile_backend == "eager"


def test_warmup_for():
    assert TrainingArguments(warmup_steps=10).warmup_for(95) == 10
    assert TrainingArguments(warmup_steps=0.1).warmup_for(95) == 10  # ceil(9.5)
    assert TrainingArguments(warmup_ratio=0.2).warmup_for(50) == 10
    assert TrainingArguments().warmup_for(50) == 0


def test_optimizer_kwargs_parses_tuples_numbers_and_strings():
    args = TrainingArguments(optim_args="betas=(0.9,0.95),eps=1e-6,foo=bar")
    assert args.optimizer_kwargs() == {"betas": (0.9, 0.95), "eps": 1e-6, "foo": "bar"}


def test_optim_args_without_equals_is_rejected():
    err = _problems(optim_args="eps")
    assert "optim_args" in str(err)


# ---------------------------------------------------------------------------------------------------
# serialisation


def test_json_round_trip():
    args = TrainingArguments(output_dir="somewhere", learning_rate=3e-4, lr_scheduler_type="cosine",
                             lr_scheduler_kwargs={"num_cycles": 2}, label_names=["labels", "more"],
                             report_to="tensorboard", warmup_ratio=0.1, optim_args="eps=1e-6",
                             accelerator_config={"even_batches": False}, eval_strategy="steps", eval_steps=5)
    again = TrainingArguments.from_dict(json.loads(args.to_json_string()))
    assert again.to_dict() == args.to_dict()
    assert again.lr_scheduler_kwargs == {"num_cycles": 2} and again.label_names == ["labels", "more"]
    assert TrainingArguments.from_dict(json.loads(TrainingArguments().to_json_string())).to_dict() \
        == TrainingArguments().to_dict()


def test_from_dict_rejects_unknown_keys_with_a_suggestion():
    with pytest.raises(ConfigError) as info:
        TrainingArguments.from_dict({"learning_rat": 1e-4, "seed": 1})
    assert "learning_rat" in str(info.value) and "'learning_rate'" in str(info.value)


# ---------------------------------------------------------------------------------------------------
# import cost


def test_import_stoker_stays_light():
    code = ("import json, sys, stoker\n"
            "heavy = ('transformers', 'peft', 'bitsandbytes', 'datasets', 'tensorboard', 'matplotlib')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
            "print(json.dumps('torch' in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == []
    assert json.loads(lines[-1]) is True  # the check itself works: a module that is imported is seen


# ---------------------------------------------------------------------------------------------------
# the process view and helpers transformers' scripts read


def test_properties_and_helpers_equal_transformers(tmp_path):
    import logging

    import transformers

    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, per_device_eval_batch_size=5,
              log_level="info", log_level_replica="error", hub_token="secret")
    hf = transformers.TrainingArguments(**kw)
    ours = TrainingArguments(**kw)
    for name in ("train_batch_size", "eval_batch_size", "device", "n_gpu", "world_size", "process_index",
                 "local_process_index", "should_log", "should_save", "parallel_mode"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.get_process_log_level() == hf.get_process_log_level() == logging.INFO
    order = []
    with ours.main_process_first(desc="tokenising"):
        order.append("main")
    assert order == ["main"]
    assert ours.to_dict()["hub_token"] == hf.to_dict()["hub_token"] == "<HUB_TOKEN>"
    assert json.loads(ours.to_json_string())["per_device_train_batch_size"] == 3
    assert all(isinstance(v, (bool, int, float, str)) for v in ours.to_sanitized_dict().values())


def test_transformers_post_init_conventions():
    assert TrainingArguments(eval_strategy="steps", eval_steps=2).do_eval is True
    assert TrainingArguments().do_eval is False
    assert TrainingArguments(activation_checkpointing=True).gradient_checkpointing is True
    assert TrainingArguments(gradient_checkpointing=True).activation_checkpointing is True
    assert TrainingArguments(group_by_length=True).train_sampling_strategy == "group_by_length"
    assert TrainingArguments(train_sampling_strategy="group_by_length").group_by_length is True
    assert TrainingArguments(include_for_metrics="loss").include_for_metrics == ["loss"]
    assert TrainingArguments(debug="underflow_overflow").debug == ["underflow_overflow"]


def test_new_fields_are_validated_together():
    err = _problems(label_smoothing_factor=1.5, neftune_noise_alpha=0, torch_empty_cache_steps=0, eval_delay=-1,
                    include_for_metrics=["logits"], log_level="loud", hub_strategy="sometimes",
                    enable_jit_checkpoint=True, save_on_signal=False, liger_kernel_config={"rope": True})
    names = [p.split("=")[0] for p in err.problems]
    assert names == ["log_level", "hub_strategy", "label_smoothing_factor", "neftune_noise_alpha",
                     "torch_empty_cache_steps", "eval_delay", "include_for_metrics", "enable_jit_checkpoint",
                     "liger_kernel_config"]
    assert "accepted: detail, debug, info, warning, error, critical, passive" in str(err)


@pytest.mark.parametrize("name", [name for name, o in OPTIMIZERS.items()
                                  if o.builds != "transformers" and name not in BEYOND_TRANSFORMERS])
def test_every_optimizer_name_builds_what_transformers_builds(name):
    """The table's class and keyword arguments for each name are transformers.Trainer's for the same arguments."""
    import transformers

    from stoker.optim import optimizer_cls_and_kwargs

    settings = {"optim": name, "learning_rate": 3e-4, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-7}
    cls, kwargs = optimizer_cls_and_kwargs(TrainingArguments(**settings))
    hf_cls, hf_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(
        transformers.TrainingArguments(**settings, use_cpu=True))
    assert cls is hf_cls
    if name != "adamw_torch_fused":  # transformers adds fused=True only where torch has a fused kernel
        assert kwargs == hf_kwargs


def test_an_optimizer_added_to_the_table_is_validated_with_its_package(monkeypatch):
    """One entry is all a new name needs: --help's list, validation and the missing-package check before any work
    come from the table."""
    from stoker.optim import Optimizer

    monkeypatch.setitem(OPTIMIZERS, "rmsprop_bnb", Optimizer("rmsprop_bnb", "no_such_package.optim:RMSprop8bit",
                                                            "lr", package="no_such_package"))
    with pytest.raises(ConfigError, match=r"optim='rmsprop_bnb': needs the no_such_package package, which is not "
                                          r"installed \(pip install no_such_package\)"):
        TrainingArguments(optim="rmsprop_bnb")
    with pytest.raises(ConfigError, match="optim='rmsprop_8bit': unknown optimizer.*accepted: .*rmsprop_bnb"):
        TrainingArguments(optim="rmsprop_8bit")


def test_every_transformers_optimizer_name_is_offered():
    """Every name of transformers' OptimizerNames is in the table but galore_adafactor_layerwise, which transformers
    builds with Adafactor's relative_step and a learning rate together, which Adafactor refuses."""
    from transformers.training_args import OptimizerNames

    assert {o.value for o in OptimizerNames} - set(OPTIMIZERS) == {"galore_adafactor_layerwise"}


def test_the_docs_list_every_optimizer_with_what_it_needs():
    """docs/arguments.md's optimizer table: one row per name of the table, in its order, with its package and
    needs as the table says them."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "arguments.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*) \| (.*) \|$", text.split("## Optimizers", 1)[1], re.M)
    assert rows == [(o.name, "transformers' builder" if o.builds == "transformers" else f"`{o.builds}`", o.needs)
                    for o in OPTIMIZERS.values()]


def test_a_missing_optimizer_package_is_named_with_its_pip_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "galore_torch" else real(name, *rest))
    with pytest.raises(ConfigError, match=r"optim='galore_adamw': needs the galore_torch package, which is not "
                                          r"installed \(pip install galore-torch\)"):
        TrainingArguments(optim="galore_adamw", optim_target_modules="all-linear", save_only_model=True)


def test_what_each_optimizer_needs_is_said_together():
    err = _problems(optim="galore_adamw_layerwise", gradient_accumulation_steps=2, use_cpu=True)
    assert [p.split(":")[0] for p in err.problems] == [
        "optim='galore_adamw_layerwise'", "optim='galore_adamw_layerwise' with gradient_accumulation_steps=2",
        "optim='galore_adamw_layerwise' with save_strategy='steps'"]
    err = _problems(optim="adamw_torch", optim_target_modules=["attn"])
    assert "optim_target_modules=['attn']: is read by the GaLore / APOLLO optimizers only (galore_adamw" in str(err)
    err = _problems(lr_scheduler_type="greedy")
    assert "lr_scheduler_type='greedy' steps on an evaluation metric" in str(err)
