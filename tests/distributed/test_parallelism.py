"""Tensor parallelism and FSDP2 by the model's own plans (`parallelism_config`, or a model transformers sharded at
load) on 2 CPU processes (torchrun, gloo, float32), against one process on the same global batch and data order,
5 steps. This file is also the ranks' script: one torchrun launch runs every layout in sequence (each launch costs
seconds), rank 0 writing the whole parameters (DTensors made whole) and the logs of each under OUT/<layout>.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/test_parallelism.py OUT

Also the refusals of parallelism_config that need no processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # a rank under torchrun: the repository's stoker and tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.errors import ConfigError
from tests.helpers.launching import run_ranks
from tests.helpers.tiny_jobs import rows

TRAIN = rows(40, seed=11)  # 5 steps of a global batch of 8 rows of 3 to 17 tokens
EVAL = rows(7, seed=12)  # in batches of 2: under FSDP2 one process's last batch is half real, half filler
GLOBAL_BATCH, STEPS = 8, 5
# layout -> (how the model reaches the Trainer, parallelism_config, optimizer, micro-batch per rank, accumulation)
LAYOUTS = {
    "tp_sgd": ("plain", {"tp_size": 2}, "sgd", 8, 1),
    "tp_adamw": ("plain", {"tp_size": 2}, "adamw_torch", 8, 1),
    "tp_accumulation": ("plain", {"tp_size": 2}, "sgd", 4, 2),
    "tp_tied": ("tied", {"tp_size": 2}, "sgd", 8, 1),
    "tp_at_load": ("tp_size", None, "sgd", 8, 1),
    "fsdp2_at_load": ("fsdp_size", None, "sgd", 4, 1),
    "dp_shard": ("plain", {"dp_shard_size": 2}, "sgd", 4, 1),
    "dp_shard_adamw": ("plain", {"dp_shard_size": 2}, "adamw_torch", 4, 1),
}
TOLERANCE = {"sgd": 1e-6, "adamw_torch": 5e-4}


def tiny_llama(tied: bool = False):
    """A tiny Llama: hidden 64, 2 layers, 4 heads, 2 KV heads (each splits over 2 ranks); `tied`: its head is the
    embedding (as the recipes' models and SmolLM2's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


def sharded_at_load(model, size: str):
    """`model` sharded by transformers as from_pretrained(..., distributed_config=DistributedConfig(size=2))
    shards it (which needs a download; the same plans, applied to the model built from its config)."""
    from transformers.distributed import DistributedConfig

    config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(**{size: 2}))
    return type(model).maybe_distribute_model(model, config, mesh)


def training_args(out: str, optim: str, micro: int, accumulation: int, parallelism=None,
                  save_strategy: str = "no") -> TrainingArguments:
    return TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, logging_steps=1, optim=optim,
                             learning_rate=0.05 if optim == "sgd" else 1e-2, lr_scheduler_type="linear",
                             max_grad_norm=1.0, seed=7, save_strategy=save_strategy, save_steps=3, max_steps=STEPS,
                             per_device_train_batch_size=micro, per_device_eval_batch_size=2,
                             gradient_accumulation_steps=accumulation,
                             include_num_input_tokens_seen="non_padding", parallelism_config=parallelism)


def label_metrics(prediction) -> dict:
    """What evaluation gathered: its rows, and a fingerprint of their labels and predicted tokens (each row once)."""
    labels, predicted = torch.as_tensor(prediction.label_ids), torch.as_tensor(prediction.predictions).argmax(-1)
    return {"rows": len(labels), "label_sum": int(labels.clamp(min=0).sum()),
            "predicted_sum": int(predicted[labels >= 0].sum())}


