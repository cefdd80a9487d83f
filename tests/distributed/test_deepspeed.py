"""DeepSpeed through Accelerate with real processes: one torchrun launch of 2 ranks (CPU, gloo, float32) runs
the ZeRO scenarios of tests/helpers/dist_worker.py, which the tests compare with single-process and DDP runs of the
same settings. DeepSpeed runs on the CPU with its CPU accelerator and a gloo process group."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from stoker import Trainer, TrainingArguments
from stoker import checkpoint_format as ckpt
from stoker.arguments import ConfigError
from tests.helpers import dist_worker as w
from tests.helpers.launching import check, launch, ranks
from tests.helpers.tiny_jobs import assert_params_close, llama, params_of

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="the deepspeed extra is not installed (pip install -e '.[dev]' installs it)")]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    check(launch(out, "zero2", "zero3", "lora_zero3", "zero_nonfinite", "zero1_config_sections"))
    return out


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_zero2_updates_like_one_process_with_exact_accumulation_evaluates_and_resumes_exactly(zero_runs,
                                                                                              one_process):
    """2 processes x batch 2 x accumulation 2 under ZeRO-2 give 1 process x batch 8's update (the loss is
    normalised by the global target tokens; DeepSpeed steps only at the window's end and does not divide by
    the accumulation again); eval_loss is the single-process one; the run resumed from checkpoint-2 ends bit
    for bit where the uninterrupted one ended. Every rank writes its own partition of the optimizer state."""
    r0, r1 = ranks(zero_runs, "zero2")
    assert r0["distributed_type"] == "DistributedType.DEEPSPEED" and r0["global_step"] == 3
    final = load_file(str(zero_runs / "zero2" / "final.safetensors"))
    assert_params_close(final, params_of(one_process["batch8"]), atol=1e-6)
    assert_same_bits(final, load_file(str(zero_runs / "zero2" / "resumed.safetensors")))
    assert r0["resumed_losses"] == r0["losses"] == r1["losses"]
    assert "train() was called before on this Trainer, and DistributedType.DEEPSPEED wrapped the model in place" in (
        r0["second_train"])

    model = llama()
    model.load_state_dict(final)
    single = Trainer(model, w.training_args(str(zero_runs / "single_eval")), eval_dataset=w.EVAL7).evaluate()
    assert r0["eval"]["eval_loss"] == pytest.approx(single["eval_loss"], abs=1e-6)

    folder = zero_runs / "zero2" / "out" / "checkpoint-2"
    assert ckpt.verify(str(folder)) is None
    assert not (folder / "optimizer.json").exists()
    numel = sum(t.numel() for t in final.values())
    for rank in (0, 1):
        with safe_open(str(folder / f"optimizer_{rank}.safetensors"), "pt") as f:
            partitions = [k for k in f.keys() if k.startswith(".single_partition_of_fp32_groups")]
            held = sum(f.get_slice(k).get_shape()[0] for k in partitions)
        assert held == pytest.approx(numel / 2, abs=64)  # this rank's half (DeepSpeed pads partitions)


def test_zero3_partitions_parameters_updates_like_one_process_saves_the_full_model_and_resumes_exactly(
        zero_runs, one_process):
    """ZeRO-3 with every parameter partitioned: each rank holds half; 2 x batch 2 x accumulation 2 updates
    like 1 x batch 8; save_model writes the full model (gathered), which transformers loads; resume is exact;
    checkpoint-2's weights load alone into the partitioned model (as load_best_model_at_end does)."""
    from transformers import AutoModelForCausalLM

    r0, r1 = ranks(zero_runs, "zero3")
    for r in (r0, r1):
        assert r["local_numel"] == r["total_numel"] // 2
        # the whole model's operations, as ZeRO-2 (whose parameters are whole on every rank) counts them
        assert r["total_flos"] == ranks(zero_runs, "zero2")[0]["total_flos"] > 0
    final = load_file(str(zero_runs / "zero3" / "final.safetensors"))
    assert_params_close(final, params_of(one_process["batch8"]), atol=1e-6)
    saved = AutoModelForCausalLM.from_pretrained(str(zero_runs / "zero3" / "saved"))
    for name, p in saved.named_parameters():
        assert torch.equal(p.detach(), final[name]), name
    assert_same_bits(final, load_file(str(zero_runs / "zero3" / "resumed.safetensors")))
    assert r0["resumed_losses"] == r0["losses"]
    folder = zero_runs / "zero3" / "out" / "checkpoint-2"
    assert ckpt.verify(str(folder)) is None
    assert_same_bits(load_file(str(zero_runs / "zero3" / "step_2.safetensors")),
                     load_file(str(folder / "model.safetensors")))
    for r in (r0, r1):  # checked by every rank before any gathering: both raise, neither waits
        assert r["bad_fit"].startswith("CheckpointError: ") and "does not fit this model" in r["bad_fit"]
        assert "lm_head.weight has shape [8, 32] in the checkpoint, [64, 32] in the model" in r["bad_fit"]
        assert "model.norm.weight is missing from the checkpoint" in r["bad_fit"]


