"""The optimizers transformers.Trainer builds beyond torch's own, run through transformers.Trainer and stoker.Trainer
on the same tiny job: each family's losses (and evaluation losses, where the loop must switch the optimizer's mode
around evaluation) equal within 1e-4 relative. Plus what each needs of the loop: 8-bit bitsandbytes state kept in
32 bits for embeddings, accumulation exact where the optimizer allows it and refused where it updates inside the
backward, a schedule-free run resumed from a checkpoint written after an evaluation, the per-parameter schedules of
layerwise GaLore / APOLLO, and the CUDA-only names refused on a CPU before any work.

The job is families.py's plain causal module (an embedding and two linear layers): torchao's optimizers compile
their step per tensor shape, and few shapes keep that compilation short.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import stoker
from stoker.data import PaddingCollator
from stoker.errors import ConfigError, NonFiniteError
from tests.parity.families import FAMILIES, rows

FRAMEWORKS = {"hf": transformers, "stoker": stoker}
FAMILY = "shifting_module"
REL = 1e-4


def job(framework: str, out, optim: str, model: nn.Module | None = None, resume: str | None = None, **overrides):
    """Train FAMILY's model (or `model`) for 3 steps of 4 rows with `optim` (resumed from `resume`); returns the
    Trainer."""
    values = dict(output_dir=str(out), report_to="none", disable_tqdm=True, use_cpu=True, optim=optim,
                  learning_rate=1e-2, max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                  save_strategy="no", seed=7)
    values.update(overrides)
    module = FRAMEWORKS[framework]
    trainer = module.Trainer(model if model is not None else FAMILIES[FAMILY](0), module.TrainingArguments(**values),
                             train_dataset=rows(FAMILY, 12, 1), eval_dataset=rows(FAMILY, 4, 2),
                             data_collator=PaddingCollator())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer, key: str = "loss") -> list[float]:
    return [r[key] for r in trainer.state.log_history if key in r]


def assert_same_run(tmp_path, optim: str, **overrides) -> tuple:
    """The job through both frameworks: the same training losses and evaluation losses, within REL."""
    hf, ours = (job(f, tmp_path / f, optim, **overrides) for f in FRAMEWORKS)
    assert len(losses(ours)) == 3
    assert not ours._backend.skips_on_device(ours.optimizer)  # the step's check is read before the next step
    for key in ("loss", "eval_loss"):
        assert losses(ours, key) == pytest.approx(losses(hf, key), rel=REL), key
    return hf, ours


def test_torchao_low_bit_adamw(tmp_path, monkeypatch):
    """adamw_torch_8bit trains as in transformers; adamw_torch_4bit builds the same class and keyword arguments
    (its training is the same code with 4-bit blocks). torchao compiles its step once per tensor shape (seconds
    each on a CPU): here both frameworks run it eagerly, which is the same arithmetic."""
    import torchao.optim.adam

    monkeypatch.setattr(torchao.optim.adam.torch, "compile", lambda function, **options: function)
    _, ours = assert_same_run(tmp_path, "adamw_torch_8bit")
    assert type(ours.optimizer.optimizer).__name__ == "AdamW8bit"
    args = dict(optim="adamw_torch_4bit", optim_args="block_size=128", learning_rate=3e-4, use_cpu=True)
    cls, kwargs = stoker.Trainer.get_optimizer_cls_and_kwargs(stoker.TrainingArguments(**args, save_only_model=True))
    assert (cls, kwargs) == transformers.Trainer.get_optimizer_cls_and_kwargs(transformers.TrainingArguments(**args))
    assert cls.__name__ == "AdamW4bit" and kwargs["block_size"] == "128"  # transformers' optim_args stay strings


@pytest.mark.parametrize("optim", ["paged_ademamix_8bit", "rmsprop_bnb"])
def test_bitsandbytes_ademamix_and_rmsprop(tmp_path, optim):
    # (transformers hands RMSprop its optim_args as strings, which bitsandbytes refuses: none for it here)
    _, ours = assert_same_run(tmp_path, optim, optim_args="alpha=4.0,beta3=0.999" if "ademamix" in optim else None)
    assert type(ours.optimizer.optimizer).__name__ == ("AdEMAMix" if "ademamix" in optim else "RMSprop")


def test_bitsandbytes_8bit_state_keeps_embeddings_in_32_bits(tmp_path):
    """As transformers registers every nn.Embedding with bitsandbytes for 32-bit state: the embedding's state is
    float32, a linear layer's (above bitsandbytes' 4096-element threshold) 8-bit; the runs equal."""
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = nn.Embedding(128, 64), nn.Linear(64, 128)

        def forward(self, input_ids, labels=None, attention_mask=None):
            logits = self.head(self.embed(input_ids))
            return {"loss": nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1)),
                    "logits": logits}

    states = {}
    for framework in FRAMEWORKS:
        model = Wide()
        trainer = job(framework, tmp_path / framework, "adamw_8bit", model=model, max_steps=2)
        state = trainer.optimizer.optimizer.state
        states[framework] = (state[model.embed.weight]["state1"].dtype, state[model.head.weight]["state1"].dtype,
                             losses(trainer))
    assert states["stoker"][:2] == states["hf"][:2] == (torch.float32, torch.uint8)
    assert states["stoker"][2] == pytest.approx(states["hf"][2], rel=REL)


@pytest.mark.parametrize("optim", ["galore_adafactor", "galore_adamw_layerwise"])
def test_galore(tmp_path, optim):
    # a constant schedule: transformers' layerwise schedule never reaches the parameters' optimizers (below)
    assert_same_run(tmp_path, optim, optim_target_modules=["mix"], optim_args="rank=4,update_proj_gap=2",
                    lr_scheduler_type="constant")


@pytest.mark.parametrize("optim", ["apollo_adamw"])
def test_apollo(tmp_path, optim):
    assert_same_run(tmp_path, optim, optim_target_modules="all-linear", optim_args="rank=4,update_proj_gap=2",
                    lr_scheduler_type="constant")


def test_layerwise_schedules_move_every_parameters_rate(tmp_path):
    """Layerwise: each parameter's optimizer follows the schedule, stepped in its hook, and the logged rate is
    theirs (transformers builds its schedule on Accelerate's wrapper of the placeholder: its parameters' rates stay
    at learning_rate, while it logs a decaying one)."""
    trainer = job("stoker", tmp_path, "galore_adamw_layerwise", optim_target_modules=["mix"],
                  optim_args="rank=4,update_proj_gap=2")
    rates = [g["lr"] for o in trainer.optimizer.optimizer.optimizer_dict.values() for g in o.param_groups]
    assert len(rates) == 5 and rates == [0.0] * 5  # linear decay to 0 after the 3rd of 3 steps
    assert losses(trainer, "learning_rate") == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 / 3])


def test_lomo_updates_inside_the_backward(tmp_path):
    _, ours = assert_same_run(tmp_path, "lomo")
    assert type(ours.optimizer.optimizer).__name__ == "Lomo"


class NonFiniteFromThirdCall(nn.Module):
    """FAMILY's model whose loss and logits are NaN from its third forward on (within the 3 steps, whether or not
    the loop probed the model first)."""

    def __init__(self):
        super().__init__()
        self.inner, self.calls = FAMILIES[FAMILY](0), 0

    def forward(self, **batch):
        out, self.calls = self.inner(**batch), self.calls + 1
        return {key: value * float("nan") for key, value in out.items()} if self.calls >= 3 else out


@pytest.mark.parametrize("optim", ["lomo", "apollo_adamw_layerwise"])
def test_a_non_finite_step_stops_an_update_made_inside_the_backward(tmp_path, optim):
    """nonfinite_policy='skip' cannot skip what the backward has applied: the run stops, naming why."""
    low_rank = {"optim_target_modules": ["inner.mix"], "optim_args": "rank=4"} if "apollo" in optim else {}
    with pytest.raises(NonFiniteError, match=rf"optim='{optim}' has applied the update inside the backward"):
        job("stoker", tmp_path, optim, model=NonFiniteFromThirdCall(), **low_rank)


def test_grokadamw(tmp_path):
    assert_same_run(tmp_path, "grokadamw", optim_args="lamb=1.5")


@pytest.mark.parametrize("optim", ["schedule_free_radam", "schedule_free_sgd"])
def test_schedule_free_switches_modes_around_evaluation(tmp_path, optim):
    """Evaluated after every step, in the optimizer's eval mode (its averaged parameters), then trained on in train
    mode: the evaluation losses are transformers'."""
    _, ours = assert_same_run(tmp_path, optim, eval_strategy="steps", eval_steps=1, warmup_steps=1)
    assert len(losses(ours, "eval_loss")) == 3


