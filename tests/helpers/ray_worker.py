"""The function each Ray Train worker runs in tests/distributed/test_ray_train.py (a module of its own, so that the
workers import it by name: with the repository on PYTHONPATH, as the test's runtime_env sets)."""

from __future__ import annotations

import os

ROWS = 8  # one optimizer step covers every row (2 workers x 4), so the sampler's order cannot matter
SETTINGS = dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_steps=4, logging_steps=1,
                eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, disable_tqdm=True,
                report_to="none", seed=7)


def train_func(config: dict) -> None:
    """What a user's Ray Train function holds: build the Trainer, hand it to Ray, train from Ray's newest
    checkpoint if it holds one. With config["fail_after"], each worker's first attempt dies right after the
    checkpoint of that step is reported, as a lost node would."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from stoker import Trainer, TrainerCallback, TrainingArguments
    from stoker.data import PaddingCollator
    from tests.parity.families import FAMILIES, rows

    class FailOnce(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            marker = os.path.join(config["out"], f"failed.{args.process_index}")
            if state.global_step == config.get("fail_after") and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError(f"worker {args.process_index} lost after step {state.global_step}")

    args = TrainingArguments(output_dir=config["out"], per_device_train_batch_size=ROWS // 2, **SETTINGS)
    trainer = Trainer(FAMILIES["llama"](0), args, train_dataset=rows("llama", ROWS, 1),
                      eval_dataset=rows("llama", 6, 2), data_collator=PaddingCollator())
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(FailOnce())  # after Ray's, which has reported the checkpoint by then
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as folder:
            trainer.train(resume_from_checkpoint=os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))
