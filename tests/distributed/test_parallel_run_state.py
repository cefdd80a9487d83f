"""The run's state under tensor parallelism (tp_size=2) and FSDP2 (dp_shard_size=2) by the model's own plans, on 2
CPU processes (torchrun, gloo, float32), AdamW, the tiny Llama of test_parallelism.py: the spike rollback's snapshot
taken and put back per shard, a checkpoint written in the background from DTensor shards, and the goodput ledger and
run report of such a run, against one process on the same global batch. This file is also the ranks' script: one
torchrun launch runs every scenario in turn (each launch costs seconds), each rank writing what it saw under
OUT/<layout>/<scenario>.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/test_parallel_run_state.py OUT
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer
from stoker import checkpoint_format as ckpt
from stoker.goodput import PARTS, summary_line
from stoker.report import REPORT_NAME, quarantine_lines
from stoker.rollback import SpikeRollback
from tests.distributed.test_parallelism import TRAIN, max_difference, tiny_llama, training_args, whole
from tests.helpers.launching import run_ranks
from tests.helpers.rollback_jobs import HEAL, clm, poisoned_loss, records
from tests.helpers.rollback_jobs import args as rollback_args

# layout -> (parallelism_config, rows per rank of a micro-batch: 4 rows a step in the spike run, 8 in the saving one)
LAYOUTS = {"tp": ({"tp_size": 2}, 2, 8), "dp_shard": ({"dp_shard_size": 2}, 1, 4)}
# the spike run: 10 steps of 4 rows (micro-batch x 2 accumulation x data-parallel ranks) in order; row 25 blows the
# loss up 10^4 times, so step 7 (rows 24-27) is a spike, rolled back to the snapshot of step 6
SPIKE_ROWS, POISONED, SPIKE_STEPS, SPIKE_AT, RESTORED, QUARANTINED = 48, 25, 10, 7, 6, [24, 25, 26, 27]
ADAMW = 5e-4  # parameters after the run vs one process, AdamW in float32 (summation order)


def spike_args(out: str, micro: int, parallelism=None, **kw):
    """rollback_jobs' arguments for the tiny Llama: AdamW at 1e-2, accumulation 2, the tokens counted."""
    return rollback_args(out, per_device_train_batch_size=micro, gradient_accumulation_steps=2,
                         max_steps=SPIKE_STEPS, learning_rate=1e-2, optim="adamw_torch",
                         include_num_input_tokens_seen="non_padding", parallelism_config=parallelism, **kw)


def snapshot_bytes(trainer, snapshot) -> dict:
    """What the rollback's snapshot copied of the model and optimizer parts (host bytes, tensors), against this
    rank's own shards and the whole tensors they are shards of."""
    from stoker.rollback import _Tensor

    def keys(tree):
        if isinstance(tree, _Tensor):
            yield tree.key
        elif isinstance(tree, dict):
            for v in tree.values():
                yield from keys(v)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                yield from keys(v)

    host = [snapshot.host[k] for part in ("model", "optimizer") for k in keys(snapshot.tree[part])]
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    live = [*(p for p in trainer.model.parameters() if p.requires_grad), *trainer.model.buffers(),
            *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in live]
    return {"host": sum(t.nbytes for t in host), "tensors": len(host), "live_tensors": len(live),
            "local": sum(t.nbytes for t in local), "whole": sum(t.numel() * t.element_size() for t in live),
            "dtensors": sum(hasattr(t, "to_local") for t in live)}


def run_spike(out: str, layout: str) -> None:
    """One rank: the spike run, the rollback's snapshots spied on (bytes copied at the last one), the run report on
    under tensor parallelism (drawing it costs a second); rank 0 writes the whole parameters and what the run
    logged."""
    from safetensors.torch import save_file

    parallelism, micro, _ = LAYOUTS[layout]
    folder = os.path.join(out, layout, "spike")
    seen, real = [], SpikeRollback.snapshot

    def spy(self, run, ledger_mark=None):  # the last snapshot's (AdamW's state is there from the first step on)
        real(self, run, ledger_mark)
        seen[:] = [snapshot_bytes(trainer, self.saved)]

    SpikeRollback.snapshot = spy
    try:
        trainer = Trainer(tiny_llama(), spike_args(folder, micro, parallelism, training_report=layout == "tp", **HEAL),
                          train_dataset=clm(SPIKE_ROWS, poisoned={POISONED}), compute_loss_func=poisoned_loss)
        trainer.train()
    finally:
        SpikeRollback.snapshot = real
    params = {n: whole(p) for n, p in trainer.model.named_parameters()}  # a collective per DTensor
    rank = trainer.accelerator.process_index
    (Path(folder) / f"snapshot_{rank}.json").write_text(json.dumps(seen[0]))
    if trainer.accelerator.is_main_process:
        save_file(params, os.path.join(folder, "params.safetensors"))
        (Path(folder) / "run.json").write_text(json.dumps({
            "logs": [e for e in trainer.state.log_history if "loss" in e],
            "tokens": trainer.state.num_input_tokens_seen, "total_flos": trainer.state.total_flos}))