@pytest.mark.parametrize("optim,schedule", [("schedule_free_adamw", {}), (
    "adamw_torch", {"lr_scheduler_type": "greedy", "lr_scheduler_kwargs": {"patience": 1, "factor": 0.5,
                                                                           "min_lr": 1e-4, "smooth": True}})])
def test_a_run_resumed_after_evaluation_continues_exactly(tmp_path, optim, schedule):
    """schedule-free: a checkpoint written after an evaluation holds the parameters and the optimizer state in eval
    mode, as transformers writes them; greedy: the schedule's state (its best metric, counters and averaged
    metrics). The resumed run continues exactly, rates included."""
    settings = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=2, **schedule)
    whole = job("stoker", tmp_path / "whole", optim, **settings)
    resumed = job("stoker", tmp_path / "resumed", optim, resume=str(tmp_path / "whole" / "checkpoint-2"), **settings)
    assert len(losses(whole)) == 4
    assert losses(resumed, "learning_rate") == losses(whole, "learning_rate")
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-6)
    assert losses(resumed, "eval_loss") == pytest.approx(losses(whole, "eval_loss"), rel=1e-6)
    torch.testing.assert_close(resumed.model.state_dict(), whole.model.state_dict(), rtol=1e-6, atol=1e-7)


def test_greedy_schedule_steps_on_the_evaluation_loss(tmp_path):
    hf, ours = assert_same_run(tmp_path, "adamw_torch", lr_scheduler_type="greedy",
                               lr_scheduler_kwargs={"patience": 1, "factor": 0.5, "min_lr": 1e-4},
                               eval_strategy="steps", eval_steps=1)
    assert losses(ours, "learning_rate") == pytest.approx(losses(hf, "learning_rate"), rel=REL)
    assert type(ours.lr_scheduler).__name__ == "GreedyLR"


