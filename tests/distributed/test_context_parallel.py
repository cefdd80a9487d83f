"""Context parallelism (parallelism_config cp_size=2 with fsdp='full_shard') on 2 CPU processes (torchrun, gloo,
float32) against one process on the same global batch, 4 steps. This file is also the ranks' script: one torchrun
launch runs every layout in sequence, rank 0 writing the whole parameters and the logs of each under OUT/<layout>.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/test_context_parallel.py OUT

torch registers its ring attention only for the CUDA sdpa kernels: on a CPU, context_parallel splits the buffers and
leaves attention to each rank's own slice. So the model here is the tiny Llama whose attention is per token (each
position gated by its own query and key, nothing crossing positions; `per_token_attention`), where a rank's slice
computes exactly what the whole sequence computes at those positions. Everything but the ring attention is real:
the validation, Accelerate's mesh and hooks, FSDP2 over the joint dp_shard_cp mesh, the buffers split by torch's
load balancer, shift_labels, the window's token count and the loss's scale. Two test-only seams, in the ranks'
script alone: the arguments' check sees an accelerator (stoker refuses cp_size > 1 without CUDA), and FSDP is set up
on gloo as a GPU run sets it up (tests/helpers/dist_worker.fsdp_on_cpu).

Also the buffers handed to Accelerate's maybe_context_parallel (a mocked Accelerator) and the refusals.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.distributed.context_parallel import SequenceSplit
from stoker.errors import ConfigError
from tests.distributed.test_parallelism import assert_logged_like, assert_trained_like
from tests.helpers.launching import run_ranks
from tests.helpers.tiny_jobs import llama, rows

TRAIN = rows(16, seed=21, lo=5, hi=15)  # 4 steps of a global batch of 4 rows, padded by the collator
EVAL = rows(4, seed=22, lo=5, hi=15)
GLOBAL_BATCH, STEPS = 4, 4
CP = {"cp_size": 2}
# layout -> (optimizer, micro-batch, accumulation): both ranks of the group read the same 4 rows a step
LAYOUTS = {"cp_sgd": ("sgd", 2, 2), "cp_adamw": ("adamw_torch", 4, 1)}
TOLERANCE = {"sgd": 1e-6, "adamw_torch": 5e-4}


def per_token_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """Attention in which every position sees only itself: its value gated by its own query . key (so that the
    query and key projections train too). Nothing crosses positions, so a slice of the sequence computes what the
    whole sequence computes there: what context parallelism's split gives on a CPU, where attention stays local."""
    groups = query.shape[1] // value.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    gate = torch.sigmoid((query * key).sum(-1, keepdim=True) * (scaling or 1.0))
    return (gate * value).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def attention_per_token():
    """transformers' "sdpa" attention replaced by per_token_attention, and put back."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    real = mapping["sdpa"]
    mapping["sdpa"] = per_token_attention
    try:
        yield
    finally:
        mapping["sdpa"] = real


def training_args(out: str, optim: str, micro: int, accumulation: int, parallelism=None, save_strategy: str = "no",
                  **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, logging_steps=1, optim=optim,
                             learning_rate=0.05 if optim == "sgd" else 1e-2, lr_scheduler_type="linear",
                             max_grad_norm=1.0, seed=7, max_steps=STEPS, save_strategy=save_strategy,
                             per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                             per_device_eval_batch_size=2, include_num_input_tokens_seen="non_padding",
                             parallelism_config=parallelism, **kw)


# --- the ranks' side ----------------------------------------------------------------------------------


@contextlib.contextmanager
def as_on_gpus():
    """Test-only: the arguments' checks see an accelerator (stoker refuses cp_size > 1 and fsdp without one), and
    the Trainer is built although Accelerate set up no FSDP on the CPU (fsdp_on_cpu sets it up next)."""
    from stoker.distributed import accelerator, backends

    real = accelerator.accelerator_available, accelerator.accelerate_launch_problems, backends.check_sharding_active
    accelerator.accelerator_available = lambda: True
    accelerator.accelerate_launch_problems = lambda deepspeed_given: []  # (reads the FSDP the arguments set)
    backends.check_sharding_active = lambda args, distributed_type: None
    try:
        yield
    finally:
        accelerator.accelerator_available, accelerator.accelerate_launch_problems = real[:2]
        backends.check_sharding_active = real[2]


def context_parallel_trainer(out: str, optim: str, micro: int, accumulation: int, **kw) -> Trainer:
    """A Trainer of cp_size=2 with fsdp='full_shard', FSDP2 set up on gloo as Accelerate sets it up on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from tests.helpers.dist_worker import fsdp_on_cpu

    # the last layout's fsdp_on_cpu left the process's state at FSDP, which the CPU's Accelerator cannot build on
    if PartialState._shared_state.get("distributed_type") == DistributedType.FSDP:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    with as_on_gpus():
        trainer = Trainer(llama(), training_args(out, optim, micro, accumulation, CP, fsdp="full_shard", **kw),
                          train_dataset=TRAIN)
    fsdp_on_cpu(trainer)
    return trainer


