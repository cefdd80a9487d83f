"""stoker.distributed: the launcher's world, and transformers' fsdp / fsdp_config / deepspeed settings translated
into Accelerate plugins and checked, as pure functions (no processes, no GPU, no deepspeed package needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from torch import nn

from stoker import ConfigError, Trainer, TrainingArguments
from stoker.distributed import launch
from stoker.distributed.accelerator import check_sharding_active
from stoker.distributed.deepspeed import deepspeed_config, deepspeed_plugin
from stoker.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs
from stoker.distributed.launch import check_world_size, launcher_world_size, wants_cpu
from tests.helpers.tiny_jobs import llama

ROOT = Path(__file__).resolve().parents[2]


def problems_of(**kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="unused", **kw)
    return e.value.problems


# --- the launcher's world ----------------------------------------------------------------------------


def test_a_launcher_without_accelerators_gets_the_cpu_backend(monkeypatch):
    """Without cpu=True, Accelerate leaves each of torchrun's processes on its own on a machine without GPUs."""
    monkeypatch.setattr(launch, "accelerator_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launcher_world_size() == 1 and not wants_cpu(False) and wants_cpu(True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launcher_world_size() == 2 and wants_cpu(False)
    monkeypatch.setattr(launch, "accelerator_available", lambda: True)
    assert not wants_cpu(False)


def test_processes_that_did_not_join_one_group_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_world_size(2)
    with pytest.raises(RuntimeError, match=r"started 2 processes \(WORLD_SIZE=2\) but Accelerate set up 1"):
        check_world_size(1)
    monkeypatch.delenv("WORLD_SIZE")
    check_world_size(1)


ACCELERATE_VARIABLES = ("ACCELERATE_USE_CPU", "MASTER_ADDR", "WORLD_SIZE", "ACCELERATE_USE_FSDP",
                        "ACCELERATE_USE_DEEPSPEED")


@pytest.mark.parametrize("env, deepspeed_given, expected", [
    # `accelerate launch --num_processes 2` on a machine without GPUs: its default launcher, one process
    ({"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1"}, False,
     ["was asked for several processes but started this one alone (WORLD_SIZE unset)"]),
    ({"ACCELERATE_USE_CPU": "False"}, False, []),  # asked for one process
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, False, []),  # torchrun, or accelerate launch --multi_gpu
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, False,
     ["asks for FSDP: FSDP needs GPUs (or another accelerator), this machine has none, and Accelerate would "
      "silently train with DDP instead"]),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, False,
     ["asks for DeepSpeed: on a machine without GPUs Accelerate turns it off"]),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, True, []),  # stoker's own deepspeed runs on the CPU
])
def test_what_accelerate_launch_would_silently_not_do_here_is_named(monkeypatch, env, deepspeed_given, expected):
    for name in ACCELERATE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "accelerator_available", lambda: False)
    found = launch.accelerate_launch_problems(deepspeed_given)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found, strict=True)), found
    assert all(f.startswith("accelerate launch (") for f in found)
    monkeypatch.setattr(launch, "accelerator_available", lambda: True)  # on GPUs Accelerate does what it says
    assert launch.accelerate_launch_problems(deepspeed_given) == []


# --- FSDP ----------------------------------------------------------------------------------------------

# (fsdp, fsdp_config): each must give the plugin arguments transformers 5 gives (TrainingArguments.fsdp_plugin_args)
TRANSFORMERS_CASES = [
    ("full_shard", None),
    ("shard_grad_op offload auto_wrap", None),
    ("full_shard", {"fsdp_version": 1}),
    ("hybrid_shard", {"version": 1, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "backward_prefetch":
                      "backward_pre", "limit_all_gathers": "true"}),
    ("full_shard", {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}),
    ("full_shard", {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": "true",
                    "cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT",
                    "reshard_after_forward": "false"}),
    ("full_shard", {"auto_wrap_policy": "NO_WRAP", "cpu_offload": True}),
]


@pytest.mark.parametrize("fsdp, fsdp_config", TRANSFORMERS_CASES)
def test_fsdp_settings_mean_what_they_mean_in_transformers(fsdp, fsdp_config, tmp_path):
    import transformers

    theirs = transformers.TrainingArguments(str(tmp_path), fsdp=fsdp, report_to="none",
                                            fsdp_config=json.loads(json.dumps(fsdp_config))).fsdp_plugin_args
    ours, problems = fsdp_plugin_kwargs(fsdp, fsdp_config)
    assert problems == []
    if "transformer_cls_names_to_wrap" in ours:  # a list here, a comma-joined string there; Accelerate takes both
        ours["transformer_cls_names_to_wrap"] = ",".join(ours["transformer_cls_names_to_wrap"])
    assert ours == theirs


