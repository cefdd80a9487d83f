"""Saving and resuming a Trainer's run: checkpoint-<step> folders written by every rank and committed atomically,
rotation (save_total_limit), RNG and loop state, and the checks that keep a resume exact or refuse it.

The file format (safetensors + JSON, never a pickle; the atomic commit and its verification) is stoker.checkpoint's;
what each kind of run writes of its model and optimizer state (whole, FSDP shards, ZeRO partitions) is its
backend's (stoker.distributed.backends). This module puts them together for a Trainer.

A checkpoint folder holds: the model (save_pretrained's files, or the config of what FSDP shards are the weights
of), every rank's shards or partitions when the backend has them, optimizer.json (a whole optimizer state),
scheduler.json, scaler.json (fp16), process_<rank>.json (RNG states and the loss sums not logged yet),
trainer_state.json, training_args.json, loop_state.json (where the data stream stands and the settings an exact
resume needs).
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from .callbacks import TrainerState, callback_states, restore_callback_states
from .distributed.launch import parameters_finite
from .errors import CheckpointError, NonFiniteError
from .log import logger
from .loop import LoopPosition, RunningLog


class Checkpointer:
    """Saves a Trainer's run as checkpoint folders and restores it from them.

    It reads what it saves from the trainer when called (args, state, accelerator, its backend, model_wrapped,
    optimizer, lr_scheduler, callbacks, _run_id) and from the loop's position and running log, which the loop
    passes in (stoker.loop); it keeps no state of its own. Methods that say "every rank" must be called by all
    processes.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    # -- saving ------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str) -> None:
        """Every rank: the model for use outside stoker in `output_dir` (save_pretrained's files, or safetensors +
        stoker_model.json for a plain module; a peft model's adapter only), the processing class and the
        arguments."""
        t = self.trainer
        acc = t.accelerator
        state_dict = t._backend.state_dict_for_saving(t.model_wrapped)
        if acc.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            ckpt.save_weights(acc.unwrap_model(t.model_wrapped), output_dir, state_dict=state_dict)
            if t.processing_class is not None and hasattr(t.processing_class, "save_pretrained"):
                t.processing_class.save_pretrained(output_dir)
            ckpt.write_json(output_dir, "training_args.json", t.args.to_dict())
        acc.wait_for_everyone()

    def save(self, pos: LoopPosition, run: RunningLog) -> str:
        """Every rank: write output_dir/checkpoint-<global_step> and commit it atomically, then rotate; returns
        its path. Refuses (NonFiniteError) a model with non-finite parameters; a failure on any rank raises
        CheckpointError on all of them and leaves earlier checkpoints and no partial folder."""
        t = self.trainer
        a, s, acc, backend, model = t.args, t.state, t.accelerator, t._backend, t.model_wrapped
        final = ckpt.checkpoint_dir(a.output_dir, s.global_step)
        tmp = ckpt.temp_dir_for(final)
        if s.best_global_step == s.global_step:  # (an evaluation after this save sets it in _evaluate_and_track)
            s.best_model_checkpoint = final
        t.store_flos()
        s.stateful_callbacks = callback_states(t.callback_handler.callbacks, t.control)
        if not parameters_finite(acc, model):  # decided by every rank together
            raise NonFiniteError(f"refusing to save {os.path.basename(final)}: the model has non-finite parameters")
        # a sharded model's checkpoint holds every rank's shards, and the full model only if asked for (a peft
        # adapter, small, always)
        state_dict = backend.state_dict_for_saving(model) if backend.writes_full_model(model) else None
        # every rank writes part of the folder: a rank's failure (a full disk, a permission error, state that
        # cannot be stored) is shared with all before they go on, and nothing half-written stays behind
        failure = None
        try:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except OSError as e:
            failure = e
        self._all_saved(failure, tmp, final)
        try:
            backend.save_rank_parts(tmp, model, t.optimizer)  # a collective where the backend has one
            if acc.is_main_process:
                self._write_main_files(tmp, state_dict, pos)
            if not a.save_only_model:
                ckpt.save_state(tmp, f"process_{acc.process_index}",
                                {"rng": rng_state(), "pending_log": run.pending()})
        except Exception as e:  # safetensors reports a failed write as SafetensorError, not OSError
            failure = e
        self._all_saved(failure, tmp, final)
        try:
            if acc.is_main_process:
                ckpt.commit(tmp, final, s.global_step)
        except OSError as e:
            failure = e
        self._all_saved(failure, tmp, final)
        if acc.is_main_process:
            self.rotate()
        acc.wait_for_everyone()
        t._fire("on_save")
        return final

    def rotate(self) -> None:
        """Main process: apply save_total_limit to this run's checkpoints only (those an earlier run left in
        output_dir are kept, as transformers keeps them), keeping the best one; with overwrite_output_dir, remove
        the earlier runs' checkpoints once this run has a complete checkpoint of its own."""
        t = self.trainer
        a, s = t.args, t.state
        mine, others = [], []
        for path in ckpt.list_checkpoints(a.output_dir):
            (mine if run_of(path) == t._run_id else others).append(path)
        ckpt.rotate(a.output_dir, a.save_total_limit, keep=s.best_model_checkpoint, among=mine)
        if a.overwrite_output_dir:
            for path in others:
                shutil.rmtree(path, ignore_errors=True)

    def keep_only_best(self) -> None:
        """At the end of train(), with save_total_limit=1 and a best checkpoint, as transformers: remove this run's
        other checkpoints (the newest was kept during the run so that it could be resumed). Main process."""
        t = self.trainer
        a, s = t.args, t.state
        if a.save_total_limit != 1 or s.best_model_checkpoint is None or not t.accelerator.is_main_process:
            return
        best = os.path.abspath(s.best_model_checkpoint)
        for path in ckpt.list_checkpoints(a.output_dir):
            if run_of(path) == t._run_id and os.path.abspath(path) != best:
                shutil.rmtree(path, ignore_errors=True)

    def _write_main_files(self, tmp: str, state_dict: dict | None, pos: LoopPosition) -> None:
        """The main process's part of a checkpoint: the model (or what its shards are the weights of), the
        optimizer state when it is whole, and the scheduler, scaler, trainer and loop state."""
        t = self.trainer
        acc, a, s = t.accelerator, t.args, t.state
        t._backend.write_model(tmp, t.model_wrapped, state_dict)
        if not a.save_only_model:
            t._backend.save_optimizer(tmp, t.optimizer)
            ckpt.save_state(tmp, "scheduler", t.lr_scheduler.state_dict())
            if acc.scaler is not None:
                ckpt.save_state(tmp, "scaler", acc.scaler.state_dict())
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            f.write(s.to_json_string())
        ckpt.write_json(tmp, "training_args.json", a.to_dict())
        ckpt.write_json(tmp, "loop_state.json", self.loop_state(pos))

    def _all_saved(self, failure: Exception | None, tmp: str, final: str) -> None:
        """Raise CheckpointError on every rank if any rank failed to write its part (a collective)."""
        acc = self.trainer.accelerator
        failed = failure is not None
        if acc.num_processes > 1:
            failed = acc.reduce(torch.tensor(float(failed), device=acc.device), reduction="sum").item() > 0
        if not failed:
            return
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        why = (getattr(failure, "strerror", None) or failure) if failure is not None else (
            "another process could not write its part")
        raise CheckpointError(f"saving {final} failed: {why}; the partial folder was removed and earlier "
                              "checkpoints are intact") from failure

    def loop_state(self, pos: LoopPosition) -> dict[str, Any]:
        """Where the data stream stands, and the settings that must not change for an exact resume."""
        t = self.trainer
        a = t.args
        return {
            "epoch": pos.epoch,
            "batches_in_epoch": pos.batches,
            "data_seed": a.data_seed,
            "world_size": t.accelerator.num_processes,
            "seed": a.seed,
            "per_device_train_batch_size": pos.micro_batch,  # as run: auto_find_batch_size may have halved it
            "gradient_accumulation_steps": pos.accumulation,
            "train_dataset_len": len(t.train_dataset) if hasattr(t.train_dataset, "__len__") else None,
            "run_id": t._run_id,
            "save_only_model": a.save_only_model,
        }

    # -- resuming ----------------------------------------------------------------------------------------

    def resolve(self, resume) -> str | None:
        """The checkpoint folder to resume from, for train(resume_from_checkpoint=...) or args'
        resume_from_checkpoint: None (a new run), True (the newest complete checkpoint in output_dir, if any) or
        a path. Refuses (CheckpointError) an incomplete or corrupted folder, one written with save_only_model,
        and, for True, an output_dir holding the checkpoints of more than one run."""
        a = self.trainer.args
        if resume is None or resume is False:
            resume = a.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() in ("true", "false"):  # from a flag or a config file
            resume = resume.lower() == "true"
        if resume is None or resume is False:
            # a new run, also into an output_dir that holds an earlier run's checkpoints (as transformers 5): each
            # checkpoint it writes replaces one of the same step atomically (see rotate for the rest)
            return None
        if resume is True:
            complete = []
            for path in reversed(ckpt.list_checkpoints(a.output_dir)):
                problem = ckpt.verify(path)
                if problem is None:
                    complete.append(path)
                else:
                    logger.warning(f"skipping {path}: {problem}")
            runs = {}
            for path in complete:
                runs.setdefault(run_of(path), []).append(os.path.basename(path))
            if len(runs) > 1:  # the newest by step may be the other run's: which run goes on is not the user's call
                listing = "; ".join(", ".join(sorted(names, key=ckpt.checkpoint_step)) for names in runs.values())
                raise CheckpointError(
                    f"resume_from_checkpoint=True: output_dir={a.output_dir!r} holds the checkpoints of "
                    f"{len(runs)} different runs ({listing}), and resuming the newest could continue another run "
                    "than the last one: pass the checkpoint to resume as resume_from_checkpoint='<path>', or "
                    "remove the other run's checkpoints")
            if complete:
                return resumable(complete[0])
            logger.info(f"no complete checkpoint in {a.output_dir}; starting from scratch")
            return None
        problem = ckpt.verify(resume) if os.path.isdir(resume) else "no such folder"
        if problem:
            raise CheckpointError(f"resume_from_checkpoint={resume!r}: {problem}")
        return resumable(resume)

    def check_kind(self, folder: str) -> None:
        """Refuse a checkpoint written by another kind of run (FSDP, DeepSpeed, data-parallel) than this one."""
        self.trainer._backend.check_checkpoint(folder)

    def check_resume_settings(self, loop: dict[str, Any], folder: str, pos: LoopPosition) -> None:
        """Refuse (or, with resume_mismatch='warn', report) settings that make the resume inexact. With
        auto_find_batch_size, adopts the micro-batch the checkpoint's run settled on when the product matches."""
        t = self.trainer
        a = t.args
        saved_micro, saved_acc = loop["per_device_train_batch_size"], loop["gradient_accumulation_steps"]
        if a.auto_find_batch_size and saved_micro * saved_acc == pos.micro_batch * pos.accumulation:
            pos.micro_batch, pos.accumulation = saved_micro, saved_acc  # the size that fit memory
        now = {"per_device_train_batch_size": pos.micro_batch, "gradient_accumulation_steps": pos.accumulation,
               "world_size": t.accelerator.num_processes, "data_seed": a.data_seed, "seed": a.seed,
               "train_dataset_len": len(t.train_dataset) if hasattr(t.train_dataset, "__len__") else None}
        changed = [f"{k}={loop[k]!r} (now {v!r})" for k, v in now.items() if loop.get(k) != v]
        if not changed:
            return
        what = f"{folder} was written with {', '.join(changed)}: resuming cannot reproduce the original run"
        if a.resume_mismatch == "error":
            raise CheckpointError(f"{what}; restore those settings, or set resume_mismatch='warn' to continue")
        logger.warning(f"{what}; continuing with the new settings (resume_mismatch='warn')")

    def resume_skip(self, loop: dict[str, Any], pos: LoopPosition) -> int:
        """Micro-batches of the current size to skip in the resumed epoch (the same samples, if sizes match)."""
        consumed = loop["batches_in_epoch"] * loop["per_device_train_batch_size"] * loop["world_size"]
        return consumed // (pos.micro_batch * self.trainer.accelerator.num_processes)

    def load_model_weights(self, folder: str) -> None:
        """Every rank: the weights of a checkpoint of this kind of run into the model (load_best_model_at_end)."""
        t = self.trainer
        t._backend.load_weights(folder, t.model_wrapped)

    def load(self, folder: str, run: RunningLog) -> None:
        """Every rank: restore everything `save` wrote but the data position (see resume_skip): weights,
        optimizer, scheduler and scaler state, the TrainerState's progress, callback states (with
        restore_callback_states_from_checkpoint), this process's RNG states and the loss sums not logged yet."""
        t = self.trainer
        acc = t.accelerator
        t._backend.load_training_state(folder, t.model_wrapped, t.optimizer)
        t.lr_scheduler.load_state_dict(ckpt.load_state(folder, "scheduler"))
        if acc.scaler is not None and os.path.exists(os.path.join(folder, "scaler.json")):
            acc.scaler.load_state_dict(ckpt.load_state(folder, "scaler"))
        saved = TrainerState.from_dict(ckpt.read_json(folder, "trainer_state.json"))
        s = t.state
        for name in ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
                     "best_global_step", "best_model_checkpoint", "stateful_callbacks"):
            setattr(s, name, getattr(saved, name))
        if t.args.restore_callback_states_from_checkpoint:
            missing = restore_callback_states(t.callback_handler.callbacks, s.stateful_callbacks)
            if missing:
                logger.warning(f"{folder} holds the state of callbacks {missing}, which this Trainer does not have; "
                               "their state is not restored")
        own = ckpt.load_state(folder, f"process_{acc.process_index}")
        set_rng_state(own["rng"])
        run.restore(own["pending_log"])


def resumable(folder: str) -> str:
    """`folder`, if a run can resume from it; CheckpointError for one written with save_only_model."""
    loop = ckpt.read_json(folder, "loop_state.json")
    if loop.get("save_only_model"):
        raise CheckpointError(f"{folder} was written with save_only_model=True: it holds the model only (no "
                              "optimizer, scheduler or RNG state) and cannot be resumed; load its weights "
                              "(from_pretrained) to start a new run, or save without save_only_model")
    return folder


def run_of(checkpoint: str) -> str | None:
    """The id of the run that wrote a checkpoint (None for one written before stoker recorded it)."""
    try:
        return ckpt.read_json(checkpoint, "loop_state.json").get("run_id")
    except (OSError, ValueError):
        return None


def rng_state() -> dict[str, Any]:
    """This process's random number generator states: Python's, numpy's, torch's CPU and CUDA ones."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states `rng_state` returned (as read back from a checkpoint's JSON)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