def record_length(seen: list, module, args, output) -> None:
    """A forward hook of the embedding: the sequence length of each training forward."""
    if module.training:
        seen.append(args[0].shape[1])


class RecordingSplit(SequenceSplit):
    """The run's SequenceSplit, recording the length of every micro-batch it splits."""

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.lengths = []

    def __call__(self, batch: dict):
        self.lengths.append(batch["input_ids"].shape[1])
        return super().__call__(batch)


def whole(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def run_layouts(out: str) -> None:
    """One rank: every layout in turn, then a collator that pads to the longest row, refused before any work."""
    from safetensors.torch import save_file

    from stoker.data import PaddingCollator

    with attention_per_token():
        for name, (optim, micro, accumulation) in LAYOUTS.items():
            # cp_adamw checkpoints at step 2 (every rank its FSDP2 shards), which a fresh Trainer resumes (below)
            saves = {"save_strategy": "steps", "save_steps": 2} if name == "cp_adamw" else {}
            trainer = context_parallel_trainer(os.path.join(out, name), optim, micro, accumulation, **saves)
            # the sequence length of each training forward on this rank, and of each micro-batch split
            seen = []
            hook = trainer.model.model.embed_tokens.register_forward_hook(functools.partial(record_length, seen))
            trainer._sequence_split = RecordingSplit(trainer.accelerator)
            trainer.train()
            hook.remove()
            lengths = trainer._sequence_split.lengths
            evaluated = trainer.evaluate(EVAL) if name == "cp_sgd" else {}
            params = {n: whole(p) for n, p in trainer.model.named_parameters()}  # a collective per DTensor
            if trainer.accelerator.is_main_process:
                save_file(params, os.path.join(out, name, "params.safetensors"))
                (Path(out) / name / "run.json").write_text(json.dumps({
                    "logs": [e for e in trainer.state.log_history if "loss" in e], "evaluated": evaluated,
                    "tokens": trainer.state.num_input_tokens_seen, "global_batch": trainer.get_total_train_batch_size(),
                    "cp_size": trainer.get_cp_size(), "seen": seen, "lengths": lengths,
                    "mesh": trainer.accelerator.torch_device_mesh["dp_shard_cp"].size(),
                    "dtensors": sum(hasattr(p, "full_tensor") for p in trainer.model.parameters())}))
        resumed = context_parallel_trainer(os.path.join(out, "cp_adamw", "resumed"), "adamw_torch", 4, 1)
        resumed.train(resume_from_checkpoint=os.path.join(out, "cp_adamw", "checkpoint-2"))
        params = {n: whole(p) for n, p in resumed.model.named_parameters()}
        if resumed.accelerator.is_main_process:
            save_file(params, os.path.join(out, "cp_adamw", "resumed.safetensors"))
            (Path(out) / "cp_adamw" / "resumed.json").write_text(json.dumps(
                [e["loss"] for e in resumed.state.log_history if "loss" in e]))
        refused = context_parallel_trainer(os.path.join(out, "refused"), "sgd", 4, 1)
        refused.data_collator = PaddingCollator()  # pads to the longest row, not to a multiple of 4
        before = {n: whole(p) for n, p in refused.model.named_parameters()}
        try:
            refused.train()
            message = None
        except ConfigError as e:
            message = str(e)
        unchanged = all(torch.equal(before[n], whole(p)) for n, p in refused.model.named_parameters())
        if refused.accelerator.is_main_process:
            (Path(out) / "refused.json").write_text(json.dumps({"message": message, "unchanged": unchanged,
                                                                "step": refused.state.global_step}))


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("context_parallel")
    return run_ranks(__file__, out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process, no parallelism, 4 rows a step, for each optimizer (and the SGD run's evaluation)."""
    out, runs = tmp_path_factory.mktemp("one_process"), {}
    with attention_per_token():
        for optim in TOLERANCE:
            trainer = Trainer(llama(), training_args(str(out / optim), optim, GLOBAL_BATCH, 1), train_dataset=TRAIN)
            trainer.train()
            runs[optim] = trainer
        runs["evaluated"] = runs["sgd"].evaluate(EVAL)
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_trains_like_one_process_on_the_same_global_batch(two_processes, one_process, layout):
    """cp_size=2 (each rank's forward gets half of every sequence, padded by stoker's collator to a multiple of
    4), FSDP2 over the dp_shard_cp mesh: the parameters after 4 steps (SGD with accumulation 2 x 2 within 1e-6,
    AdamW 4 x 1 within 5e-4), the logged losses and gradient norms, the tokens seen and the global batch equal one
    process's on 4 rows a step. The window's tokens are counted before the split, over the data-parallel ranks
    (1 here), and FSDP2's average over the 2 ranks is undone by the loss's scale."""
    from safetensors.torch import load_file

    optim, micro, accumulation = LAYOUTS[layout]
    run = json.loads((two_processes / layout / "run.json").read_text())
    reference = one_process[optim]
    ours = load_file(two_processes / layout / "params.safetensors")
    assert_trained_like(ours, reference, llama(), TOLERANCE[optim], layout)
    assert run["cp_size"] == 2 and run["mesh"] == 2 and run["dtensors"] > 0
    # every micro-batch was padded to a multiple of 2 x cp_size, and its forward got half of it (the forwards
    # before them: the loss convention's probes of the first batch, whole)
    lengths = run["lengths"]
    assert len(lengths) == STEPS * accumulation and all(n % 4 == 0 for n in lengths), lengths
    assert run["seen"][-len(lengths):] == [n // 2 for n in lengths], (run["seen"], lengths)
    assert_logged_like(run, reference, GLOBAL_BATCH, STEPS)


@pytest.mark.distributed
def test_a_context_parallel_checkpoint_is_written_by_every_rank_and_resumes_bit_equal(two_processes):
    """The cp_size=2 AdamW run's checkpoint-2 holds each rank's FSDP2 shards of the model and the optimizer state
    (safetensors and JSON only); a fresh cp_size=2 Trainer resumed from it ends with the uninterrupted run's
    parameters, bit for bit, and the same losses."""
    from safetensors.torch import load_file

    folder = two_processes / "cp_adamw" / "checkpoint-2"
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert files and all(f.suffix in (".json", ".safetensors") for f in files), files
    assert len(list((folder / "optimizer_shards").glob("*.safetensors"))) == 2
    uninterrupted = load_file(two_processes / "cp_adamw" / "params.safetensors")
    resumed = load_file(two_processes / "cp_adamw" / "resumed.safetensors")
    assert uninterrupted.keys() == resumed.keys() and all(torch.equal(uninterrupted[n], resumed[n]) for n in resumed)
    logged = [e["loss"] for e in json.loads((two_processes / "cp_adamw" / "run.json").read_text())["logs"]]
    assert json.loads((two_processes / "cp_adamw" / "resumed.json").read_text()) == logged  # (its first two read back)


@pytest.mark.distributed
def test_context_parallel_evaluation_is_one_processs(two_processes, one_process):
    """evaluate() runs every sequence whole on each rank of the group (no split), and counts the group's rows
    once: one process's eval_loss."""
    run = json.loads((two_processes / "cp_sgd" / "run.json").read_text())
    assert run["evaluated"]["eval_loss"] == pytest.approx(one_process["evaluated"]["eval_loss"], abs=1e-6)


@pytest.mark.distributed
def test_a_sequence_that_does_not_split_evenly_is_refused_before_any_work(two_processes):
    """A collator of the user's that pads to the longest row (not to a multiple of 2 x cp_size): the run's first
    batch is refused on both ranks, naming the length and pad_to_multiple_of, before any update."""
    refused = json.loads((two_processes / "refused.json").read_text())
    assert refused["message"] is not None and refused["unchanged"] and refused["step"] == 0
    assert "cannot be split into 4 equal chunks" in refused["message"]
    assert "pad_to_multiple_of=4" in refused["message"]


# --- the buffers handed to Accelerate ------------------------------------------------------------


class RecordingAccelerator:
    """What SequenceSplit reads of an Accelerator, recording what maybe_context_parallel is handed."""

    def __init__(self, cp_size: int = 2):
        self.parallelism_config = SimpleNamespace(cp_size=cp_size)
        self.calls = []

    def maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
        self.calls.append((buffers, buffer_seq_dims, no_restore_buffers))
        return contextlib.nullcontext()


def test_the_buffers_and_sequence_dims_handed_to_maybe_context_parallel():
    """As transformers.Trainer's _prepare_context_parallel_inputs: input_ids, labels, shift_labels (the labels
    shifted left before the split, -100 at the end), the 2-D attention mask and position_ids (0..7 per row), each
    split along dimension 1 and none restored; copies, so that the loop's batch stays whole."""
    acc = RecordingAccelerator()
    batch = {"input_ids": torch.arange(16).reshape(2, 8), "labels": torch.arange(100, 116).reshape(2, 8),
             "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}
    batch["labels"][1, 6:] = -100
    whole = {k: v.clone() for k, v in batch.items()}
    split = SequenceSplit(acc)
    assert split.batch_problems(batch) == []
    context, inputs = split(batch)
    with context:
        pass
    [(buffers, dims, no_restore)] = acc.calls
    names = ["input_ids", "labels", "shift_labels", "attention_mask", "position_ids"]
    assert [next(k for k in names if inputs[k] is b) for b in buffers] == names
    assert dims == [1] * 5 and len(no_restore) == 5 and all(any(b is n for n in no_restore) for b in buffers)
    assert inputs["shift_labels"].tolist() == [list(range(101, 108)) + [-100],
                                                list(range(109, 114)) + [-100, -100, -100]]
    assert inputs["position_ids"].tolist() == [list(range(8))] * 2
    for k in whole:  # the loop's batch: the same tensors, untouched, not the buffers torch splits in place
        assert torch.equal(batch[k], whole[k]) and all(batch[k] is not b for b in buffers)


def test_the_split_reads_the_device_only_for_the_first_batchs_padding():
    """On a GPU a read of the device makes the host wait: the split reads the attention mask once, for the run's
    first batch (its padding side), and every micro-batch after it reads nothing and copies nothing from the host
    (counted on the CPU by tests/gpu_paths' HostSyncCounter)."""
    from tests.gpu_paths.test_syncs import HostSyncCounter

    def batch():
        return {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
                "attention_mask": torch.ones(2, 8, dtype=torch.long)}

    split = SequenceSplit(RecordingAccelerator())
    with HostSyncCounter() as first:
        assert split.batch_problems(batch()) == []
    with HostSyncCounter() as later:
        for _ in range(3):
            context, _inputs = split(batch())
            with context:
                pass
    assert [e[0] for e in first.events] == ["read"] and later.events == [], (first.events, later.events)


def test_a_batch_the_split_cannot_run_is_named():
    split = SequenceSplit(RecordingAccelerator())
    odd = {"input_ids": torch.zeros(2, 6, dtype=torch.long)}
    assert "a micro-batch of 6 positions cannot be split into 4 equal chunks" in split.batch_problems(odd)[0]
    with pytest.raises(ValueError, match="pad_to_multiple_of=4"):
        split(odd)
    left = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[0, 0] + [1] * 6] * 2)}
    assert "padding is not all at its end" in SequenceSplit(RecordingAccelerator()).batch_problems(left)[0]
    four_d = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 1, 8, 8)}
    assert "an attention_mask of 4 dimensions" in split.batch_problems(four_d)[0]


