"""A training process for the kill tests:
`python tests/helpers/worker.py OUTPUT_DIR [--kill-in-save STEP] [--async-save [--write-delay SECONDS]]`.

It trains a tiny Llama with dropout, checkpointing every step, resuming from the newest complete checkpoint,
and writes its final parameters to OUTPUT_DIR/final. It prints TRAINING once the loop starts and STEP n after each step.
With --async-save its checkpoints are written in the background, each write starting --write-delay seconds late
(default 0.05), so that a signal or a kill lands while one is being written.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from stoker import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from stoker import checkpoint_format as ckpt  # noqa: E402
from tests.helpers.tiny_jobs import llama, rows  # noqa: E402


class Announce(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        print("TRAINING", flush=True)

    def on_step_end(self, args, state, control, **kw):
        print(f"STEP {state.global_step}", flush=True)


def main():
    out = sys.argv[1]
    if "--kill-in-save" in sys.argv:  # die after writing a checkpoint's files, before it is committed
        step = int(sys.argv[sys.argv.index("--kill-in-save") + 1])
        commit = ckpt.commit

        def commit_or_die(tmp, final, at_step, *rest):
            if at_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(tmp, final, at_step, *rest)

        ckpt.commit = commit_or_die
    background = "--async-save" in sys.argv
    if background:
        from stoker import background_save

        delay = float(sys.argv[sys.argv.index("--write-delay") + 1]) if "--write-delay" in sys.argv else 0.05
        wait = background_save.HostCopies.wait

        def late(self):
            time.sleep(delay)
            wait(self)

        background_save.HostCopies.wait = late
    model = llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    args = TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, logging_steps=1,
                             save_strategy="steps", save_steps=1, save_total_limit=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=40, learning_rate=1e-2, optim="adamw_torch",
                             seed=1, async_save=background)
    trainer = Trainer(model, args, train_dataset=rows(30, seed=2), callbacks=[Announce()])
    trainer.train(resume_from_checkpoint="last")  # started again and again: the first start has no checkpoint
    trainer.save_model(os.path.join(out, "final"))


if __name__ == "__main__":
    main()