def test_accumulation_is_exact_where_the_optimizer_allows_it(tmp_path):
    """4 rows x 2 micro-batches updates as 8 rows x 1 with an optimizer built by transformers' builder."""
    def run(batch, accumulation):
        trainer = job("stoker", tmp_path / f"{batch}x{accumulation}", "ademamix", per_device_train_batch_size=batch,
                      gradient_accumulation_steps=accumulation, max_steps=1)
        return trainer.model.state_dict()

    split, whole = run(4, 2), run(8, 1)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optim", ["lomo", "galore_adamw_layerwise", "apollo_adamw_layerwise"])
def test_accumulation_refused_where_the_update_is_inside_the_backward(optim):
    with pytest.raises(ConfigError, match=rf"optim='{optim}' with gradient_accumulation_steps=2: it updates the "
                                          "parameters inside each backward"):
        stoker.TrainingArguments(optim=optim, gradient_accumulation_steps=2, save_strategy="no",
                                 optim_target_modules=None if optim == "lomo" else ["mix"])


@pytest.mark.parametrize("optim", ["galore_adamw_8bit", "galore_adamw_8bit_layerwise", "adalomo"])
def test_cuda_only_optimizers_are_refused_on_a_cpu(optim):
    """transformers fails in the first step ("Torch not compiled with CUDA enabled"); stoker before any work."""
    with pytest.raises(ConfigError, match=rf"optim='{optim}': needs a CUDA GPU"):
        stoker.TrainingArguments(optim=optim, use_cpu=True, optim_target_modules=["mix"], save_strategy="no")


@pytest.mark.parametrize("optim", ["galore_adamw", "apollo_adamw_layerwise", "adamw_torch_8bit", "grokadamw"])
def test_optimizers_whose_state_no_checkpoint_can_hold_refuse_full_checkpoints(optim):
    targets = {"optim_target_modules": ["mix"]} if optim.startswith(("galore", "apollo")) else {}
    with pytest.raises(ConfigError, match=rf"optim='{optim}' with save_strategy='steps': .* cannot hold; set "
                                          "save_only_model=True"):
        stoker.TrainingArguments(optim=optim, **targets)
    stoker.TrainingArguments(optim=optim, save_only_model=True, **targets)
