"""Elastic resume, stoker next to transformers.Trainer: the same job (a tiny GPT-2 without dropout, AdamW, a linear
schedule with warm-up, 48 shuffled rows of different lengths, a global batch of 12, 4 steps) written on 1 or 2
processes, resumed from its checkpoint-2 on 2, 1 and 3 with the global batch kept (torchrun, CPU, gloo), and
the largest parameter difference from the uninterrupted run printed side by side.

    python benchmarks/elastic_resume.py [--model gpt2|llama] [--out DIR]

transformers normalises GPT-2's loss by the label count before the causal shift, so its layouts of one global
batch make different updates; with --model llama (whose loss it normalises after the shift) they do not, and
its resumed runs are then compared on a job it runs exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

LAYOUTS = {1: (4, 3), 2: (3, 2), 3: (2, 2)}  # processes -> (per-device batch, accumulation): 12 in each
CASES = [(1, 2), (2, 1), (2, 3)]


def rows(n: int = 48, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1, 63) for _ in range(rng.randint(3, 17))]
        out.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.3 else t for t in ids]})
    return out


def collate(features: list[dict]) -> dict:
    """Right padding, the same batches for both trainers."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    def pad(key, value):
        return torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])

    mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
    return {"input_ids": pad("input_ids", 0), "labels": pad("labels", -100), "attention_mask": mask}


def tiny_model(kind: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def worker(trainer_name: str, out: str, name: str, kind: str) -> None:
    """One rank: `write` (uninterrupted, checkpoint at step 2) or `resume_<n>` (from the n-process checkpoint)."""
    from safetensors.torch import save_file

    if trainer_name == "stoker":
        from stoker import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    micro, accumulation = LAYOUTS[world]
    folder = os.path.join(out, trainer_name, str(world), name)
    model = tiny_model(kind)
    args = TrainingArguments(output_dir=folder, report_to="none", disable_tqdm=True, seed=7,
                             per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                             num_train_epochs=1, optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1,
                             lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, save_strategy="steps",
                             save_steps=2, logging_steps=1, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows(), data_collator=collate)
    if name == "write":
        trainer.train()
    else:
        origin = name.split("_")[1]
        trainer.train(resume_from_checkpoint=os.path.join(out, trainer_name, origin, "write", "checkpoint-2"))
    if rank == 0:
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  os.path.join(folder, "trained.safetensors"))
    trainer.accelerator.wait_for_everyone()


def launch(trainer_name: str, out: str, kind: str, processes: int, *names: str) -> None:
    for name in names:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(processes), os.path.abspath(__file__), "--worker", trainer_name, out, name, kind],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-6000:])
            raise SystemExit(f"{trainer_name} {name} on {processes} processes failed ({done.returncode})")


def largest_difference(a: str, b: str) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return max((x[k] - y[k]).abs().max().item() for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    out = a.out or tempfile.mkdtemp(prefix="elastic-")
    results = {}
    for name in ("stoker", "transformers"):
        launch(name, out, a.model, 1, "write")
        launch(name, out, a.model, 2, "write", "resume_1")
        launch(name, out, a.model, 1, "resume_2")
        launch(name, out, a.model, 3, "resume_2")

        def path(world, run, name=name):
            return os.path.join(out, name, str(world), run, "trained.safetensors")

        results[name] = {f"{o} -> {i}": largest_difference(path(o, "write"), path(i, f"resume_{o}"))
                         for o, i in CASES}
        results[name]["uninterrupted 1 vs 2"] = largest_difference(path(1, "write"), path(2, "write"))
    header = f"{a.model}: max |parameter difference| from the uninterrupted run"
    print(f"{header:<56}{'stoker':>12}{'transformers':>14}")
    for case in results["stoker"]:
        print(f"{case:<56}{results['stoker'][case]:>12.2e}{results['transformers'][case]:>14.2e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
