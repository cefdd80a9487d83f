"""The ranks of the elastic-resume tests in tests/distributed/test_elastic.py, started by torchrun (CPU, gloo,
float32) with 1, 2 or 3 processes:

    python -m torch.distributed.run --nproc_per_node N tests/helpers/elastic_worker.py OUT SCENARIO [SCENARIO ...]

Every job trains a tiny GPT-2 without dropout (AdamW, a linear schedule with warm-up) on 48 shuffled rows of
different lengths with a global batch of 12, 4 optimizer steps, in the layout of its number of processes (LAYOUTS:
processes x per-device batch x accumulation), logging at step 3 (so that the checkpoint at step 2 holds every
process's share of a log in progress). `write_<kind>` runs it uninterrupted and keeps its checkpoint-2;
`resume_<kind>_from_<n>` resumes the checkpoint-2 that the `n`-process launch wrote, in this launch's layout.
Each writes OUT/<world>/<scenario>/rank_<r>.json (the loss log, which rows each optimizer step trained on this
rank, what stoker logged) and, from rank 0, the trained parameters as trained.safetensors.
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from stoker import Trainer, TrainerCallback  # noqa: E402
from stoker.errors import CheckpointError  # noqa: E402
from tests.helpers.dist_worker import (  # noqa: E402
    Report,
    fsdp_on_cpu,
    gathered_state,
    leave,
    losses,
    training_args,
)
from tests.helpers.tiny_jobs import rows  # noqa: E402

ROWS = rows(48, seed=11)
# processes -> (per_device_train_batch_size, gradient_accumulation_steps): a global batch of 12 in each
LAYOUTS = {1: (4, 3), 2: (3, 2), 3: (2, 2)}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class Ledger(TrainerCallback):
    """Which rows each optimizer step trained on this rank: a forward pre-hook on the GPT-2 body records the
    rows of every micro-batch between on_step_begin and on_step_end, identified by their tokens (the forwards
    without gradients, the Trainer's one-off probes of the loss, are not training)."""

    def __init__(self, model: GPT2LMHeadModel):
        self.row_of = {tuple(r["input_ids"]): i for i, r in enumerate(ROWS)}
        assert len(self.row_of) == len(ROWS)
        self.steps, self.current = {}, None
        model.transformer.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        if self.current is None or not torch.is_grad_enabled():
            return
        ids, mask = kwargs["input_ids"] if "input_ids" in kwargs else args[0], kwargs["attention_mask"]
        for row, keep in zip(ids.tolist(), mask.bool().tolist(), strict=True):
            self.current.append(self.row_of[tuple(t for t, k in zip(row, keep, strict=True) if k)])

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step], self.current = self.current, None


class Messages(logging.Handler):
    """What stoker logs on this rank."""

    def __init__(self):
        super().__init__()
        self.lines = []
        logging.getLogger("stoker").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


MESSAGES = Messages()


def job(folder: str, world: int, kind: str, layout: tuple[int, int] | None = None, **kw) -> tuple[Trainer, Ledger]:
    """A Trainer of the job in this launch's layout (or `layout`): kind "ddp" (the plain backend), "lora" (a LoRA
    adapter), "fsdp2" or "fsdp1" (FSDP2 or FSDP1 shards, SHARDED_STATE_DICT; FSDP1's flat parameters form one
    group, so no weight decay, which would apply to the norms there and not in a plain run)."""
    micro, accumulation = layout or LAYOUTS[world]
    if kind == "fsdp1":
        kw["weight_decay"] = 0.0
    model = gpt2()
    ledger = Ledger(model)
    args = training_args(folder, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                         num_train_epochs=1, optim="adamw_torch", learning_rate=1e-2, lr_scheduler_type="linear",
                         warmup_steps=1, save_strategy="steps", save_steps=2, logging_steps=3,
                         **{"weight_decay": 0.1, **kw})
    extra = {}
    if kind == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = Trainer(model, args, train_dataset=ROWS, callbacks=[ledger], **extra)
    if kind == "fsdp2":
        fsdp_on_cpu(trainer, state_dict_type="SHARDED_STATE_DICT")
    elif kind == "fsdp1":  # Accelerate's sync of the ranks' modules needs a GPU; they build the same model anyway
        fsdp_on_cpu(trainer, version=1, state_dict_type="SHARDED_STATE_DICT", use_orig_params=False,
                    sync_module_states=False)
    return trainer, ledger


def trained(trainer) -> dict[str, torch.Tensor]:
    """The trained parameters (every rank must call it): an FSDP run's gathered on rank 0, a LoRA model's adapter,
    otherwise the whole model's state."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if trainer._backend.kind == "an FSDP":
        state = gathered_state(trainer)
    elif hasattr(model, "peft_config"):
        state = {n: p for n, p in model.named_parameters() if p.requires_grad}
    else:
        state = model.state_dict()
    return {n: t.detach().clone().contiguous() for n, t in state.items()}


def finish(r: Report, trainer: Trainer, ledger: Ledger, start: int) -> None:
    state = trained(trainer)
    r.values.update(losses=losses(trainer), ledger={str(k): v for k, v in ledger.steps.items()},
                    global_step=trainer.state.global_step, max_steps=trainer.state.max_steps,
                    messages=MESSAGES.lines[start:])
    r.save_tensors("trained", state)
    r.write()


def run(out: str, name: str) -> None:
    """`write_<kind>`, `resume_<kind>_from_<n>`, `warn_from_<n>` (a changed global batch, resume_mismatch='warn')
    or `refuse_g8_from_2` (a global batch of 8 that 3 processes cannot keep)."""
    world = int(os.environ["WORLD_SIZE"])
    r = Report(os.path.join(out, str(world)), name)
    start = len(MESSAGES.lines)
    parts = name.split("_")
    if name == "write_g8":  # 2 processes x 2 x accumulation 2
        trainer, ledger = job(os.path.join(r.folder, "out"), world, "ddp", layout=(2, 2), max_steps=2)
        trainer.train()
    elif parts[0] == "write":
        trainer, ledger = job(os.path.join(r.folder, "out"), world, parts[1])
        trainer.train()
    elif parts[0] == "resume":
        kind, origin = parts[1], parts[3]
        trainer, ledger = job(os.path.join(r.folder, "out"), world, kind)
        trainer.train(resume_from_checkpoint=os.path.join(out, origin, f"write_{kind}", "out", "checkpoint-2"))
    elif parts[0] == "warn":  # 1 x 2 per process, accumulation 1: a global batch of 2 x world, not 12
        trainer, ledger = job(os.path.join(r.folder, "out"), world, "ddp", layout=(2, 1), resume_mismatch="warn")
        trainer.train(resume_from_checkpoint=os.path.join(out, parts[2], "write_ddp", "out", "checkpoint-2"))
    elif name == "refuse_g8_from_2":
        trainer, ledger = job(os.path.join(r.folder, "out"), world, "ddp")
        try:
            trainer.train(resume_from_checkpoint=os.path.join(out, "2", "write_g8", "out", "checkpoint-2"))
        except CheckpointError as e:
            r.values.update(refused=str(e), step=trainer.state.global_step,
                            wrote=os.path.exists(os.path.join(r.folder, "out")))
        r.write()
        return
    finish(r, trainer, ledger, start)


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    for name in names:
        run(out, name)
    leave()


if __name__ == "__main__":
    main()
