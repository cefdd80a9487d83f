"""Sequence parallelism (parallelism_config sp_size=2, sp_backend="deepspeed": DeepSpeed's Ulysses attention, as
transformers.Trainer runs it) on 2 CPU processes (torchrun, gloo, float32), against one process on the same global
batch and data order: the tiny Llama of test_parallelism.py, 5 steps of 8 rows of 3 to 17 tokens. This file is also
the ranks' script: one torchrun launch runs every scenario in turn, each rank writing what it saw under
OUT/<scenario>/rank_<r>.json and rank 0 the trained parameters.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/test_sequence_parallel.py OUT

Also the refusals of sequence parallelism that need no processes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer
from stoker.errors import ConfigError
from tests.distributed.test_parallelism import (
    EVAL,
    GLOBAL_BATCH,
    STEPS,
    TOLERANCE,
    TRAIN,
    assert_trained_like,
    tiny_llama,
    training_args,
)
from tests.helpers.launching import run_ranks

SEQUENCE = {"sp_size": 2, "sp_backend": "deepspeed"}
# scenario -> (ZeRO stage, optimizer, micro-batch, accumulation): the group of 2 ranks reads a micro-batch's rows
SCENARIOS = {
    "zero2_sgd": (2, "sgd", 8, 1),
    "zero3_adamw": (3, "adamw_torch", 8, 1),
    "zero1_accumulation": (1, "sgd", 4, 2),
}


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"}


def sequence_args(out: str, stage: int, optim: str, micro: int, accumulation: int):
    """test_parallelism.py's arguments, with sequence parallelism under DeepSpeed. The last batch of an epoch must
    hold the micro-batch's rows (40 rows make whole batches: none is dropped)."""
    return dataclasses.replace(training_args(out, optim, micro, accumulation), parallelism_config=SEQUENCE,
                               deepspeed=deepspeed_config(stage), dataloader_drop_last=True,
                               per_device_eval_batch_size=2)