def test_min_num_params_alone_wraps_by_size():
    """transformers 5 ignores min_num_params unless auto_wrap_policy says SIZE_BASED_WRAP; stoker, as
    transformers 4 did, takes a min_num_params given alone to mean wrapping by size rather than drop it."""
    kwargs, problems = fsdp_plugin_kwargs("full_shard", {"min_num_params": 2000})
    assert problems == [] and kwargs["auto_wrap_policy"] == "SIZE_BASED_WRAP" and kwargs["min_num_params"] == 2000


def test_layers_to_wrap_default_to_the_models_no_split_modules():
    kwargs, problems = fsdp_plugin_kwargs(True, None, model=llama())
    assert problems == [] and kwargs["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]
    _, problems = fsdp_plugin_kwargs("full_shard", {"transformer_layer_cls_to_wrap": "GPT2Block"},
                                          model=llama())
    assert len(problems) == 1 and "GPT2Block" in problems[0] and "LlamaDecoderLayer" in problems[0]
    _, problems = fsdp_plugin_kwargs("full_shard", None, model=nn.Linear(2, 2))
    assert len(problems) == 1 and "_no_split_modules" in problems[0] and "min_num_params" in problems[0]
    assert fsdp_plugin_kwargs("full_shard", {"min_num_params": 10}, model=nn.Linear(2, 2))[1] == []


def test_fsdp_problems_are_all_named_at_once():
    problems = problems_of(fsdp="full_shrd offload", gradient_checkpointing=True, fsdp_config={
        "version": 3, "min_num_params": 100, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "activation_checkpointing": True, "state_dict_type": "LOCAL_STATE_DICT", "forward_prefetch": True,
        "reshard_after_forwad": False, "xla": True})
    text = "\n".join(problems)
    for expected in ("'full_shrd'", "did you mean 'full_shard'", "fsdp_config['version']=3",
                     "wrap by layer class or by size, not both", "activation_checkpointing']=True and "
                     "gradient_checkpointing=True", "'LOCAL_STATE_DICT'", "fsdp_config['forward_prefetch']",
                     "'reshard_after_forwad'", "did you mean 'reshard_after_forward'", "fsdp_config['xla']"):
        assert expected in text, expected
    assert len(problems) == 8


def test_fsdp1_only_strategies_and_a_config_without_fsdp():
    (p,) = problems_of(fsdp="hybrid_shard")
    assert p.startswith("fsdp='hybrid_shard'") and "FSDP1" in p and "version']=1" in p
    (p,) = problems_of(fsdp="full_shard shard_grad_op")
    assert "choose one sharding strategy" in p
    (p,) = problems_of(fsdp_config={"version": 2})
    assert p.startswith("fsdp_config=") and "fsdp is not" in p
    (p,) = problems_of(fsdp="full_shard", fsdp_config=str(ROOT / "missing.json"))
    assert "missing.json" in p and "no such file" in p


def test_fsdp_config_from_a_json_file(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                "fsdp_reshard_after_forward": False}))
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=str(path))
    kwargs, problems = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config)
    assert problems == [] and kwargs["reshard_after_forward"] is False
    assert kwargs["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]


@pytest.mark.parametrize("version", [1, 2])
def test_the_fsdp_plugin_is_built_from_the_translation(version, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # the plugin writes it; restored afterwards
    # sync_module_states (FSDP1's default) needs a device to broadcast from, so it is off on this CPU machine
    config = {"version": version, "activation_checkpointing": True, "cpu_offload": True,
              **({"sync_module_states": False} if version == 1 else {})}
    kwargs, problems = fsdp_plugin_kwargs("full_shard", config, model=llama())
    assert problems == []
    plugin = fsdp_plugin(kwargs)
    assert isinstance(plugin, FullyShardedDataParallelPlugin) and plugin.fsdp_version == version
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"] and plugin.activation_checkpointing
    if version == 2:
        assert plugin.reshard_after_forward is True
        assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    else:
        assert plugin.sharding_strategy.name == "FULL_SHARD" or plugin.reshard_after_forward.name == "FULL_SHARD"
        assert plugin.cpu_offload.offload_params


def test_fsdp_where_it_cannot_run_is_refused_never_run_as_ddp(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", use_cpu=True)
    with pytest.raises(ConfigError, match=r"fsdp='full_shard': FSDP needs GPUs .*use_cpu=True.*silently train with "
                                          r"DDP"):
        Trainer(llama(), args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    with pytest.raises(ConfigError, match=r"Accelerate set up DistributedType.NO, not FSDP"):
        check_sharding_active(args, "DistributedType.NO")
    check_sharding_active(args, "DistributedType.FSDP")
    check_sharding_active(TrainingArguments(output_dir=str(tmp_path)), "DistributedType.NO")


# --- DeepSpeed -------------------------------------------------------------------------------------------


def filled(path: str, world_size: int = 4, steps: int | None = 100, hidden: int | None = 32, **kw):
    args = TrainingArguments(output_dir="unused", deepspeed=str(ROOT / "recipes" / path),
                             **{"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": True,
                                "learning_rate": 3e-4, "weight_decay": 0.1, "adam_beta2": 0.95,
                                "max_grad_norm": 0.5, "warmup_ratio": 0.1, **kw})
    return deepspeed_config(args, world_size=world_size, num_training_steps=steps, hidden_size=hidden)


def test_auto_values_are_filled_from_the_arguments_as_transformers_does():
    config, problems = filled("ds_zero3_offload.json")
    assert problems == []
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 4 * 8 * 2 and config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                                             "total_num_steps": 100}
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
    assert "auto" not in json.dumps(config)
    # no warm-up asked for: DeepSpeed rejects 0 warm-up steps, so it gets 1 (as transformers gives it)
    assert filled("ds_zero2.json", warmup_ratio=0.0)[0]["scheduler"]["params"]["warmup_num_steps"] == 1


@pytest.mark.parametrize("path, stage, offload", [("ds_zero2.json", 2, "none"), ("ds_zero3_offload.json", 3, "cpu")])
def test_the_shipped_configs_become_deepspeed_plugins(path, stage, offload):
    """Both configs pass the argument checks as shipped, and Accelerate's DeepSpeedPlugin (which needs no
    deepspeed package to be built) reads the filled config."""
    TrainingArguments(output_dir="unused", deepspeed=str(ROOT / "recipes" / path))
    config, problems = filled(path)
    assert problems == []
    plugin = deepspeed_plugin(config)
    assert plugin.zero_stage == stage and plugin.offload_optimizer_device == offload
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 8
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    assert plugin.hf_ds_config.is_zero3() == (stage == 3)


def test_values_that_disagree_with_the_arguments_name_both():
    problems = problems_of(per_device_train_batch_size=8, max_grad_norm=1.0, learning_rate=1e-4, deepspeed={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    text = "\n".join(problems)
    assert "deepspeed['train_micro_batch_size_per_gpu']=4 disagrees with per_device_train_batch_size=8" in text
    assert "deepspeed['gradient_clipping']=0.5 disagrees with max_grad_norm=1.0" in text
    assert "deepspeed['optimizer.params.lr']=0.001 disagrees with learning_rate=0.0001" in text
    assert len(problems) == 3
    # auto_find_batch_size may halve the micro-batch at run time, so the config need not match it
    TrainingArguments(output_dir="unused", per_device_train_batch_size=8, auto_find_batch_size=True,
                      deepspeed={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})


def test_bad_deepspeed_configs_are_named(tmp_path):
    problems = problems_of(deepspeed={"zero_optimization": {"stage": 4, "offload_param": {"device": "gpu"}},
                                      "fp16": {"enabled": True}, "bf16": {"enabled": True}, "mystery": "auto"})
    text = "\n".join(problems)
    for expected in ("zero_optimization.stage']=4", "offload_param.device']='gpu'", "both true",
                     "deepspeed['mystery']=\"auto\": stoker cannot fill it"):
        assert expected in text, expected
    (p,) = problems_of(deepspeed={"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "needs ZeRO stage 3" in p
    (p,) = problems_of(deepspeed={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert "nvme_path" in p
    (p,) = problems_of(deepspeed={"train_batch_size": 8})
    assert "zero_optimization" in p
    (tmp_path / "list.json").write_text("[]")
    (p,) = problems_of(deepspeed=str(tmp_path / "list.json"))
    assert "JSON object" in p
    (p,) = problems_of(deepspeed=str(tmp_path / "none.json"))
    assert "no such file" in p
    (p,) = problems_of(fsdp="full_shard", deepspeed=str(ROOT / "recipes" / "ds_zero2.json"))
    assert p.startswith("fsdp='full_shard' and deepspeed=") and "choose one" in p


def test_deepspeed_without_its_package_is_refused_never_run_without_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=str(ROOT / "recipes" / "ds_zero2.json"))
    with pytest.raises(ConfigError, match=r"the deepspeed package is not installed \(pip install deepspeed\)"):
        Trainer(llama(), args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])


def test_async_save_is_refused_with_deepspeed_before_any_work():
    """DeepSpeed's engine writes its ZeRO partitions itself: async_save is refused with the deepspeed argument
    (TrainingArguments), and with a DeepSpeed run that Accelerate's configuration set up (the backend)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from stoker.distributed.backends import backend_for

    problems = problems_of(async_save=True, deepspeed={"zero_optimization": {"stage": 2}})
    assert len(problems) == 1
    assert problems[0].startswith("async_save=True and deepspeed={'zero_optimization': {'stage': 2}}: DeepSpeed's "
                                  "engine writes its ZeRO partitions")
    assert "accepted with DeepSpeed: async_save=False" in problems[0]
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ConfigError, match=r"async_save=True and a DeepSpeed run: .* accepted with DeepSpeed: "
                                          r"async_save=False"):
        backend_for(accelerator, SimpleNamespace(async_save=True, fsdp=None))
    assert backend_for(accelerator, SimpleNamespace(async_save=False, fsdp=None)).kind == "a DeepSpeed"
