"""A checkpoint written under one parallel layout resumes under another as the same run (DESIGN invariant 15): the
tiny Llama of test_parallelism, AdamW, a global batch of 8 rows, 5 steps, checkpointed at step 3 and logged at
step 4 (so that the checkpoint holds a log in progress), resumed

    (a) from tensor parallelism (tp_size=2, 2 processes) into one process (the plain backend),
    (b) from one process into tp_size=2,
    (c) from FSDP2 by the model's fsdp_plan (dp_shard_size=2) into tp_size=2,

each ending within float summation order of the run that was never stopped, with the same rows in each optimizer
step and the log going on as if uninterrupted. The one-process runs are this test process's own; this file is also
the ranks' script of the one 2-process launch, which runs its jobs in order (each resume reads what an earlier job,
or the test process, wrote):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/test_parallel_resume.py OUT

Every job writes OUT/<job>/rank_<r>.json (what each optimizer step trained, the log, what stoker said) and, from
rank 0, its whole parameters (DTensors made whole) as params.safetensors.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer, TrainerCallback, TrainingArguments
from stoker.errors import CheckpointError
from stoker.step import LogSums
from tests.distributed.test_parallelism import TRAIN, max_difference, tiny_llama, whole
from tests.helpers.launching import run_ranks

STEPS, SAVED_AT, LOGGED_AT = 5, 3, 4
# the resumed runs end within float summation order of the uninterrupted one: measured up to 1.3e-7 here (two steps
# on the new layout; a whole run on tp_size=2 differs from one process's by 1.4e-4, AdamW's first steps amplifying)
EXACT = 1e-5
# job -> (parallelism_config, per-device batch, the job whose checkpoint-3 it resumes, or None): a global batch of 8
# rows in each (tp_size=2: one data-parallel rank of 8; dp_shard_size=2: two of 4)
JOBS = {
    "one": (None, 8, None),
    "tp": ({"tp_size": 2}, 8, None),
    "tp_from_one": ({"tp_size": 2}, 8, "one"),
    "tp_refuses_batch_4": ({"tp_size": 2}, 4, "one"),
    "dp_shard": ({"dp_shard_size": 2}, 4, None),
    "tp_from_dp_shard": ({"tp_size": 2}, 8, "dp_shard"),
    "one_from_tp": (None, 8, "tp"),
}
LAUNCHED = ("tp", "tp_from_one", "tp_refuses_batch_4", "dp_shard", "tp_from_dp_shard")  # the 2-process launch


def arguments(out: str, parallelism, micro: int) -> TrainingArguments:
    return TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, optim="adamw_torch",
                             learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=1.0, seed=7,
                             max_steps=STEPS, save_strategy="steps", save_steps=SAVED_AT, logging_steps=LOGGED_AT,
                             per_device_train_batch_size=micro, gradient_accumulation_steps=1,
                             include_num_input_tokens_seen="non_padding", parallelism_config=parallelism)


class Ledger(TrainerCallback):
    """Which rows each optimizer step trained on this rank, recorded by a forward pre-hook on the Llama body (rows
    known by their tokens; forwards without gradients are not training)."""

    def __init__(self, model):
        self.row_of = {tuple(r["input_ids"]): i for i, r in enumerate(TRAIN)}
        assert len(self.row_of) == len(TRAIN)
        self.steps, self.current = {}, None
        model.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        if self.current is None or not torch.is_grad_enabled():
            return
        for row, keep in zip(kwargs["input_ids"].tolist(), kwargs["attention_mask"].bool().tolist(), strict=True):
            self.current.append(self.row_of[tuple(t for t, k in zip(row, keep, strict=True) if k)])

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[str(state.global_step)], self.current = sorted(self.current), None


class Messages(logging.Handler):
    """What stoker logs on this process while a job runs."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_job(out: Path, name: str) -> None:
    """One job on every process of this launch (or in this process alone)."""
    from safetensors.torch import save_file

    parallelism, micro, origin = JOBS[name]
    model = tiny_llama()
    ledger, messages = Ledger(model), Messages()
    trainer = Trainer(model, arguments(str(out / name), parallelism, micro), train_dataset=TRAIN, callbacks=[ledger])
    resume = str(out / origin / f"checkpoint-{SAVED_AT}") if origin else None
    report = {}
    logging.getLogger("stoker").addHandler(messages)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        report["warnings"] = [str(w.message) for w in caught]
    except CheckpointError as e:
        report.update(refused=str(e), trained_steps=trainer.state.global_step)
    finally:
        logging.getLogger("stoker").removeHandler(messages)
    acc = trainer.accelerator
    if "refused" not in report:
        params = {n: whole(p) for n, p in trainer.model.named_parameters()}  # a collective per DTensor
        if acc.is_main_process:
            save_file(params, str(out / name / "params.safetensors"))
        report.update(ledger=ledger.steps, logs=trainer.state.log_history, tokens=trainer.state.num_input_tokens_seen)
    report.update(messages=messages.lines, data_parallel_rank=acc.process_index // acc.ranks_per_batch)
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank_{acc.process_index}.json").write_text(json.dumps(report))


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """Every job, in the order that each resume finds the checkpoint it reads: the one-process run here, the
    2-process launch, then the resume of its tensor-parallel checkpoint here (its tests are slow: about 30 s in
    all, most of it the launch)."""
    out = tmp_path_factory.mktemp("parallel_resume")
    run_job(out, "one")
    run_ranks(__file__, out)
    run_job(out, "one_from_tp")
    return out


def reports(out: Path, name: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((out / name).glob("rank_*.json"))]


def rows_per_step(found: list[dict]) -> dict[int, list[int]]:
    """The rows each optimizer step trained over the data-parallel ranks (the ranks of a tensor-parallel group,
    which read the same rows, checked to agree)."""
    by_rank = {}
    for r in found:
        assert by_rank.setdefault(r["data_parallel_rank"], r["ledger"]) == r["ledger"]
    steps = {}
    for ledger in by_rank.values():
        for step, rows in ledger.items():
            steps.setdefault(int(step), []).extend(rows)
    return {step: sorted(rows) for step, rows in sorted(steps.items())}


def params(out: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / name / "params.safetensors"))


