"""Two-dimensional layouts of `parallelism_config` on 4 CPU processes (torchrun, gloo, float32), against one process
on the same global batch and data order, 5 steps: HSDP (dp_replicate_size=2 x dp_shard_size=2), tensor parallelism
inside FSDP2 (tp_size=2 x dp_shard_size=2) and a replicated tensor-parallel model (dp_replicate_size=2 x
tp_size=2), each sharded by transformers' DistributedConfig as from_pretrained shards it. This file is also the
ranks' script: one torchrun launch runs every layout in sequence (a 4-process launch costs seconds on 2 cores),
rank 0 writing the whole parameters, the logs and the meshes of each under OUT/<layout>.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/distributed/test_parallel_mesh.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer, TrainingArguments
from tests.distributed.test_parallelism import (
    GLOBAL_BATCH,
    TOLERANCE,
    TRAIN,
    assert_logged_like,
    assert_trained_like,
    tiny_llama,
    training_args,
    whole,
)
from tests.helpers.launching import run_ranks

PROCESSES = 4
HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
TP_FSDP = {"tp_size": 2, "dp_shard_size": 2}
REPLICATED_TP = {"dp_replicate_size": 2, "tp_size": 2}
# layout -> (parallelism_config, optimizer, micro-batch per rank: the global batch over the data-parallel ranks)
LAYOUTS = {
    "hsdp_adamw": (HSDP, "adamw_torch", 2),
    # HSDP with SGD: a model transformers sharded at load with HSDP, parallelism_config unset (past the shard, the
    # same run as parallelism_config's: the same sizes, asserted below; one 4-process run less in the budget)
    "hsdp_at_load": (None, "sgd", 2),
    "tp_fsdp_sgd": (TP_FSDP, "sgd", 4),
    "tp_fsdp_adamw": (TP_FSDP, "adamw_torch", 4),
    # (AdamW on tensor-parallel DTensors is tp_fsdp_adamw's: a 4-process run costs about 2 s of the budget)
    "replicated_tp_sgd": (REPLICATED_TP, "sgd", 4),
}
# from_pretrained(..., distributed_config=DistributedConfig(dp_replicate_size=2, fsdp_size=2)) of hsdp_at_load
LOADED_HSDP = {"dp_replicate_size": 2, "fsdp_size": 2}
CHECKPOINTED = "tp_fsdp_adamw"  # also checkpoints at step 3, which a fresh Trainer resumes
# the mesh of the first attention projection's weight, and the rows of its local shard (64 whole): FSDP2 on the
# dp_shard dimension, tensor parallelism on tp (rows split by the colwise plan), nothing split on dp_replicate
# (keyed by the layout's first word)
EXPECTED_MESH = {
    "hsdp": (["dp_replicate", "fsdp"], [2, 2], 32),
    "tp": (["fsdp", "tp"], [2, 2], 16),
    "replicated": (["dp_replicate", "fsdp", "tp"], [2, 1, 2], 32),
}
# the Accelerator's sizes (data loading, loss normalisation) by the layout's first word
EXPECTED_SIZES = {"hsdp": {**HSDP, "data_parallel_size": 4}, "tp": {**TP_FSDP, "data_parallel_size": 2},
                  "replicated": {**REPLICATED_TP, "data_parallel_size": 2}}
PROBE = "model.layers.0.self_attn.q_proj.weight"


def mesh_of(parameter) -> dict:
    """The mesh a parameter lives on (names, sizes), its placements and its local shard's rows."""
    return {"dims": list(parameter.device_mesh.mesh_dim_names), "sizes": list(parameter.device_mesh.mesh.shape),
            "placements": [str(p) for p in parameter.placements], "rows": parameter.to_local().shape[0]}


def sharded_at_load(model, **sizes):
    """`model` sharded by transformers as from_pretrained(..., distributed_config=DistributedConfig(**sizes))
    shards it (the same plans, applied to the model built from its config)."""
    from transformers.distributed import DistributedConfig

    config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(**sizes))
    return type(model).maybe_distribute_model(model, config, mesh)


