"""How much of transformers' TrainingArguments and Trainer stoker has, counted against the installed
transformers. Run as a script for the counts and the list of refusals:

    PYTHONPATH=. python tests/integration/test_hf_surface.py

As tests: every field and every public method is there, each refused value is refused with one error that
names the field, and the list of refusals below is complete for the values tried.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

# Values of transformers fields that ask for what stoker cannot do here: (field, value, reason).
REFUSED_VALUES = [
    ("push_to_hub", True, "stoker never uses the network; upload output_dir yourself"),
    ("optim_target_modules", ["attn"], "read by GaLore / APOLLO optimizers only, not by the default AdamW"),
    ("parallelism_config", {"cp_size": 2}, "context parallelism: torch's ring attention is CUDA-only, and the loop "
                                           "does not enter torch's context_parallel yet"),
    ("debug", "tpu_metrics_debug", "needs a TPU"),
    ("train_sampling_strategy", "batch_rebalance", "not offered"),
    ("optim", "galore_adafactor_layerwise", "transformers builds it with Adafactor's relative_step and a learning "
                                           "rate together, which Adafactor refuses"),
    ("lr_scheduler_type", "greedy", "steps on an evaluation metric: needs eval_strategy (as in transformers)"),
    ("fp16", True, "on a machine without CUDA (transformers would silently train in float32)"),
]
# refused only where the package is missing
REFUSED_WITHOUT_PACKAGE = [("use_liger_kernel", True, "liger_kernel", "train() needs the liger-kernel package")]
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
    # TrainingArguments' properties and helpers (should_log, main_process_first, set_training, ...)
    # (is_torch_greater_or_equal_than_2_8 is a version flag transformers keeps on the class, not an API)
    hf_helpers = sorted(m for m in dir(transformers.TrainingArguments) if not m.startswith("_")
                        and m not in hf_fields and not m.startswith("is_torch_"))
    return {
        "transformers": transformers.__version__,
        "fields": len(hf_fields),
        "fields_present": sum(name in ours for name in hf_fields),
        "fields_missing": [name for name in hf_fields if name not in ours],
        "methods": len(hf_methods),
        "methods_present": sum(callable(getattr(stoker.Trainer, m, None)) for m in hf_methods),
        "methods_missing": [m for m in hf_methods if not callable(getattr(stoker.Trainer, m, None))],
        "signature_differences": {m: d for m in hf_methods if (d := _signature_difference(m))},
        "argument_helpers": len(hf_helpers),
        "argument_helpers_present": sum(hasattr(stoker.TrainingArguments, m) for m in hf_helpers),
        "argument_helpers_missing": [m for m in hf_helpers if not hasattr(stoker.TrainingArguments, m)],
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
    assert c["argument_helpers_missing"] == []


def test_trainer_parameters_come_in_transformers_order():
    import transformers

    import stoker

    theirs = list(inspect.signature(transformers.Trainer.__init__).parameters)
    ours = list(inspect.signature(stoker.Trainer.__init__).parameters)
    assert ours[:len(theirs)] == theirs and ours[len(theirs):] == ["peft_config"]


def test_grouped_setters_set_what_transformers_sets(tmp_path):
    import transformers

    from stoker import TrainingArguments
    from stoker.tracking import resolve_report_to

    calls = [("set_training", dict(learning_rate=1e-3, batch_size=4, num_epochs=2, seed=3,
                                   gradient_checkpointing=True)),
             ("set_evaluate", dict(strategy="steps", steps=7, batch_size=2, delay=2)),
             ("set_testing", dict(batch_size=3, loss_only=True)),
             ("set_save", dict(strategy="steps", steps=9, total_limit=2)),
             ("set_logging", dict(strategy="steps", steps=3, level="info", first_step=True)),
             ("set_optimizer", dict(name="adamw_torch", learning_rate=2e-4, beta1=0.8, args="foreach=False")),
             ("set_lr_scheduler", dict(name="cosine", max_steps=40, warmup_steps=0.1)),
             ("set_dataloader", dict(train_batch_size=5, eval_batch_size=6, num_workers=2, in_order=False,
                                     sampler_seed=11))]
    hf = transformers.TrainingArguments(output_dir=str(tmp_path))
    ours = TrainingArguments(output_dir=str(tmp_path))
    for name, kwargs in calls:
        before = dict(vars(hf))
        assert getattr(ours, name)(**kwargs) is ours
        getattr(hf, name)(**kwargs)
        changed = [k for k, v in vars(hf).items() if before.get(k) != v and k in vars(ours)]
        assert changed, name
        for key in changed:
            theirs = getattr(hf, key)
            if key == "report_to":  # transformers' setter leaves the name as given; stoker resolves it
                theirs = resolve_report_to(theirs)
            assert getattr(ours, key) == theirs, (name, key)
    assert ours.get_warmup_steps(40) == hf.get_warmup_steps(40) == 4
    assert ours.ddp_timeout_delta == hf.ddp_timeout_delta and ours.default_optim == hf.default_optim
    assert ours.place_model_on_device == hf.place_model_on_device


@pytest.mark.parametrize("name,value,reason", REFUSED_VALUES, ids=[r[0] for r in REFUSED_VALUES])
def test_refused_values_are_one_error_naming_the_field(name, value, reason):
    from stoker import ConfigError, TrainingArguments

    if name == "fp16" and torch.cuda.is_available():
        return  # refused on CPU-only machines only; the GPU case trains in float16
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**{name: value})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"{name}=")


def test_refused_without_their_package():
    import importlib.util

    from stoker import ConfigError, Trainer, TrainingArguments
    from tests.helpers.tiny_jobs import Regressor, regression_rows

    for name, value, package, _ in REFUSED_WITHOUT_PACKAGE:
        args = TrainingArguments(**{name: value}, report_to="none")
        assert getattr(args, name) == value  # as transformers: only training needs the package
        if importlib.util.find_spec(package) is None:
            trainer = Trainer(Regressor(), args, train_dataset=regression_rows(4))
            with pytest.raises(ConfigError, match=f"{name}=True: training needs the liger-kernel package"):
                trainer.train()
            assert trainer.state.global_step == 0


def main() -> None:
    c = counts()
    print(f"transformers {c['transformers']}")
    print(f"TrainingArguments fields: {c['fields_present']} of {c['fields']}"
          + (f"; missing {c['fields_missing']}" if c["fields_missing"] else ""))
    print(f"public Trainer methods: {c['methods_present']} of {c['methods']}"
          + (f"; missing {c['methods_missing']}" if c["methods_missing"] else ""))
    print(f"TrainingArguments properties and helpers: {c['argument_helpers_present']} of {c['argument_helpers']}"
          + (f"; missing {c['argument_helpers_missing']}" if c["argument_helpers_missing"] else ""))
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
    print("  hyperparameter_search(): Optuna only (backend='ray' / 'wandb' are refused)")


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

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    t = Trainer(tiny_llama(), make_args(per_device_train_batch_size=2, max_steps=3), train_dataset=Stream())
    loader = t.get_train_dataloader()  # no length: max_steps passes of as many batches as it needs
    assert t.set_initial_training_values(t.args, loader) == transformers.Trainer.set_initial_training_values(
        t, t.args, loader)
    no_steps = dataclasses.replace(t.args, max_steps=-1)
    with pytest.raises(ValueError, match="max_steps must be > 0 for a dataloader without a length"):
        t.set_initial_training_values(no_steps, loader)
    with pytest.raises(ValueError):  # as transformers refuses it
        transformers.Trainer.set_initial_training_values(t, no_steps, loader)