def run_async_save(out: str, layout: str) -> None:
    """One rank: 5 steps of 8 rows saving in the background at step 3, then a fresh Trainer resumed from that
    checkpoint; rank 0 writes both runs' whole parameters and logs, every rank the bytes its writer copied."""
    from safetensors.torch import save_file

    parallelism, _, micro = LAYOUTS[layout]
    folder = os.path.join(out, layout, "async")

    def trainer():
        args = training_args(folder, "adamw_torch", micro, 1, parallelism, "steps")
        return Trainer(tiny_llama(), dataclasses.replace(args, async_save=True), train_dataset=TRAIN)

    full = trainer()
    full.train()
    copied = full._checkpoint_writer.copies.copied
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-3"))
    runs = {name: {n: whole(p) for n, p in t.model.named_parameters()} for name, t in
            (("full", full), ("resumed", resumed))}
    (Path(folder) / f"copied_{full.accelerator.process_index}.json").write_text(json.dumps(copied))
    if full.accelerator.is_main_process:
        for name, params in runs.items():
            save_file(params, os.path.join(folder, f"{name}.safetensors"))
        (Path(folder) / "run.json").write_text(json.dumps({
            name: [e for e in t.state.log_history if "loss" in e] for name, t in (("full", full), ("resumed", resumed))
        }))


def run_scenarios(out: str) -> None:
    for layout in LAYOUTS:
        run_spike(out, layout)
        run_async_save(out, layout)


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel_run_state")
    return run_ranks(__file__, out)


@pytest.fixture(scope="module")
def without_the_rows(tmp_path_factory):
    """One process, 2 x 2 rows a step, on the spike run's rows without the window it quarantines."""
    out = tmp_path_factory.mktemp("without_the_rows")
    rows = [r for i, r in enumerate(clm(SPIKE_ROWS)) if i not in QUARANTINED]
    trainer = Trainer(tiny_llama(), spike_args(str(out), 2), train_dataset=rows, compute_loss_func=poisoned_loss)
    trainer.train()
    return trainer