CASES = {"a": ("tp", "one_from_tp"), "b": ("one", "tp_from_one"), "c": ("dp_shard", "tp_from_dp_shard")}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_resumes_on_another_parallel_layout_as_the_same_run(resumed, case):
    """(a) tp_size=2 into one process, (b) one process into tp_size=2, (c) dp_shard_size=2 into tp_size=2: the
    resumed run trains the uninterrupted run's rows in each of steps 4 and 5 (each row once in the epoch), ends
    within float summation order of its parameters (whole tensors: the model and AdamW's moments moved between
    layouts), logs the same loss at step 4 (a window whose steps 1-3 the checkpoint's processes summed, regrouped
    for the new ones, not counted twice by a tensor-parallel group's ranks), the same train_loss and tokens."""
    origin, name = CASES[case]
    full, after = reports(resumed, origin), reports(resumed, name)
    before, rows_after = rows_per_step(full), rows_per_step(after)
    assert sorted(rows_after) == [4, 5] and {s: before[s] for s in (4, 5)} == rows_after
    assert all(len(rows) == 8 for rows in before.values())
    assert sorted([r for s in (1, 2, 3) for r in before[s]] + [r for s in (4, 5) for r in rows_after[s]]) == \
        list(range(len(TRAIN)))
    difference = max_difference(params(resumed, name), params(resumed, origin))
    print(f"({case}) {origin} -> {name}: max |parameter difference| = {difference:.2e}")
    assert difference <= EXACT, difference
    logs, want = after[0]["logs"], full[0]["logs"]
    assert [e["step"] for e in logs] == [e["step"] for e in want] == [LOGGED_AT, STEPS]
    assert logs[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-5)
    assert logs[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-4)
    assert logs[-1]["train_loss"] == pytest.approx(want[-1]["train_loss"], rel=1e-5)
    assert after[0]["tokens"] == full[0]["tokens"] > 0
    # one process reads a sharded checkpoint's every shard knowingly, not as torch's assumption
    assert not [w for r in after for w in r["warnings"] if "torch.distributed is disabled" in w]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_resume_messages_name_both_layouts(resumed):
    """Each resume says, before training, the checkpoint's layout and this run's: processes, the sharding sizes and
    the data-parallel ranks, and the global batch they keep."""
    expected = {
        "one_from_tp": "resuming a checkpoint of 2 processes with parallelism_config={'tp_size': 2} (1 data-parallel "
                       "rank) on 1 process: global batch 8 = 1 x 8 x 1, unchanged",
        "tp_from_one": "resuming a checkpoint of 1 process on 2 processes with parallelism_config={'tp_size': 2} (1 "
                       "data-parallel rank): global batch 8 = 1 x 8 x 1, unchanged",
        "tp_from_dp_shard": "resuming a checkpoint of 2 processes with parallelism_config={'dp_shard_size': 2} (2 "
                            "data-parallel ranks) on 2 processes with parallelism_config={'tp_size': 2} (1 "
                            "data-parallel rank): global batch 8 = 1 x 8 x 1, unchanged",
    }
    for name, line in expected.items():
        messages = reports(resumed, name)[0]["messages"]
        assert any(m.startswith(line) for m in messages), messages


