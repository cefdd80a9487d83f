"""stoker's GPU defaults, decided on the CPU with torch.cuda answering as a GPU would: bf16 autocast on a CUDA GPU
that has bf16 when no precision was asked for, TF32 there when tf32 was not given, a script's explicit choice
(False included) kept, one notice line, and all of it off with gpu_defaults=False; LoRA in the recipes with the
frozen base in bf16 and no dropout unless asked."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from stoker import Trainer, TrainerCallback, TrainingArguments
from stoker.errors import ConfigError
from tests.helpers.gpu_stand_ins import fake_gpu
from tests.helpers.tiny_jobs import llama, rows

H100, T4 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("Tesla T4", (7, 5))


def made(**kw) -> TrainingArguments:
    return TrainingArguments(**{"output_dir": "x", "report_to": "none", **kw})


def test_a_run_that_asked_for_no_precision_trains_in_bf16_with_tf32_on_an_ampere_or_newer_gpu(monkeypatch):
    fake_gpu(monkeypatch, *H100)
    a = made()
    assert a.bf16 is True and a.tf32 is True and a.mixed_precision == "bf16"
    assert a.gpu_default_notice == (
        "precision: bf16 autocast and TF32 matmuls on this GPU, as bf16 / tf32 were not given (transformers would "
        "train in float32 here); gpu_defaults=False, or bf16=False / tf32=False, keeps float32")


@pytest.mark.parametrize("given, bf16, tf32, fp16, notice", [
    ({"bf16": False}, False, True, False, "TF32 matmuls"),  # float32 asked for: kept, TF32 matmuls for it
    ({"bf16": False, "tf32": False}, False, False, False, None),  # full float32, as asked
    ({"tf32": False}, True, False, False, "bf16 autocast"),
    ({"bf16": True}, True, True, False, "TF32 matmuls"),  # bf16 given: nothing to decide about it
    ({"fp16": True}, False, True, True, "TF32 matmuls"),  # fp16 asked for: no bf16 on top of it
    ({"gpu_defaults": False}, False, None, False, None),  # transformers' defaults: float32, torch's TF32 setting
    ({"use_cpu": True}, False, None, False, None),
])
def test_a_scripts_explicit_choice_is_kept(monkeypatch, given, bf16, tf32, fp16, notice):
    fake_gpu(monkeypatch, *H100)
    a = made(**given)
    assert (a.bf16, a.tf32, a.fp16) == (bf16, tf32, fp16)
    if notice is None:
        assert a.gpu_default_notice is None
    else:
        assert a.gpu_default_notice.startswith(f"precision: {notice} on this GPU")


def test_a_gpu_without_bf16_and_tf32_gets_neither_and_a_cpu_nothing(monkeypatch):
    a = made()  # this machine: no GPU
    assert (a.bf16, a.tf32, a.gpu_default_notice) == (False, None, None)
    fake_gpu(monkeypatch, *T4)  # compute capability 7.5: bf16 only emulated, no TF32
    a = made()
    assert (a.bf16, a.tf32, a.gpu_default_notice) == (False, None, None)


# --- a precision the launcher or a DeepSpeed config sets ------------------------------------------------------


@pytest.mark.parametrize("launched, bf16, fp16", [("fp16", False, True), ("no", False, False), ("bf16", True, False)])
def test_accelerate_launchs_mixed_precision_wins_over_the_gpu_default(monkeypatch, launched, bf16, fp16):
    """`accelerate launch --mixed_precision X` (or its config file) reaches the script as ACCELERATE_MIXED_PRECISION;
    where the script gives no bf16 / fp16 it is the run's precision, as in transformers, and the notice says where
    it came from. TF32 stays stoker's GPU default (no launcher setting speaks of it)."""
    fake_gpu(monkeypatch, *H100)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    a = made()
    assert (a.bf16, a.fp16, a.tf32, a.mixed_precision) == (bf16, fp16, True, launched)
    assert a.gpu_default_notice.startswith("precision: ")
    assert f"as accelerate launch's mixed_precision (ACCELERATE_MIXED_PRECISION={launched}) sets it" in (
        a.gpu_default_notice)
    assert a.gpu_default_notice.endswith("with TF32 matmuls on this GPU as tf32 was not given")
    assert made(bf16=True).mixed_precision == "bf16"  # the script's own choice is kept over the launcher's