def run_layouts(out: str) -> None:
    """One rank: every layout in turn, then the checkpointed one resumed, then a Trainer given the HSDP model
    sharded at load together with the same parallelism_config (built, not trained)."""
    from safetensors.torch import save_file

    for name, (parallelism, optim, micro) in LAYOUTS.items():
        save = "steps" if name == CHECKPOINTED else "no"
        model = sharded_at_load(tiny_llama(), **LOADED_HSDP) if parallelism is None else tiny_llama()
        trainer = Trainer(model, training_args(os.path.join(out, name), optim, micro, 1, parallelism, save),
                          train_dataset=TRAIN)
        trainer.train()
        params = {n: whole(p) for n, p in trainer.model.named_parameters()}  # a collective per DTensor
        if trainer.accelerator.is_main_process:
            save_file(params, os.path.join(out, name, "params.safetensors"))
            (Path(out) / name / "run.json").write_text(json.dumps({
                "logs": [e for e in trainer.state.log_history if "loss" in e],
                "tokens": trainer.state.num_input_tokens_seen,
                "global_batch": trainer.get_total_train_batch_size(),
                "dtensors": sum(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
                "probe": mesh_of(trainer.model.get_parameter(PROBE)),
                "sizes": sizes_of(trainer.accelerator),
                "ddp": type(trainer.model_wrapped).__name__}))
    parallelism, optim, micro = LAYOUTS[CHECKPOINTED]
    resumed = Trainer(tiny_llama(), training_args(os.path.join(out, CHECKPOINTED), optim, micro, 1, parallelism,
                                                  "steps"), train_dataset=TRAIN)
    resumed.train(resume_from_checkpoint=os.path.join(out, CHECKPOINTED, "checkpoint-3"))
    params = {n: whole(p) for n, p in resumed.model.named_parameters()}
    if resumed.accelerator.is_main_process:
        save_file(params, os.path.join(out, CHECKPOINTED, "resumed.safetensors"))
    given = Trainer(sharded_at_load(tiny_llama(), **LOADED_HSDP),
                    training_args(os.path.join(out, "hsdp_at_load_given"), "sgd", 2, 1, HSDP), train_dataset=TRAIN)
    if given.accelerator.is_main_process:
        (Path(out) / "hsdp_at_load_given.json").write_text(json.dumps(sizes_of(given.accelerator)))


def sizes_of(accelerator) -> dict:
    """The sizes of the Accelerator's ParallelismConfig that are not 1, and its data-parallel size."""
    config = accelerator.parallelism_config
    return {"data_parallel_size": accelerator.data_parallel_size,
            **{k: getattr(config, k) for k in ("dp_replicate_size", "dp_shard_size", "tp_size")
               if getattr(config, k) != 1}}


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel_mesh")
    return run_ranks(__file__, out, PROCESSES)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> dict:
    """One process, batch 8, for each optimizer the layouts use."""
    out, runs = tmp_path_factory.mktemp("one_process"), {}
    for optim in TOLERANCE:
        runs[optim] = Trainer(tiny_llama(), training_args(str(out / optim), optim, GLOBAL_BATCH, 1),
                              train_dataset=TRAIN)
        runs[optim].train()
    return runs


@pytest.mark.distributed
@pytest.mark.slow  # the module fixture's 4-process launch: about 30 s
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_two_dimensional_layout_trains_like_one_process_on_the_same_global_batch(four_processes, one_process_runs,
                                                                                  layout):
    """HSDP (FSDP2 sharded within each pair of ranks, replicated across the pairs, gradients averaged over all 4
    data-parallel ranks, 2 rows each), tensor parallelism inside FSDP2 and a replicated tensor-parallel model (2
    data-parallel ranks of 4 rows, the two ranks of each tensor-parallel group reading the same rows): the
    parameters after 5 steps, the logged losses and gradient norms (clipping at 1.0 sees the whole gradient, over
    both meshes of the 2-D model), the tokens seen and the global batch equal one process's on 8 rows a step,
    within float summation order; the parameters live on the mesh asked for."""
    from safetensors.torch import load_file

    parallelism, optim, micro = LAYOUTS[layout]
    run = json.loads((four_processes / layout / "run.json").read_text())
    reference = one_process_runs[optim]
    ours = load_file(four_processes / layout / "params.safetensors")
    assert_trained_like(ours, reference, tiny_llama(), TOLERANCE[optim], layout)
    dims, sizes, rows = EXPECTED_MESH[layout.split("_")[0]]
    assert (run["probe"]["dims"], run["probe"]["sizes"], run["probe"]["rows"]) == (dims, sizes, rows), run["probe"]
    assert run["sizes"] == EXPECTED_SIZES[layout.split("_")[0]]
    assert run["ddp"] != "DistributedDataParallel" and run["dtensors"] >= 16
    assert_logged_like(run, reference)
    assert max(e["grad_norm"] for e in reference.state.log_history if "loss" in e) > 1.0  # clipping took part


@pytest.mark.distributed
@pytest.mark.slow  # the module fixture's 4-process launch: about 30 s
def test_an_hsdp_model_sharded_at_load_runs_its_own_layout_with_or_without_parallelism_config(four_processes):
    """A model transformers sharded at load with DistributedConfig(dp_replicate_size=2, fsdp_size=2) is run with
    that layout (hsdp_at_load above trains it like one process), and parallelism_config naming the same sizes is
    accepted beside it rather than refused as another layout."""
    given = json.loads((four_processes / "hsdp_at_load_given.json").read_text())
    assert given == {**HSDP, "data_parallel_size": 4}


@pytest.mark.distributed
@pytest.mark.slow  # the module fixture's 4-process launch: about 30 s
def test_a_two_dimensional_checkpoint_is_written_by_every_rank_and_resumes_bit_equal(four_processes):
    """Under tp_size=2 x dp_shard_size=2 with AdamW, the checkpoint at step 3 holds the 4 ranks' own shards of the
    model and the optimizer state (only safetensors and JSON, nothing gathered); a fresh Trainer on the same
    layout resumed from it ends with the uninterrupted run's parameters, bit for bit."""
    from safetensors.torch import load_file

    folder = four_processes / CHECKPOINTED / "checkpoint-3"
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert files and all(f.suffix in (".json", ".safetensors") for f in files), files
    for shards in ("model_shards", "optimizer_shards"):
        assert len(list((folder / shards).glob("*.safetensors"))) == PROCESSES
    assert not (folder / "model.safetensors").exists()
    uninterrupted = load_file(four_processes / CHECKPOINTED / "params.safetensors")
    resumed = load_file(four_processes / CHECKPOINTED / "resumed.safetensors")
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[n], resumed[n]) for n in resumed)