def test_a_lora_adapter_partitioned_by_zero3_is_saved_whole_and_resumes_exactly(zero_runs):
    """ZeRO-3 leaves each rank a partition of every parameter (the adapter's too): save_model gathers the
    adapter, which peft loads; the resumed run saves the same adapter, bit for bit; checkpoint-2's adapter loads
    back into the partitioned model (as load_best_model_at_end does)."""
    from peft import PeftModel

    r0, _ = ranks(zero_runs, "lora_zero3")
    assert r0["resumed_losses"] == r0["losses"] and len(r0["losses"]) == 3
    adapter = load_file(str(zero_runs / "lora_zero3" / "saved" / "adapter_model.safetensors"))
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained from zeros
    assert_same_bits(adapter, load_file(str(zero_runs / "lora_zero3" / "resumed_saved" / "adapter_model.safetensors")))
    step_2 = load_file(str(zero_runs / "lora_zero3" / "out" / "checkpoint-2" / "adapter_model.safetensors"))
    assert_same_bits(step_2, load_file(str(zero_runs / "lora_zero3" / "step_2_saved" / "adapter_model.safetensors")))
    assert not any(torch.equal(step_2[k], adapter[k]) for k in adapter if "lora_B" in k)
    model = PeftModel.from_pretrained(llama(), str(zero_runs / "lora_zero3" / "saved"))
    loaded = {k.replace(".default", ""): p for k, p in model.named_parameters() if "lora_" in k}
    assert_same_bits(adapter, {k: loaded[k].detach() for k in adapter})


def test_a_nonfinite_gradient_on_one_rank_is_skipped_or_stops_every_rank_under_zero2_and_zero3(zero_runs):
    """A NaN gradient on rank 1 only, at step 2: DeepSpeed's overflow check skips the update on every rank, and
    stoker counts the step (nonfinite_policy='skip': training goes on with finite parameters) or stops every
    rank (nonfinite_policy='stop'). A ZeRO-3 partition made non-finite is never saved."""
    for r in ranks(zero_runs, "zero_nonfinite"):
        for stage in (2, 3):
            assert r[f"{stage}_skip"]["steps"] == 3 and r[f"{stage}_skip"]["nonfinite"] == 1
            assert r[f"{stage}_skip"]["finite"] is True
            assert "gradient norm (inf) at step 2; stopping (nonfinite_policy='stop')" in r[f"{stage}_stop"]["error"]
        assert r["3_skip"]["save"] == "refusing to save checkpoint-3: the model has non-finite parameters"


def test_the_configs_optimizer_and_schedule_are_built_and_stepped_by_deepspeed_and_resume(zero_runs):
    """A config with "optimizer" and "scheduler" sections (auto values filled from the arguments): DeepSpeed
    builds torch's AdamW and its WarmupDecayLR, which warms up to learning_rate over warmup_steps=2; the
    resumed run ends bit for bit where the uninterrupted one ended."""
    r0, _ = ranks(zero_runs, "zero1_config_sections")
    assert (r0["optimizer"], r0["scheduler"]) == ("AdamW", "WarmupDecayLR")
    assert r0["learning_rates"][0] < r0["learning_rates"][1] == pytest.approx(1e-2)
    assert r0["resumed_losses"] == r0["losses"]
    assert_same_bits(load_file(str(zero_runs / "zero1_config_sections" / "final.safetensors")),
                     load_file(str(zero_runs / "zero1_config_sections" / "resumed.safetensors")))
    # a "scheduler" section alone steps DeepSpeed's schedule over stoker's optimizer
    only_schedule = r0["only_schedule"]
    assert (only_schedule["optimizer"], only_schedule["scheduler"]) == ("AdamW", "WarmupDecayLR")
    assert only_schedule["learning_rates"] == r0["learning_rates"]