def run_scenarios(out: str, names: list[str]) -> None:
    """One rank: the scenarios named (every one if none is) in turn."""
    import deepspeed.comm.torch
    from safetensors.torch import save_file
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # test-only: DeepSpeed compiles a shared-memory path for collectives on first use (C++, about 40 s on 2 cores);
    # gloo serves without it
    deepspeed.comm.torch.build_shm_op = lambda: None
    rank = int(os.environ["RANK"])
    for name in names or SCENARIOS:
        stage, optim, micro, accumulation = SCENARIOS[name]
        folder = os.path.join(out, name)
        model = tiny_llama()
        positions = []  # the positions this rank's embedding saw in each training forward
        model.model.embed_tokens.register_forward_pre_hook(
            lambda m, a, seen=positions: seen.append(a[0].shape[1]) if m.training else None)
        trainer = Trainer(model, sequence_args(folder, stage, optim, micro, accumulation), train_dataset=TRAIN)
        trainer.train()
        params = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered under ZeRO-3 (a collective)
        evaluated = {}
        if name == "zero2_sgd":  # evaluation keeps every row (drop_last is for training's fixed micro-batches)
            trainer.args.dataloader_drop_last = False
            evaluated = trainer.evaluate(EVAL)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in params.items()}, os.path.join(folder, "params.safetensors"))
        (Path(folder) / f"rank_{rank}.json").write_text(json.dumps({
            "logs": [e for e in trainer.state.log_history if "loss" in e], "evaluated": evaluated,
            "tokens": trainer.state.num_input_tokens_seen, "global_batch": trainer.get_total_train_batch_size(),
            "positions": positions, "engine": type(trainer.model_wrapped).__name__,
            "attention": ALL_ATTENTION_FUNCTIONS["sdpa"].__name__}))


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process, batch 8, with test_parallelism.py's arguments, for each optimizer (and the SGD run's
    evaluation)."""
    out, runs = tmp_path_factory.mktemp("one_process"), {}
    for optim in TOLERANCE:
        runs[optim] = Trainer(tiny_llama(), training_args(str(out / optim), optim, GLOBAL_BATCH, 1),
                              train_dataset=TRAIN)
        runs[optim].train()
    runs["evaluated"] = runs["sgd"].evaluate(EVAL)
    return runs


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sequence_parallel")
    return run_ranks(__file__, out)


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sequence_parallelism_trains_like_one_process_on_the_same_global_batch(two_processes, one_process,
                                                                              scenario):
    """sp_size=2 under ZeRO-1, 2 and 3 (SGD, AdamW, accumulation 4 x 2): each rank runs half of every row's positions
    through DeepSpeed's Ulysses attention, and the parameters after 5 steps, the logged losses and gradient norms,
    the tokens seen and the global batch equal one process's on 8 rows a step, within float summation order. The
    group's loss is the sum of its slices' token losses over the window's target tokens (not a mean of per-rank
    means, whose slices hold different numbers of targets), and tokens are counted once per group."""
    from safetensors.torch import load_file

    stage, optim, micro, accumulation = SCENARIOS[scenario]
    r0, r1 = (json.loads((two_processes / scenario / f"rank_{r}.json").read_text()) for r in (0, 1))
    reference = one_process[optim]
    ours = load_file(two_processes / scenario / "params.safetensors")
    assert_trained_like(ours, reference, tiny_llama(), TOLERANCE[optim], scenario)
    assert r0["engine"] == "DeepSpeedEngine" and r0["attention"] == "uattn_wrapper"
    # each rank ran half of every row's positions (rows of up to 17 tokens), in every forward of the 5 windows
    # (and of the loss convention's 2 probes of the first batch)
    assert r0["positions"] == r1["positions"] and len(r0["positions"]) == 2 + STEPS * accumulation
    assert max(r0["positions"]) == 9 and min(r0["positions"]) >= 2
    expected = [e for e in reference.state.log_history if "loss" in e]
    for r in (r0, r1):
        assert r["global_batch"] == GLOBAL_BATCH and r["tokens"] == reference.state.num_input_tokens_seen
        assert [e["step"] for e in r["logs"]] == [e["step"] for e in expected] == list(range(1, STEPS + 1))
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([e[key] for e in r["logs"]]),
                                       torch.tensor([e[key] for e in expected]), rtol=1e-5, atol=1e-6)
    if scenario == "zero2_sgd":  # evaluation runs whole rows, each rank its own (2 a batch, the last one filled up
        # with rows that are not counted where the set is odd): one process's eval_loss
        assert r0["evaluated"]["eval_loss"] == pytest.approx(one_process["evaluated"]["eval_loss"], abs=1e-6)


# --- refusals, before any work -----------------------------------------------------------------------


def refusal(tmp_path, monkeypatch, **kw) -> str:
    from stoker import TrainingArguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path), report_to="none", parallelism_config=SEQUENCE, **kw)
    return str(e.value)


@pytest.mark.parametrize("settings, words", [
    ({}, ["parallelism_config={'sp_size': 2}: sequence parallelism (sp_size=2, sp_backend='deepspeed') runs inside "
          "DeepSpeed's engine", "accepted: deepspeed set to a ZeRO config"]),
    ({"packing": True}, ["parallelism_config={'sp_size': 2} and packing=True: packed rows need a mask",
                         "accepted with sp_size: packing=False"]),
    ({"padding_free": True}, ["and padding_free=True: padding-free batches hold several sequences in one row"]),
    ({"chunked_loss": True}, ["and chunked_loss=True: the chunked loss shifts the labels of its slice itself",
                              "accepted with sp_size: chunked_loss=False"]),
    ({"shared_prefix": True}, ["and shared_prefix=True", "accepted with sp_size: shared_prefix=False"]),
    ({"per_device_train_batch_size": 4}, [
        "and per_device_train_batch_size=4 with dataloader_drop_last=False: DeepSpeed's Ulysses attention runs a "
        "fixed number of rows", "accepted: per_device_train_batch_size=1 or dataloader_drop_last=True"]),
])
def test_what_sequence_parallelism_cannot_run_is_refused_naming_the_size_why_and_what_is_accepted(
        tmp_path, monkeypatch, settings, words):
    if "deepspeed" not in str(words):
        settings = {"deepspeed": deepspeed_config(2), "per_device_train_batch_size": 1, **settings}
    message = refusal(tmp_path, monkeypatch, **settings)
    for w in words:
        assert w in message, message


def test_sequence_parallelism_with_another_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    from stoker import TrainingArguments

    with pytest.raises(ConfigError, match="sequence parallelism \\(sp_size=2, sp_backend='deepspeed'\\) with another "
                                          "size is not yet run by stoker; accepted: sp_size equal to the number of "
                                          "processes"):
        TrainingArguments(output_dir=str(tmp_path), report_to="none", deepspeed=deepspeed_config(2),
                          parallelism_config={**SEQUENCE, "tp_size": 2}, per_device_train_batch_size=1)


@pytest.mark.parametrize("zero, expected", [
    ({"stage": 0}, "deepspeed['zero_optimization.stage']=0 with sequence parallelism is not yet run by stoker: "
                   "DeepSpeed's stage-0 engine reports no gradient norm"),
    ({"stage": 3, "reduce_scatter": False}, "deepspeed['zero_optimization.reduce_scatter']=False with "
     "contiguous_gradients and parallelism_config={'sp_size': 2}: DeepSpeed before 0.20.2 sums some gradients of the "
     "sequence-parallel group and averages others; accepted: reduce_scatter true (the default), or deepspeed>=0.20.2"),
])
def test_a_deepspeed_config_sequence_parallelism_cannot_run_is_refused_before_any_work(tmp_path, monkeypatch, zero,
                                                                                     expected):
    from importlib.metadata import version

    from packaging.version import Version

    from stoker import TrainingArguments

    if zero.get("reduce_scatter") is False and Version(version("deepspeed")) >= Version("0.20.2"):
        pytest.skip("deepspeed>=0.20.2 sums a sequence-parallel group's gradients on every ZeRO-3 path")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", parallelism_config=SEQUENCE,
                             deepspeed={**deepspeed_config(2), "zero_optimization": zero},
                             per_device_train_batch_size=1)
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_llama(), args, train_dataset=TRAIN)
    assert expected in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_model_the_ulysses_attention_cannot_split_is_refused_before_any_work(tmp_path):
    from stoker import TrainingArguments
    from stoker.distributed.parallelism import run_parallelism

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=1)
    args.parallelism_config = {"sp_size": 4}  # as on 4 processes
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    with pytest.raises(ConfigError) as e:
        run_parallelism(args, model, 4)
    assert "the model's attn_implementation='eager', which DeepSpeed's Ulysses attention does not run" in str(e.value)
    assert "LlamaForCausalLM has 4 attention heads and 2 key/value heads, which sp_size=4 must divide" not in str(
        e.value)  # 4 heads and 2 key/value heads (replicated twice) divide over 4
    args.parallelism_config = {"sp_size": 3}
    with pytest.raises(ConfigError, match="LlamaForCausalLM has 4 attention heads and 2 key/value heads, which "
                                          "sp_size=3 must divide"):
        run_parallelism(args, tiny_llama(), 3)
    with pytest.raises(ConfigError, match=r"the model \(Linear\) is not a transformers model"):
        run_parallelism(args, torch.nn.Linear(2, 2), 3)


def test_a_slice_of_each_row_keeps_the_labels_shifted_before_the_cut():
    """SequenceShards: rows padded to a multiple of the group (labels -100, mask 0, positions going on), the
    labels shifted over the whole row, then each rank's half; the halves put together are the padded row. A
    left-padded batch is refused (the Ulysses attention drops the mask): the first batch's check reports it."""
    from stoker.data import PaddingCollator
    from stoker.distributed.sequence_parallel import SequenceShards

    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    halves = [SequenceShards(PaddingCollator(), rank, 2)(rows) for rank in (0, 1)]
    whole = {k: torch.cat([h[k] for h in halves], dim=1).tolist() for k in halves[0]}
    assert whole["input_ids"] == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert whole["attention_mask"] == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert whole["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert whole["shift_labels"] == [[6, 7, -100, -100], [9, -100, -100, -100]]
    assert whole["labels"] == [[5, 6, 7, -100], [-100, 9, -100, -100]]
    assert halves[1]["shift_labels"].tolist() == [[-100, -100], [-100, -100]]
    left_padded = {"input_ids": [0, 8], "attention_mask": [0, 1], "labels": [-100, 8]}
    with pytest.raises(ValueError, match="sequence parallelism needs right-padded rows"):
        SequenceShards(PaddingCollator(), 0, 2)([left_padded, left_padded])


if __name__ == "__main__":
    run_scenarios(sys.argv[1], sys.argv[2:])