def whole(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def run_layouts(out: str) -> None:
    """One rank: every layout in turn."""
    from safetensors.torch import save_file

    for name, (model_from, parallelism, optim, micro, accumulation) in LAYOUTS.items():
        model = tiny_llama(tied=model_from == "tied")
        if model_from not in ("plain", "tied"):
            model = sharded_at_load(model, model_from)
        # tp_adamw also checkpoints at step 3, which a fresh Trainer resumes (below)
        save = "steps" if name == "tp_adamw" else "no"
        trainer = Trainer(model, training_args(os.path.join(out, name), optim, micro, accumulation, parallelism,
                                               save), train_dataset=TRAIN, compute_metrics=label_metrics)
        trainer.train()
        params = {n: whole(p) for n, p in trainer.model.named_parameters()}  # a collective per DTensor
        evaluated = {}
        if name in ("tp_sgd", "dp_shard"):  # evaluation (and save_model), every rank taking part
            evaluated = trainer.evaluate(EVAL)
        if name in ("tp_sgd", "dp_shard"):
            trainer.save_model(os.path.join(out, name, "final"))
        if trainer.accelerator.is_main_process:
            save_file(params, os.path.join(out, name, "params.safetensors"))
            logs = [e for e in trainer.state.log_history if "loss" in e]
            (Path(out) / name / "run.json").write_text(json.dumps({
                "logs": logs, "tokens": trainer.state.num_input_tokens_seen, "evaluated": evaluated,
                "global_batch": trainer.get_total_train_batch_size(),
                "dtensors": sum(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
                "ddp": type(trainer.model_wrapped).__name__}))
    resumed = Trainer(tiny_llama(), training_args(os.path.join(out, "tp_adamw"), "adamw_torch", 8, 1, {"tp_size": 2},
                                                  "steps"), train_dataset=TRAIN)
    resumed.train(resume_from_checkpoint=os.path.join(out, "tp_adamw", "checkpoint-3"))
    params = {n: whole(p) for n, p in resumed.model.named_parameters()}
    if resumed.accelerator.is_main_process:
        save_file(params, os.path.join(out, "tp_adamw", "resumed.safetensors"))


# --- the test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallelism")
    return run_ranks(__file__, out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process, batch 8, for each optimizer and the tied model with SGD (and the SGD run's evaluation)."""
    out, runs = tmp_path_factory.mktemp("one_process"), {}
    for name, optim, tied in (("sgd", "sgd", False), ("adamw_torch", "adamw_torch", False), ("tied", "sgd", True)):
        trainer = Trainer(tiny_llama(tied), training_args(str(out / name), optim, GLOBAL_BATCH, 1),
                          train_dataset=TRAIN, compute_metrics=label_metrics)
        trainer.train()
        runs[name] = trainer
    runs["evaluated"] = runs["sgd"].evaluate(EVAL)
    return runs


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def assert_trained_like(ours: dict, reference, initial, tolerance: float, name: str) -> None:
    """A run's whole parameters (`ours`) within `tolerance` of one process's Trainer (`reference`), and more than ten
    times that from the `initial` model's: it trained, like one process."""
    difference = max_difference(ours, {n: p.detach() for n, p in reference.model.named_parameters()})
    print(f"{name}: max |parameter difference| = {difference:.2e}")
    assert difference <= tolerance, difference
    assert max_difference(ours, {n: p.detach() for n, p in initial.named_parameters()}) > 10 * tolerance


def assert_logged_like(run: dict, reference, global_batch: int = GLOBAL_BATCH, steps: int = STEPS) -> None:
    """A run's record (run.json) against one process's Trainer: the global batch, the tokens seen, and the logged
    steps, losses and gradient norms."""
    assert run["global_batch"] == global_batch and run["tokens"] == reference.state.num_input_tokens_seen
    expected = [e for e in reference.state.log_history if "loss" in e]
    assert [e["step"] for e in run["logs"]] == [e["step"] for e in expected] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([e[key] for e in run["logs"]]),
                                   torch.tensor([e[key] for e in expected]), rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_trains_like_one_process_on_the_same_global_batch(two_processes, one_process, layout):
    """Tensor parallelism by the model's tp_plan (also with accumulation 4 x 2, a head tied to the embedding, and a
    model sharded at load), FSDP2 by its fsdp_plan (parallelism_config dp_shard_size=2, or a model sharded at load):
    the parameters after 5 steps, the logged losses and gradient norms (clipping at 1.0 sees the whole gradient),
    the tokens seen and the global batch equal one process's on 8 rows a step, within float summation order. Tokens
    are counted and the loss normalised over the data-parallel ranks only: the two ranks of a tensor-parallel group
    read the same rows."""
    from safetensors.torch import load_file

    model_from, parallelism, optim, micro, accumulation = LAYOUTS[layout]
    run = json.loads((two_processes / layout / "run.json").read_text())
    reference = one_process["tied" if model_from == "tied" else optim]
    ours = load_file(two_processes / layout / "params.safetensors")
    assert_trained_like(ours, reference, tiny_llama(model_from == "tied"), TOLERANCE[optim], layout)
    assert run["ddp"] != "DistributedDataParallel" and run["dtensors"] >= 15
    assert_logged_like(run, reference)
    assert max(e["grad_norm"] for e in reference.state.log_history if "loss" in e) > 1.0  # clipping took part


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp_sgd", "dp_shard"])
def test_evaluation_under_tensor_parallelism_and_fsdp2_is_one_processs(two_processes, one_process, layout):
    """evaluate() of 7 rows in batches of 2 after training gives one process's eval_loss and metrics, each row once:
    under tp_size=2 the ranks of the group read the same rows (gathered from one of them); under FSDP2 the second
    process's last batch is one real row and one filler, which every process scores once more together (the
    sharded forward is a collective: one process alone would wait)."""
    run = json.loads((two_processes / layout / "run.json").read_text())
    expected = one_process["evaluated"]
    assert run["evaluated"]["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-6)
    assert run["evaluated"]["eval_rows"] == expected["eval_rows"] == len(EVAL)
    for key in ("eval_label_sum", "eval_predicted_sum"):
        assert run["evaluated"][key] == expected[key]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp_sgd", "dp_shard"])
def test_save_model_writes_an_ordinary_folder_from_a_sharded_layout(two_processes, layout):
    """Under tp_size=2 and dp_shard_size=2 save_model writes an ordinary folder that from_pretrained loads in one
    process, with the trained weights (gathered once, written by the main process, no distributed_config left)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(two_processes / layout / "final")
    assert getattr(loaded.config, "distributed_config", None) is None
    trained = load_file(two_processes / layout / "params.safetensors")
    assert max_difference({n: p.detach() for n, p in loaded.named_parameters()}, trained) == 0


@pytest.mark.distributed
def test_a_tensor_parallel_checkpoint_is_written_by_every_rank_and_resumes_bit_equal(two_processes):
    """Under tp_size=2 with AdamW, the checkpoint at step 3 holds every rank's own shards of the model and the
    optimizer state (nothing gathered on one rank), only safetensors and JSON; a fresh Trainer resumed from it
    ends with the uninterrupted run's parameters, bit for bit (transformers.Trainer refuses such a checkpoint)."""
    from safetensors.torch import load_file

    folder = two_processes / "tp_adamw" / "checkpoint-3"
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert files and all(f.suffix in (".json", ".safetensors") for f in files), files
    for shards in ("model_shards", "optimizer_shards"):
        assert len(list((folder / shards).glob("*.safetensors"))) == 2
    assert not (folder / "model.safetensors").exists()
    uninterrupted = load_file(two_processes / "tp_adamw" / "params.safetensors")
    resumed = load_file(two_processes / "tp_adamw" / "resumed.safetensors")
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[n], resumed[n]) for n in resumed)


@pytest.mark.distributed
def test_a_recipe_takes_parallelism_config_on_the_command_line(tmp_path):
    """The clm recipe under torchrun with --parallelism_config '{"tp_size": 2}' (its model's head tied to the
    embedding): it trains, writes every rank's shards in its checkpoint, and its saved model loads in one process
    as an ordinary one."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "clm"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
         "stoker.recipes.clm", "--output_dir", str(out), "--hidden_size", "64", "--intermediate_size", "128",
         "--num_hidden_layers", "1", "--num_train_examples", "128", "--num_eval_examples", "16",
         "--num_train_epochs", "1", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "16",
         "--learning_rate", "3e-3", "--disable_tqdm", "true", "--eval_steps", "8", "--save_steps", "4",
         "--parallelism_config", '{"tp_size": 2}'],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-8000:]
    results = json.loads((out / "results.json").read_text())
    assert results["after"]["eval_loss"] < results["before"]["eval_loss"] - 0.3
    assert len(list((out / "checkpoint-8" / "model_shards").glob("*.safetensors"))) == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings and getattr(model.config, "distributed_config", None) is None


# --- refusals, before any work -----------------------------------------------------------------------


def refusal(tmp_path, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    return str(e.value)


def test_parallelism_config_is_read_from_accelerate_a_dict_or_json(tmp_path):
    from accelerate import ParallelismConfig

    from stoker.distributed.parallelism import read_parallelism_config

    for given in (ParallelismConfig(tp_size=2), {"tp_size": 2}):
        config, problems = read_parallelism_config(given)
        assert problems == [] and (config.tp_size, config.dp_shard_size, config.total_size) == (2, 1, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", parallelism_config='{"tp_size": 1}')
    assert args.parallelism_config == {"tp_size": 1}
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", parallelism_config=ParallelismConfig())
    assert json.loads(args.to_json_string())["parallelism_config"]["tp_size"] == 1


def test_the_cli_parses_parallelism_config_as_json(tmp_path):
    from stoker.arguments import parse_config

    (args,) = parse_config((TrainingArguments,), ["--output_dir", str(tmp_path), "--report_to", "none",
                                                  "--parallelism_config", '{"dp_shard_size": 1}'])
    assert args.parallelism_config == {"dp_shard_size": 1}


@pytest.mark.parametrize("given, words", [
    ({"tp_sise": 2}, ["parallelism_config['tp_sise']: unknown field (did you mean 'tp_size'?)", "tp_size"]),
    ({"tp_size": 0}, ["parallelism_config['tp_size']=0: must be a whole number >= 1"]),
    ([2], ["parallelism_config=[2]", "accepted: Accelerate's ParallelismConfig, a dict or a JSON"]),
    ({"tp_size": 2}, ["parallelism_config={'tp_size': 2}: its sizes multiply to 2 processes and this run has 1",
                      "accepted: sizes whose product is 1"]),
    ({"cp_size": 1, "sp_size": 2}, ["parallelism_config={'sp_size': 2}: sequence parallelism", "runs inside "
                                    "DeepSpeed's engine", "accepted: deepspeed set to a ZeRO config"]),
    ({"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 2},
     ["parallelism_config={'cp_size': 2}: context parallelism (cp_size=2) needs CUDA: torch registers its ring "
      "attention only for the CUDA sdpa kernels"]),
])
def test_what_stoker_does_not_run_is_refused_naming_the_size_the_reason_and_what_is_accepted(tmp_path, given, words):
    message = refusal(tmp_path, parallelism_config=given, use_cpu=True)
    for w in words:
        assert w in message, message


def test_sizes_over_other_processes_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(tmp_path, parallelism_config={"dp_shard_size": 4}, use_cpu=True)
    assert "parallelism_config={'dp_shard_size': 4}: its sizes multiply to 4 processes and this run has 2" in message


def test_a_model_without_a_tp_plan_is_refused_before_any_work(tmp_path, monkeypatch):
    from stoker.distributed.parallelism import run_parallelism

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                             parallelism_config={"tp_size": 1})
    args.parallelism_config = {"tp_size": 2}  # as on 2 processes
    with pytest.raises(ConfigError, match=r"the model \(Linear\) is not a transformers PreTrainedModel"):
        run_parallelism(args, torch.nn.Linear(2, 2), 2)


if __name__ == "__main__":
    run_layouts(sys.argv[1])