def test_zero_partitions_resume_only_with_as_many_processes(zero_runs, tmp_path):
    """Refused before any work (the backend's check, which resume_settings makes first), naming what to run."""
    from types import SimpleNamespace

    from stoker.distributed.backends import DeepSpeedBackend

    folder = zero_runs / "zero2" / "out" / "checkpoint-2"
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            f"{folder} holds the ZeRO partitions of 2 processes and this run has 1: DeepSpeed's optimizer state "
            "resumes only on as many processes. Resume on 2 (torchrun --nproc_per_node 2, or accelerate launch "
            f"--num_processes 2), or start a new run from its model (model_name_or_path={str(folder)!r}")):
        DeepSpeedBackend(SimpleNamespace(num_processes=1), None).check_checkpoint(str(folder))
    DeepSpeedBackend(SimpleNamespace(num_processes=2), None).check_checkpoint(str(folder))


def test_a_zero_checkpoint_is_refused_by_another_kind_of_run(zero_runs, tmp_path):
    folder = str(zero_runs / "zero2" / "out" / "checkpoint-2")
    t = Trainer(llama(), w.training_args(str(tmp_path), resume_mismatch="warn", max_steps=3), train_dataset=w.TRAIN)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(
            "was written by a DeepSpeed run and this is a data-parallel (or single-process) run")):
        t.train(resume_from_checkpoint=folder)


@pytest.mark.parametrize("settings, expected", [
    ({"deepspeed": {"zero_optimization": {"stage": 0}}}, "that is plain data parallelism"),
    ({"deepspeed": {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}},
     "save_model and checkpoints write the full model"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}, "chunked_loss": True}, "chunked_loss=True with ZeRO-3"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}, "auto_find_batch_size": True},
     "DeepSpeed fixes the micro-batch"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}, "use_cpu": True}, "Accelerate turns DeepSpeed off"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed runs under a launcher, which sets RANK, "
     "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (missing: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
     "MASTER_PORT); start the script with torchrun"),
])
def test_what_a_deepspeed_run_cannot_do_is_refused_before_any_work(settings, expected, tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **settings)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        Trainer(llama(), args, train_dataset=w.TRAIN)
    assert not (tmp_path / "out").exists()


def test_an_optimizer_given_with_a_configs_optimizer_section_is_refused(tmp_path):
    model = llama()
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", deepspeed=config)
    with pytest.raises(ConfigError, match=re.escape(
            "deepspeed['optimizer']={'type': 'AdamW', 'params': {'lr': 5e-05}} and the optimizer given to the Trainer "
            "(SGD): DeepSpeed builds the config's; remove one of the two")):
        Trainer(model, args, train_dataset=w.TRAIN, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


@pytest.mark.slow
def test_the_documented_zero3_offload_recipe_command_ends_with_0_and_writes_its_results(tmp_path):
    """docs/distributed.md's `torchrun --nproc_per_node 2 -m stoker.recipes.clm recipes/clm.yaml --deepspeed
    recipes/ds_zero3_offload.json` (a smaller model and data): every rank exits 0 and results.json holds the
    evaluations before and after and the sample, which both ranks generated with the partitioned model; it is what
    one process generates with the saved model."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import build_causal_lm
    from tests.helpers.launching import ROOT, TIMEOUT, free_port

    out, sizes = tmp_path / "out", {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "stoker.recipes.clm", "recipes/clm.yaml", "--deepspeed",
               "recipes/ds_zero3_offload.json", "--output_dir", str(out), "--num_train_examples", "256",
               "--num_eval_examples", "20", "--num_train_epochs", "1", "--eval_steps", "4", "--save_steps", "4",
               "--logging_steps", "2", "--disable_tqdm", "true", *[f"--{k}={v}" for k, v in sizes.items()]]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    results = json.loads((out / "results.json").read_text())
    assert {"before", "after", "train", "sample"} <= set(results)
    assert results["after"]["eval_loss"] < results["before"]["eval_loss"]
    sample = results["sample"]
    tokenizer, _ = build_causal_lm(ModelArguments(**sizes), 42)
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer.encode(sample["prompt"], add_special_tokens=False)])
    answer_tokens = len(tokenizer.encode(sample["expected"], add_special_tokens=False)) + 1  # and </s>
    with torch.no_grad():  # as generate_sample: the answer's length and 8 tokens more
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer_tokens + 8,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(alone[0, ids.shape[1]:], skip_special_tokens=True).strip() == sample["generated"]