# --- refusals, before any work -----------------------------------------------------------------------


def refusal(tmp_path, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    return str(e.value)


def test_on_a_cpu_only_the_cuda_refusal_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(tmp_path, parallelism_config=CP, use_cpu=True, packing=True)
    assert "context parallelism (cp_size=2) needs CUDA" in message and "accepted here: cp_size=1" in message
    assert "packing" not in message and "FSDP2" not in message


def test_what_context_parallelism_cannot_run_is_refused_naming_field_value_and_accepted(tmp_path, monkeypatch):
    from stoker.distributed import accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(accelerator, "accelerator_available", lambda: True)  # as on GPUs
    message = refusal(tmp_path, parallelism_config=CP)
    assert "context parallelism (cp_size=2) with fsdp=None: context parallelism needs FSDP2" in message
    assert "accepted: fsdp='full_shard' (fsdp_config version 2, the default)" in message
    message = refusal(tmp_path, parallelism_config=CP, fsdp="full_shard", fsdp_config={"version": 1})
    assert "with fsdp='full_shard' and fsdp_config version 1: context parallelism needs FSDP2" in message
    message = refusal(tmp_path, parallelism_config=CP, fsdp="full_shard", packing=True, chunked_loss=True,
                      label_smoothing_factor=0.1, average_tokens_across_devices=False)
    for words in ("and packing=True: a packed row's sequences", "accepted with context parallelism: packing=False",
                  "and chunked_loss=True:", "and label_smoothing_factor=0.1:", "label_smoothing_factor=0.0",
                  "and average_tokens_across_devices=False:", "accepted: average_tokens_across_devices=True"):
        assert words in message, message
    assert "leave fsdp unset" not in message
    monkeypatch.setenv("WORLD_SIZE", "4")
    message = refusal(tmp_path, parallelism_config={"cp_size": 2, "tp_size": 2}, fsdp="full_shard")
    assert "with tensor parallelism or replicated data parallelism is not yet run" in message
    # what runs: cp_size alone, or with dp_shard_size, under FSDP2
    for sizes in ({"cp_size": 4}, {"cp_size": 2, "dp_shard_size": 2}):
        TrainingArguments(output_dir=str(tmp_path), report_to="none", parallelism_config=sizes, fsdp="full_shard")


def test_a_model_or_loss_that_cannot_run_split_is_refused(tmp_path):
    from stoker.trainer_checks import trainer_input_problems

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    args.parallelism_config = CP  # as validated on GPUs

    def problems(model, loss_func=None):
        return "\n".join(trainer_input_problems(args, model, (None, None), None, None, loss_func))

    assert problems(llama()) == ""
    eager = llama()
    eager.config._attn_implementation = "eager"
    assert "a model whose attention is 'eager': torch's ring attention replaces sdpa only" in problems(eager)
    assert "with compute_loss_func='sum'" in problems(llama(), sum)
    plain = problems(torch.nn.Linear(2, 2))
    assert "with Linear (other): the split needs a loss that reads the labels shifted before the split" in plain
    unsupported = llama()
    unsupported.config.layer_types = ["sliding_attention", "full_attention"]  # as transformers reads a Mistral's
    assert "transformers marks it as not supporting context parallelism" in problems(unsupported)


if __name__ == "__main__":
    run_layouts(sys.argv[1])