def test_the_launchers_precision_is_what_transformers_takes_from_it(monkeypatch):
    from transformers import TrainingArguments as HFArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # this CPU: bf16 autocast runs here too
    assert made().mixed_precision == HFArguments(output_dir="x", report_to="none").mixed_precision == "bf16"


def _deepspeed_file(tmp_path, precision: str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, precision: {"enabled": True}}))
    return str(path)


def test_a_deepspeed_config_of_accelerate_launch_that_enables_fp16_is_not_given_bf16(monkeypatch, tmp_path):
    """Under accelerate launch with a DeepSpeed config file that enables fp16, bf16 on top would make Accelerate's
    DeepSpeedPlugin raise ("cannot be set to bf16 when fp16 is set in the DeepSpeed config file")."""
    from accelerate.utils import DeepSpeedPlugin

    fake_gpu(monkeypatch, *H100)
    path = _deepspeed_file(tmp_path, "fp16")
    for name, value in (("ACCELERATE_USE_DEEPSPEED", "true"), ("ACCELERATE_DEEPSPEED_CONFIG_FILE", path),
                        ("ACCELERATE_MIXED_PRECISION", "no")):
        monkeypatch.setenv(name, value)
    a = made()
    assert (a.bf16, a.fp16, a.mixed_precision) == (False, True, "fp16")
    assert f"accelerate launch's DeepSpeed config {path}" in a.gpu_default_notice
    DeepSpeedPlugin(hf_ds_config=path).set_mixed_precision(a.mixed_precision)  # what Accelerate does with it


def test_a_deepspeed_config_given_to_the_script_sets_the_precision(monkeypatch, tmp_path):
    fake_gpu(monkeypatch, *H100)
    a = made(deepspeed=_deepspeed_file(tmp_path, "bf16"))
    assert (a.bf16, a.fp16) == (True, False)
    assert "as the DeepSpeed config (deepspeed), whose bf16 section is enabled, sets it" in a.gpu_default_notice
    assert made(deepspeed={"zero_optimization": {"stage": 2}}).bf16 is False  # none enabled: the config decides


def test_a_launcher_precision_stoker_does_not_take_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigError) as e:
        made()
    assert "ACCELERATE_MIXED_PRECISION=fp8" in str(e.value) and "'bf16'" in str(e.value) and "fp8=" in str(e.value)


def test_not_given_is_none_and_false_is_an_explicit_choice():
    import dataclasses

    declared = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    assert declared["bf16"] is None and declared["tf32"] is None and declared["gpu_defaults"] is True


def test_the_trainer_logs_the_notice_once(monkeypatch, tmp_path, caplog):
    fake_gpu(monkeypatch, *H100)
    a = made(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True, save_strategy="no")
    monkeypatch.undo()  # the run itself on this CPU (bf16 autocast runs there too)
    with caplog.at_level(logging.INFO, logger="stoker"):
        Trainer(llama(), a, train_dataset=rows(4))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: ")]
    assert lines == [a.gpu_default_notice]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stoker"):
        Trainer(llama(), made(output_dir=str(tmp_path), max_steps=1), train_dataset=rows(4))
    assert not [r for r in caplog.records if r.getMessage().startswith("precision: ")]


# --- LoRA in the recipes --------------------------------------------------------------------------------------