def parameters(trainer) -> dict:
    return {n: p.detach() for n, p in trainer.model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_spike_is_rolled_back_per_shard_and_the_run_ends_as_one_process_without_its_rows(
        two_processes, without_the_rows, layout):
    """Step 7's window holds the poisoned row: every rank rolls back to its snapshot of step 6, which holds this
    rank's own shards of the weights and of AdamW's state (not the whole tensors), quarantines the window's 4 rows
    (dealt over the data-parallel ranks: both ranks of a tensor-parallel group read all 4), and the run ends with
    one process's parameters, losses, tokens and FLOPs on the rows without them."""
    from safetensors.torch import load_file

    folder = two_processes / layout / "spike"
    [record] = records(folder)
    ranks = [0, 0, 0, 0] if layout == "tp" else [0, 1, 0, 1]
    assert (record["step"], record["restored_step"], record["indices"], record["ranks"]) == (
        SPIKE_AT, RESTORED, QUARANTINED, ranks)
    for rank in (0, 1):
        copied = json.loads((folder / f"snapshot_{rank}.json").read_text())
        print(f"{layout} rank {rank}: snapshot of model and optimizer {copied['host']} bytes, its shards "
              f"{copied['local']}, the whole tensors {copied['whole']}")
        assert copied["tensors"] == copied["live_tensors"] and copied["dtensors"] >= 3 * 16  # weights, 2 moments
        assert copied["host"] == copied["local"] < 0.55 * copied["whole"]
    run = json.loads((folder / "run.json").read_text())
    difference = max_difference(load_file(folder / "params.safetensors"), parameters(without_the_rows))
    print(f"{layout}: max |parameter difference| after the rollback = {difference:.2e}")
    assert difference <= ADAMW
    expected = [e for e in without_the_rows.state.log_history if "loss" in e]
    assert [e["step"] for e in run["logs"]] == [e["step"] for e in expected] == list(range(1, SPIKE_STEPS + 1))
    torch.testing.assert_close(torch.tensor([e["loss"] for e in run["logs"]]),
                               torch.tensor([e["loss"] for e in expected]), rtol=1e-4, atol=1e-5)
    assert run["tokens"] == without_the_rows.state.num_input_tokens_seen
    # transformers' estimate, 6 x non-embedding parameters x the input's tokens padding included: a tensor-parallel
    # group reads one process's micro-batches of 2 rows, and counts them once; FSDP2's ranks read 1 row each
    per_token = 6 * tiny_llama().num_parameters(exclude_embeddings=True)
    flos = without_the_rows.state.total_flos if layout == "tp" else per_token * run["tokens"]
    assert run["total_flos"] == flos


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_goodput_ledger_and_the_report_of_a_sharded_run(two_processes, without_the_rows, layout):
    """The spike run's final record (metrics.jsonl) holds its ledger: the parts add up to the wall time, the step
    thrown away and the restore are in rollback; its throughput counts the rows of a step once, over the
    data-parallel ranks (the tokens and samples it kept, as one process counts them); under tensor parallelism
    report.html draws the ledger and lists the quarantined rows."""
    folder = two_processes / layout / "spike"
    final = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    parts = {p: final[f"time_{p}"] for p in PARTS}
    assert sum(parts.values()) == pytest.approx(final["time_wall"], abs=1e-3)
    assert parts["productive"] > 0 and parts["rollback"] > 0 and parts["resume"] == parts["recomputed"] == 0
    assert final["goodput"] == pytest.approx(parts["productive"] / final["time_wall"], abs=1e-3)
    assert (final["rollbacks"], final["quarantined_rows"]) == (1, 4)
    # the tokens and rows of the 10 steps kept (step 7's first pass was rolled back with the log's sums)
    tokens = without_the_rows.state.num_input_tokens_seen
    assert final["train_tokens_per_second"] * final["train_runtime"] == pytest.approx(tokens, rel=1e-3)
    assert final["train_samples_per_second"] * final["train_runtime"] == pytest.approx(4 * SPIKE_STEPS, rel=1e-3)
    if layout != "tp":
        return
    page = (folder / REPORT_NAME).read_text()
    lines = quarantine_lines(records(folder))
    assert lines[0] == "4 rows quarantined in 1 rollback"
    assert lines[1].startswith(f"step {SPIKE_AT}: rolled back to step {RESTORED}, 4 rows set aside (loss spike")
    for shown in (f"<h2>Goodput</h2>\n<p>{summary_line(final)}</p>", *lines,
                  f"<tr><td>global_step</td><td>{SPIKE_STEPS}</td></tr>"):
        assert shown in page, shown


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpoint_of_shards_written_in_the_background_is_atomic_and_resumes_bit_equal(two_processes, layout):
    """async_save at step 3 of 5: the checkpoint is committed whole (its manifest lists and hashes both ranks'
    shard files, no temporary folder left), holds every element of the model and AdamW's state once over the two
    ranks' host copies, and a fresh Trainer resumed from it ends with the uninterrupted run's parameters and
    losses, bit for bit."""
    from safetensors.torch import load_file

    folder = two_processes / layout / "async"
    checkpoint = folder / "checkpoint-3"
    assert ckpt.verify(str(checkpoint)) is None and ckpt.stale_temp_dirs(str(folder)) == []
    manifest = ckpt.read_json(str(checkpoint), ckpt.MANIFEST)["files"]
    for shards in ("model_shards", "optimizer_shards"):
        assert len([f for f in manifest if f.startswith(f"{shards}/") and f.endswith(".safetensors")]) == 2
    assert all(f.endswith((".json", ".safetensors")) for f in manifest)
    full, resumed = load_file(folder / "full.safetensors"), load_file(folder / "resumed.safetensors")
    assert full.keys() == resumed.keys() and all(torch.equal(full[n], resumed[n]) for n in full)
    logged = {name: [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate", "num_input_tokens_seen")}
                     for e in run] for name, run in json.loads((folder / "run.json").read_text()).items()}
    assert logged["resumed"] == logged["full"] and [e["step"] for e in logged["full"]] == [1, 2, 3, 4, 5]
    # AdamW: the parameters and two moments in float32, and a step count per parameter; beside them each rank's
    # own part (random streams, the log's sums)
    whole_bytes = sum(t.numel() for t in full.values()) * 4 * 3 + len(full) * 4
    own = [sum(t.nbytes for t in load_file(checkpoint / f"process_{rank}.safetensors").values()) for rank in (0, 1)]
    copied = [json.loads((folder / f"copied_{rank}.json").read_text()) for rank in (0, 1)]
    print(f"{layout}: the background snapshots copied {copied} bytes; the model and optimizer state is "
          f"{whole_bytes}, each rank's own part {own}")
    assert sum(copied) == whole_bytes + sum(own) and max(copied) < 0.6 * whole_bytes


@pytest.mark.parametrize("parallelism", [{"tp_size": 2}, {"dp_shard_size": 2}])
def test_spike_rollback_and_async_save_are_accepted_with_a_sharded_layout(tmp_path, monkeypatch, parallelism):
    from stoker import TrainingArguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, parallelism_config=parallelism,
                             spike_rollback=True, async_save=True)
    assert args.spike_rollback and args.async_save and args.parallelism_config == parallelism


if __name__ == "__main__":
    run_scenarios(sys.argv[1])