# --- what the arguments accept and refuse, before any work --------------------------------------------


@pytest.mark.parametrize("given", [HSDP, TP_FSDP, REPLICATED_TP])
def test_two_dimensional_layouts_are_accepted_on_as_many_processes(tmp_path, monkeypatch, given):
    monkeypatch.setenv("WORLD_SIZE", str(PROCESSES))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, parallelism_config=given)
    assert args.parallelism_config == given


def test_three_dimensions_are_accepted_and_each_size_reaches_transformers(tmp_path, monkeypatch):
    """HSDP of a tensor-parallel model (dp_replicate_size x dp_shard_size x tp_size, 8 processes, more than the suite
    launches; run by hand it trained like one process, SGD 7.5e-9) is accepted, and the model is sharded by
    transformers with all three sizes."""
    from accelerate import ParallelismConfig

    from stoker.distributed.parallelism import shard_with_plans

    monkeypatch.setenv("WORLD_SIZE", "8")
    given = {**HSDP, "tp_size": 2}
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, parallelism_config=given)
    assert args.parallelism_config == given
    asked = []

    class Planned(torch.nn.Linear):
        @classmethod
        def prepare_distribute_model(cls, config):
            asked.append(config)
            return config, None, "mesh"

        @classmethod
        def maybe_distribute_model(cls, model, config, mesh):
            return model

    shard_with_plans(Planned(2, 2), ParallelismConfig(**given), "cpu")
    assert [(c.dp_replicate_size, c.fsdp_size, c.tp_size) for c in asked] == [(2, 2, 2)]


if __name__ == "__main__":
    run_layouts(sys.argv[1])