@pytest.mark.distributed
@pytest.mark.slow
def test_a_global_batch_the_data_parallel_ranks_cannot_keep_is_refused_before_any_work(resumed):
    """tp_size=2 with 4 rows per device reads 4 rows a step (one data-parallel rank), not the checkpoint's 8: refused
    on every rank before any step, naming both layouts and the flags that keep the global batch."""
    refused = reports(resumed, "tp_refuses_batch_4")
    assert len(refused) == 2 and not list((resumed / "tp_refuses_batch_4").glob("checkpoint-*"))
    for rank in refused:
        assert rank["trained_steps"] == 0, rank
        assert "was written with global batch 8 = 1 x 8 x 1 on 1 process (now 4 = 1 x 4 x 1 on 2 processes with " \
               "parallelism_config={'tp_size': 2} (1 data-parallel rank); data-parallel ranks x " \
               "per_device_train_batch_size x gradient_accumulation_steps)" in rank["refused"], rank["refused"]
        assert "keep its global batch of 8 on 1 data-parallel rank with --per_device_train_batch_size 8 " \
               "--gradient_accumulation_steps 1" in rank["refused"], rank["refused"]


# --- without processes -------------------------------------------------------------------------------


def logged(shares: list[dict], ranks_per_batch: int, averaged: bool) -> tuple[float, list[int]]:
    """What the next log reports of the sums the processes hold: LogSums.reduce_loss's and fold_tokens' arithmetic
    (the sum over every process, divided by the ranks that read one batch, or by the processes where each one's
    loss is a mean of its own)."""
    loss = sum(float(s["loss"]) for s in shares) / (ranks_per_batch if averaged else len(shares))
    return loss, [t // ranks_per_batch for t in sum(s["tokens"] for s in shares).tolist()]


def holding(layout: tuple[int, int], averaged: bool) -> list[dict]:
    """The logs in progress that the processes of `layout` (processes, ranks per tensor-parallel group) hold when
    their log is to report a loss of 6.0 over 28 + 32 tokens: the ranks of one group hold the same sums."""
    world, group = layout
    groups = world // group
    out = []
    for rank in range(world):
        share = (rank // group + 1) / sum(range(1, groups + 1))  # the data-parallel ranks' shares differ
        loss = 6.0 * share if averaged else 6.0 * share * world / group  # a mean of its own: the log divides by world
        out.append({"loss": torch.tensor(loss), "steps": 3, "tokens": torch.tensor([28, 32]) * share,
                    "total_loss": 1.5, "samples": 24, "nonfinite_total": 0, "nonfinite_run": 0})
    for p in out:
        p["tokens"] = p["tokens"].round().long()
    return out


@pytest.mark.parametrize("averaged", [True, False])
@pytest.mark.parametrize("saved, now", [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (2, 2)), ((2, 2), (2, 1)),
                                        ((4, 2), (3, 1))])
def test_the_logs_in_progress_move_between_tensor_parallel_groups_counted_once(saved, now, averaged):
    """(processes, ranks per tensor-parallel group): the next log reports on the new processes what the checkpoint's
    would have reported; the ranks of a group that read one batch are not counted twice (2 tensor-parallel ranks
    into one process), and a new group's ranks each hold its share (one process into tp_size=2)."""
    pendings = holding(saved, averaged)
    assert logged(pendings, saved[1], averaged) == (pytest.approx(6.0), [28, 32])
    world, group = now
    shares = [LogSums.regrouped(pendings, saved[1], world, group, rank, averaged) for rank in range(world)]
    assert logged(shares, group, averaged) == (pytest.approx(6.0), [28, 32])
    for rank in range(group):  # data-parallel rank 0's ranks hold the same, as a tensor-parallel group's do
        assert torch.equal(shares[rank]["loss"], shares[0]["loss"]) and torch.equal(shares[rank]["tokens"],
                                                                                    shares[0]["tokens"])
    assert all((s["steps"], s["samples"], s["total_loss"]) == (3, 24, 1.5) for s in shares)


def test_a_whole_checkpoint_loads_through_torchs_full_state_path_with_its_tied_copy_dropped(tmp_path):
    """What a sharded run reads of a plain run's checkpoint (fsdp.load_whole, here into a plain model in one process,
    where torch's full-state path copies; test (b) above slices into DTensors): the weights, also where the tied
    lm_head.weight was left out of model.safetensors (as save_pretrained may leave it; torch's path loads a tied
    parameter once), and AdamW's state, whose positions in the groups are matched to the model's names."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from stoker import checkpoint_format as ckpt
    from stoker.distributed.fsdp import load_whole

    def tied():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))

    def adamw(model):
        return torch.optim.AdamW([{"params": list(model.model.parameters())}, {"params": [], "weight_decay": 0.0}],
                                 lr=1e-2)

    trained = tied()
    optimizer = adamw(trained)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    trained(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    ckpt.save_weights(trained, str(tmp_path))
    ckpt.save_state(str(tmp_path), "optimizer", optimizer.state_dict())
    weights = load_file(tmp_path / "model.safetensors")
    save_file({n: t for n, t in weights.items() if n != "lm_head.weight"}, tmp_path / "model.safetensors")
    model = tied()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the tied embeddings too: loaded, not kept
    loaded = adamw(model)
    load_whole(str(tmp_path), model, loaded)
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters(), strict=True))
    for p, q in zip(trained.model.parameters(), model.model.parameters(), strict=True):
        assert all(torch.equal(optimizer.state[p][k], loaded.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_a_checkpoint_a_parallel_layout_cannot_load_is_refused_naming_both_and_what_is_accepted(tmp_path):
    """ZeRO partitions into tensor parallelism: refused before any work (the checkpoint's kind is read from its
    files), naming the checkpoint's kind of run, this run's layout and the kinds it resumes."""
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from stoker.distributed.backends import PlanShardedBackend

    (tmp_path / "optimizer_0.json").write_text("{}")
    backend = PlanShardedBackend(SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2)), None)
    with pytest.raises(CheckpointError) as e:
        backend.check_checkpoint(str(tmp_path))
    assert (f"{tmp_path} was written by a DeepSpeed run and this is a parallelism_config={{'tp_size': 2}} run, which "
            "resumes an FSDP run's or a data-parallel (or single-process) run's checkpoints: resume it with the fsdp "
            "/ deepspeed / parallelism_config settings it was written with") in str(e.value)


if __name__ == "__main__":
    for job in LAUNCHED:
        run_job(Path(sys.argv[1]), job)
