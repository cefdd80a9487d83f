"""How much of transformers' TrainingArguments and Trainer stoker has, counted against the installed
transformers. Run as a script for the counts and the list of refusals:

    PYTHONPATH=. python tests/test_hf_surface.py

As tests: every field and every public method is there, each refused value is refused with one error that
names the field, and the list of refusals below is complete for the values tried.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

# Values of transformers fields that ask for what stoker cannot do here: (field, value, reason).
REFUSED_VALUES = [
    ("push_to_hub", True, "stoker never uses the network; upload output_dir yourself"),
    ("optim_target_modules", ["attn"], "for GaLore / APOLLO optimizers, which stoker does not build"),
    ("parallelism_config", {"tp_size": 2}, "tensor / context parallelism are not run; use fsdp or deepspeed"),
    ("debug", "tpu_metrics_debug", "needs a TPU"),
    ("train_sampling_strategy", "batch_rebalance", "not offered"),
    ("report_to", "wandb", "only tensorboard (and metrics.jsonl) are written; other integrations are not"),
    ("optim", "galore_adamw", "optimizers outside stoker.arguments.OPTIMIZER_NAMES are not built"),
    ("lr_scheduler_type", "greedy", "needs a metric in the scheduler step"),
    ("fp16", True, "on a machine without CUDA (transformers would silently train in float32)"),
]
# refused only where the package is missing
REFUSED_WITHOUT_PACKAGE = [("use_liger_kernel", True, "liger_kernel", "needs the liger-kernel package")]
# Public transformers.Trainer methods that raise by design: (name, reason).
REFUSED_METHODS = [
    ("push_to_hub", "stoker never uses the network"),
    ("init_hf_repo", "stoker never uses the network"),
]


def counts() -> dict:
    import transformers

    import stoker

    hf_fields = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    ours = {f.name for f in dataclasses.fields(stoker.TrainingArguments)}
    hf_methods = sorted(m for m in dir(transformers.Trainer) if not m.startswith("_")
                        and callable(getattr(transformers.Trainer, m)))
    return {
        "transformers": transformers.__version__,
        "fields": len(hf_fields),
        "fields_present": sum(name in ours for name in hf_fields),
        "fields_missing": [name for name in hf_fields if name not in ours],
        "methods": len(hf_methods),
        "methods_present": sum(callable(getattr(stoker.Trainer, m, None)) for m in hf_methods),
        "methods_missing": [m for m in hf_methods if not callable(getattr(stoker.Trainer, m, None))],
        "signature_differences": {m: d for m in hf_methods if (d := _signature_difference(m))},
    }


def _signature_difference(name: str) -> str | None:
    """Parameters of transformers' method that stoker's lacks (a call by keyword would fail), or None."""
    import transformers

    import stoker

    ours = getattr(stoker.Trainer, name, None)
    if ours is None:
        return None
    theirs = inspect.signature(getattr(transformers.Trainer, name)).parameters
    mine = inspect.signature(ours).parameters
    if any(p.kind is p.VAR_KEYWORD for p in mine.values()):
        return None
    lacking = [p for p in theirs if p not in mine and theirs[p].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                           inspect.Parameter.VAR_POSITIONAL)]
    return f"lacks {lacking}" if lacking else None


def test_every_transformers_field_and_public_method_is_there():
    c = counts()
    assert c["fields_missing"] == [] and c["fields_present"] == c["fields"]
    assert c["methods_missing"] == [] and c["methods_present"] == c["methods"]
    assert c["signature_differences"] == {}


@pytest.mark.parametrize("name,value,reason", REFUSED_VALUES, ids=[r[0] for r in REFUSED_VALUES])
def test_refused_values_are_one_error_naming_the_field(name, value, reason):
    import torch

    from stoker import ConfigError, TrainingArguments

    if name == "fp16" and torch.cuda.is_available():
        return  # refused on CPU-only machines only; the GPU case trains in float16
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**{name: value})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"{name}=")


def test_refused_without_their_package():
    import importlib.util

    from stoker import ConfigError, TrainingArguments

    for name, value, package, _ in REFUSED_WITHOUT_PACKAGE:
        if importlib.util.find_spec(package) is None:
            with pytest.raises(ConfigError, match=f"{name}=True: needs the liger-kernel package"):
                TrainingArguments(**{name: value})
        else:
            assert getattr(TrainingArguments(**{name: value}), name) == value


def main() -> None:
    c = counts()
    print(f"transformers {c['transformers']}")
    print(f"TrainingArguments fields: {c['fields_present']} of {c['fields']}"
          + (f"; missing {c['fields_missing']}" if c["fields_missing"] else ""))
    print(f"public Trainer methods: {c['methods_present']} of {c['methods']}"
          + (f"; missing {c['methods_missing']}" if c["methods_missing"] else ""))
    for name, why in c["signature_differences"].items():
        print(f"  {name}: {why}")
    print("refused values:")
    for name, value, reason in REFUSED_VALUES:
        print(f"  {name}={value!r}: {reason}")
    for name, value, package, reason in REFUSED_WITHOUT_PACKAGE:
        print(f"  {name}={value!r}: {reason} (when {package} is not installed)")
    print("refused methods:")
    for name, reason in REFUSED_METHODS:
        print(f"  {name}(): {reason}")
    print("  hyperparameter_search(): needs Optuna (one clear ImportError without it)")


if __name__ == "__main__":
    main()


def test_set_initial_training_values_as_transformers(tiny_llama, make_args):
    import transformers

    from stoker import Trainer

    data = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 10
    for kw in ({"num_train_epochs": 2.5, "gradient_accumulation_steps": 3}, {"max_steps": 7},
               {"max_steps": 2, "gradient_accumulation_steps": 2}):
        t = Trainer(tiny_llama(), make_args(per_device_train_batch_size=2, **kw), train_dataset=data)
        loader = t.get_train_dataloader()
        assert t.set_initial_training_values(t.args, loader) == transformers.Trainer.set_initial_training_values(
            t, t.args, loader), kw