def test_recipe_lora_has_no_dropout_unless_asked_and_its_frozen_base_in_bf16():
    from peft import get_peft_model

    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import lora_base_in_bf16, peft_config_for

    m = ModelArguments(use_peft=True)
    assert m.lora_dropout == 0.0 and m.lora_base_bf16 is True
    model = llama()
    config = peft_config_for(m, model)
    assert config.lora_dropout == 0.0
    assert lora_base_in_bf16(m, True, model, config)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their precision
    peft = get_peft_model(model, config)
    trained = {p.dtype for p in peft.parameters() if p.requires_grad}
    assert trained == {torch.float32}  # the adapters train in float32
    # float32 runs, and lora_base_bf16=False, keep the base as loaded
    for m, bf16 in ((ModelArguments(use_peft=True), False), (ModelArguments(use_peft=True, lora_base_bf16=False),
                                                              True)):
        model = llama()
        assert not lora_base_in_bf16(m, bf16, model, peft_config_for(m, model))
        assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_classifiers_head_that_lora_trains_stays_float32():
    from transformers import BertConfig, BertForSequenceClassification

    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import lora_base_in_bf16, peft_config_for

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=3))
    m = ModelArguments(use_peft=True, lora_target_modules=["query", "value"])
    config = peft_config_for(m, model)
    assert lora_base_in_bf16(m, True, model, config)
    assert model.classifier.weight.dtype == torch.float32
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16


# --- no float32 copy of the logits ----------------------------------------------------------------------------


class Logits(TrainerCallback):
    """The dtype of the logits the prepared model returns in a training forward, and the loss of each step."""

    def __init__(self):
        self.dtypes, self.losses = [], []

    def on_step_end(self, args, state, control, **kw):
        trainer = self.trainer
        batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[1, 2, 3, 4]])}
        with torch.no_grad():
            self.dtypes.append(trainer.model_wrapped(**batch).logits.dtype)

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs:
            self.losses.append(logs["loss"])


def logits_of_a_run(tmp_path, trainer_class=Trainer, **kw):
    seen = Logits()
    a = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", disable_tqdm=True, save_strategy="no",
                          logging_steps=1, max_steps=2, per_device_train_batch_size=2, bf16=True, use_cpu=True)
    trainer = trainer_class(llama(), a, train_dataset=rows(4), callbacks=[seen], **kw)
    seen.trainer = trainer
    trainer.train()
    return seen


def test_training_forwards_keep_the_autocast_logits_where_stoker_computes_the_loss(tmp_path):
    """Accelerate's autocast wrapper casts every output to float32: a float32 copy of the full logits per forward
    (2.1 GB at 8 x 2048 x 32k). Where stoker computes the loss the logits stay bf16, and the losses do not change
    (transformers' loss upcasts inside the forward); a compute_loss_func or a subclass's compute_loss, which read
    the logits themselves, get them in float32 as from transformers.Trainer."""
    from stoker.loss import loss_or_none

    ours = logits_of_a_run(tmp_path)
    assert ours.dtypes == [torch.bfloat16, torch.bfloat16]

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    kept = logits_of_a_run(tmp_path, OwnLoss)
    assert kept.dtypes == [torch.float32, torch.float32]
    assert kept.losses == ours.losses  # bit for bit: only the outputs' copy differs

    def function(outputs, labels, num_items_in_batch=None):
        assert outputs.logits.dtype == torch.float32
        return loss_or_none(outputs) if getattr(outputs, "loss", None) is not None else outputs.logits.sum() * 0

    assert logits_of_a_run(tmp_path, compute_loss_func=function).dtypes == [torch.float32, torch.float32]


def test_without_fp32_outputs_finds_nothing_to_drop_in_float32_or_twice():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from stoker.distributed.backends import without_fp32_outputs

    AcceleratorState._reset_state()  # a process-wide singleton: each Accelerator here has its own precision
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare_model(llama())
    assert without_fp32_outputs(model) and not without_fp32_outputs(model)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
    AcceleratorState._reset_state()
    assert not without_fp32_outputs(Accelerator(cpu=True).prepare_model(llama()))
    AcceleratorState._reset_state()
