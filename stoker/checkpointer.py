"""Saving and resuming a Trainer's run: checkpoint-<step> folders written by every rank and committed atomically,
rotation (save_total_limit), RNG and loop state, and the checks that keep a resume exact or refuse it.

The file format (safetensors + JSON, never a pickle; the atomic commit and its verification) is
stoker.checkpoint_format's; what each kind of run writes of its model and optimizer state (whole, FSDP shards,
ZeRO partitions) is its backend's (stoker.distributed.backends). This module puts them together for a Trainer.

A checkpoint folder holds: the model (save_pretrained's files, or the config of what FSDP shards are the weights
of), every rank's shards or partitions when the backend has them, optimizer.json (a whole optimizer state),
scheduler.json, scaler.json (fp16), process_<rank>.json (RNG states and the loss sums not logged yet),
trainer_state.json, training_args.json, loop_state.json (where the data stream stands and the settings an exact
resume needs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import checkpoint_format as ckpt
from .background_save import BackgroundWriter, HostCopies, Job, Pace, any_on_every_process, save_failed
from .callbacks import TrainerState
from .errors import CheckpointError, NonFiniteError, NotACheckpointError
from .log import logger
from .step import Layout, LogSums, LoopPosition, RunState


def save_model(output_dir: str, accelerator, backend, model, processing_class, args) -> None:
    """Every rank: the model for use outside stoker in `output_dir` (save_pretrained's files, or safetensors +
    stoker_model.json for a plain module; a peft model's adapter only), the processing class and the arguments."""
    state_dict = backend.state_dict_for_saving(model)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        ckpt.save_weights(accelerator.unwrap_model(model), output_dir, state_dict=state_dict)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(output_dir)
        ckpt.write_json(output_dir, "training_args.json", args.to_dict())
    accelerator.wait_for_everyone()


def _copied(state: Any, copy: HostCopies) -> Any:
    """`state` as it is now: the same structure, its tensors copied to host memory and its other values fixed."""
    tree, tensors = ckpt.flatten(state)
    return ckpt.unflatten(tree, copy(tensors))


# resume_from_checkpoint's "the newest checkpoint in output_dir, or a new run where there is none" (as Lightning's
# ckpt_path="last"): what a job that is started again and again (SLURM's requeue) passes on every start
RESUME_LAST = "last"


def resolve_resume(resume, args) -> str | None:
    """The checkpoint folder to resume from, for train(resume_from_checkpoint=...) or args' resume_from_checkpoint:
    None (a new run), True (the newest complete checkpoint in output_dir), "last" (the same, or a new run where
    output_dir holds none: a requeued job's first start) or a path. Refuses (CheckpointError) an incomplete or
    corrupted folder (NotACheckpointError, also a ValueError, as transformers raises for a folder it cannot
    resume from), one written with save_only_model, True with no complete checkpoint in output_dir (as
    transformers: a mistyped output_dir must not train from scratch), and, for True or "last", an output_dir
    holding the checkpoints of more than one run."""
    if resume is None or resume is False:
        resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "false"):  # from a flag or a config file
        resume = resume.lower() == "true"
    if resume is None or resume is False:
        # a new run, also into an output_dir that holds an earlier run's checkpoints (as transformers 5): each
        # checkpoint it writes replaces one of the same step atomically (see Checkpointer.rotate for the rest)
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == RESUME_LAST):
        complete = []
        for path in reversed(ckpt.list_checkpoints(args.output_dir)):
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
                f"resume_from_checkpoint=True: output_dir={args.output_dir!r} holds the checkpoints of "
                f"{len(runs)} different runs ({listing}), and resuming the newest could continue another run "
                "than the last one: pass the checkpoint to resume as resume_from_checkpoint='<path>', or "
                "remove the other run's checkpoints")
        if complete:
            return resumable(complete[0])
        if resume is True:  # transformers' words first: scripts and its tests match them
            raise NotACheckpointError(
                f"No valid checkpoint found in output directory ({args.output_dir}): resume_from_checkpoint=True "
                f"needs a complete checkpoint there; for a job whose first start has none (a requeued job), pass "
                f"resume_from_checkpoint='{RESUME_LAST}' (the newest checkpoint, or a new run where there is none)")
        logger.info(f"no complete checkpoint in {args.output_dir}; starting from scratch")
        return None
    problem = ckpt.verify(resume) if os.path.isdir(resume) else "no such folder"
    if problem:
        # transformers' words first (scripts and its tests match them), then what is wrong with the folder
        raise NotACheckpointError(f"Can't find a valid checkpoint at {resume}: resume_from_checkpoint={resume!r}: "
                                  f"{problem}")
    return resumable(resume)


def saved_layout(loop: dict[str, Any]) -> Layout:
    """The layout a checkpoint's run had (from its loop state; split_batches is recorded since elastic resume, the
    data-parallel size since parallel layouts resume: every process was one before)."""
    return Layout(loop.get("data_parallel_size", loop["world_size"]), loop["per_device_train_batch_size"],
                  loop["gradient_accumulation_steps"], loop.get("split_batches", False))


def ranks_per_batch(loop: dict[str, Any]) -> int:
    """The processes of a checkpoint's run that read the same rows (its tensor-parallel group; 1 without one)."""
    return loop["world_size"] // loop.get("data_parallel_size", loop["world_size"])


def run_layout(world: int, parallelism: dict[str, int] | None, data_parallel: int) -> str:
    """A run's layout as resume messages name it: "2 processes", or "2 processes with parallelism_config={'tp_size':
    2} (1 data-parallel rank)" where the model is sharded by its plans."""
    if not parallelism:
        return processes(world)
    return f"{processes(world)} with parallelism_config={parallelism!r} ({ranks(data_parallel)})"


def resume_settings(folder: str, backend, args, dataset_len: int | None, pos: LoopPosition) -> dict[str, Any]:
    """Before a resumed run is set up: its checkpoint's loop state (loop_state.json), once the checkpoint is known
    to be of a kind this run can load (sharded, DeepSpeed, whole) and written with settings that keep the resume
    exact.

    The same global batch in another layout (another number of processes, another parallel layout: tensor
    parallelism or FSDP2 by the model's plans, another split into micro-batch and accumulation) is the same run
    (see Layout: counted in data-parallel ranks) and goes on, saying both layouts. A changed global batch, dataset
    length or seed is refused, naming the layouts that keep the global batch (or, with resume_mismatch='warn',
    reported). With auto_find_batch_size, `pos` adopts the micro-batch the checkpoint's run settled on when the
    layout is otherwise the same."""
    backend.check_checkpoint(folder)
    loop = ckpt.read_json(folder, "loop_state.json")
    acc = backend.accelerator
    saved, world = saved_layout(loop), acc.data_parallel_size  # the ranks that read different rows
    split = args.accelerator_config.split_batches
    if (args.auto_find_batch_size and saved.world_size == world and saved.split_batches == split
            and saved.global_batch == Layout(world, pos.micro_batch, pos.accumulation, split).global_batch):
        pos.micro_batch, pos.accumulation = saved.micro_batch, saved.accumulation  # the size that fit memory
    now = Layout(world, pos.micro_batch, pos.accumulation, split)
    changed = [f"{k}={loop.get(k)!r} (now {v!r})" for k, v in (("data_seed", args.data_seed), ("seed", args.seed),
                                                               ("train_dataset_len", dataset_len))
               if loop.get(k) != v]
    parallel = loop.get("parallelism") or backend.sharding  # either side sharded by the model's plans
    terms, noun = (PARALLEL_LAYOUT_TERMS, ranks) if parallel else (LAYOUT_TERMS, processes)
    batch_changed = saved.global_batch != now.global_batch
    # both layouts, where the processes alone do not say how many ranks read different rows
    was = run_layout(loop["world_size"], loop.get("parallelism"), saved.world_size)
    here = run_layout(acc.num_processes, backend.sharding, world)
    if batch_changed:
        changed.insert(0, f"global batch {saved} on {was} (now {now} on {here}; {terms})" if parallel
                       else f"global batch {saved} (now {now}; {terms})")
    if changed:
        what = f"{folder} was written with {', '.join(changed)}: resuming cannot reproduce the original run"
        if args.resume_mismatch == "error":
            how = (keep_global_batch(saved, world, noun) + (" and restore the other settings" if len(changed) > 1
                                                            else "")
                   if batch_changed else "restore those settings")
            raise CheckpointError(f"{what}; {how}, or set resume_mismatch='warn' to continue from the same sample "
                                  "with the new settings")
        logger.warning(f"{what}; continuing from the same sample with the new settings (resume_mismatch='warn')")
    elif (saved != now or loop.get("parallelism") != backend.sharding) and acc.is_main_process:
        logger.info(f"resuming a checkpoint of {was} on {here}: global batch {now}, unchanged ({terms})" if parallel
                    else f"resuming a {loop['world_size']}-process checkpoint on {here}: global batch {now}, unchanged "
                    f"({terms})")
    return loop


LAYOUT_TERMS = "processes x per_device_train_batch_size x gradient_accumulation_steps"
# where a model is sharded by its plans, the ranks of a tensor-parallel group read the same rows and count once
PARALLEL_LAYOUT_TERMS = "data-parallel ranks x per_device_train_batch_size x gradient_accumulation_steps"


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def ranks(n: int) -> str:
    return f"{n} data-parallel rank" if n == 1 else f"{n} data-parallel ranks"


def keep_global_batch(saved: Layout, world_size: int, noun: Callable[[int], str] = processes) -> str:
    """How to keep a checkpoint's global batch: the flags of the layouts on `world_size` processes (or
    data-parallel ranks: `noun` names them) that keep it, or, if there is none, the numbers that can."""
    def flags(layout: Layout) -> str:
        return (f"--per_device_train_batch_size {layout.micro_batch} "
                f"--gradient_accumulation_steps {layout.accumulation}")

    here = saved.keeping_global_batch(world_size)
    if here:
        others = ", ".join(f"{layout.micro_batch} x {layout.accumulation}" for layout in here[1:4])
        return (f"keep its global batch of {saved.global_batch} on {noun(world_size)} with {flags(here[0])}"
                + (f" (or per-device batch x accumulation {others})" if others else ""))
    elsewhere = [(n, layouts[0]) for n in range(1, saved.global_batch + 1)
                 if (layouts := saved.keeping_global_batch(n))]
    nearest = sorted(elsewhere, key=lambda item: abs(item[0] - world_size))[:3]
    return (f"no layout of {noun(world_size)} makes its global batch of {saved.global_batch}: resume on "
            + ", on ".join(f"{noun(n)} with {flags(layout)}" for n, layout in nearest))


class Checkpointer:
    """Saves one run (one train() call) as checkpoint folders and restores it from them.

    Built for the run with what stays fixed through it (the arguments, the Accelerator, the backend, the run's id,
    the train set's length); what a checkpoint holds is the run's one list of parts (`RunState.state_dict()`,
    stoker.run), each written to its file. Methods that say "every rank" must be called by all processes.
    """

    def __init__(self, args, backend, run_id: str, dataset_len: int | None, writer: BackgroundWriter | None = None):
        self.args, self.backend, self.accelerator = args, backend, backend.accelerator
        self.run_id, self.dataset_len = run_id, dataset_len
        self.last_saved_step: int | None = None  # the step of this run's newest checkpoint
        # async_save's writer (the Trainer's, so that save_model waits for the checkpoint in flight too)
        self.writer = writer if writer is not None else BackgroundWriter(backend.accelerator)
        self._waits = 0  # saves that found the previous checkpoint still being written
        self._reserved = False  # async_save's host buffers (reserved after the first step)
        self._last_save_at: float | None = None  # async_save: when the last save (or the first step) was

    # -- saving ------------------------------------------------------------------------------------------

    def open_output_dir(self) -> None:
        """Main process, before the run's first step: create output_dir and remove the temporary folders of saves
        that a killed process never committed."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        for stale in ckpt.stale_temp_dirs(self.args.output_dir):
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, run: RunState) -> str:
        """Every rank: write output_dir/checkpoint-<global_step> and commit it atomically, then rotate; returns
        its path. Refuses (NonFiniteError) a model with non-finite parameters; a failure on any rank raises
        CheckpointError on all of them and leaves earlier checkpoints and no partial folder. With async_save the
        checkpoint's state is taken now and written in the background (stoker.background_save): a failure is
        raised at a later step (`poll`) or at the end of the run, with the same message."""
        a, s, acc, backend, model = self.args, run.state, self.accelerator, self.backend, run.model
        final = ckpt.checkpoint_dir(a.output_dir, s.global_step)
        tmp = ckpt.temp_dir_for(final)
        self._wait_for_previous_write(s.global_step)
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
        copy = self.writer.copies.begin() if a.async_save else None
        write = None
        try:  # the state of this step, taken now (FSDP plans its shard files with every rank: a collective)
            write = self._snapshot(tmp, state_dict, run, copy)
            if copy is None:
                write()
        except Exception as e:  # safetensors reports a failed write as SafetensorError, not OSError
            failure = e
        self._all_saved(failure, tmp, final)
        self.last_saved_step = s.global_step
        pace = None
        if copy is not None:  # the write spread over part of the time to the next save (expected as long as the
            copy.end()        # time since the last one)
            now = time.perf_counter()
            pace, self._last_save_at = Pace(copy.copied, now - (self._last_save_at or now)), now
        best = s.best_model_checkpoint
        commit = functools.partial(ckpt.commit, tmp, final, s.global_step, write.hashes, pace)
        if copy is not None:
            self.writer.start(Job(s.global_step, tmp, final, lambda: (commit(), self.rotate(best)), pace),
                              functools.partial(write, pace))
            return final
        try:
            if acc.is_main_process:
                commit()
        except OSError as e:
            failure = e
        self._all_saved(failure, tmp, final)
        if acc.is_main_process:
            self.rotate(best)
        acc.wait_for_everyone()
        return final

    def _snapshot(self, tmp: str, state_dict: dict | None, run: RunState,
                  copy: HostCopies | None) -> Callable[[], None]:
        """Every rank: the state this rank writes of the checkpoint, taken now, and the write of it into `tmp`: every
        part of the run (the model and optimizer through the backend; the parts that differ between processes into
        process_<rank>; the others, by the main process, into their files). `copy` (async_save): every tensor
        copied to host memory and every other value serialised now, so that the write stores this step's state
        while training goes on; None: the write runs at once."""
        a, acc, backend = self.args, self.accelerator, self.backend
        parts = run.state_dict()
        rank_parts = backend.rank_parts(tmp, run.model, run.optimizer, copy)  # a collective where it has one
        states = []  # (name, state): <name>.json + <name>.safetensors
        if not a.save_only_model:
            states.append((f"process_{acc.process_index}", {PROCESS_FILE_KEYS.get(name, name): value
                                                            for name, value in parts.items() if name not in SHARED}))
        main = acc.is_main_process
        if main and not a.save_only_model:
            optimizer = backend.optimizer_state(run.optimizer)
            if optimizer is not None:
                states.append(("optimizer", optimizer))
            states += [(name, parts[name]) for name in ("scheduler", "scaler") if name in parts]
        state = dataclasses.replace(run.state, stateful_callbacks=parts["callbacks"])
        texts = {"trainer_state.json": state.to_json_string(), "training_args.json": ckpt.json_text(a.to_dict()),
                 "loop_state.json": ckpt.json_text(self.loop_state(parts["position"], parts.get("spike")))
                 } if main else {}
        if copy is not None:
            if main and state_dict is None and backend.writes_full_model(run.model):
                # a peft model (whose save_pretrained picks the adapter from the model): its trainable parameters
                state_dict = {n: p for n, p in acc.unwrap_model(run.model).named_parameters() if p.requires_grad}
            if main and state_dict is not None:
                state_dict = copy(state_dict)
            states = [(name, _copied(state, copy)) for name, state in states]

        def write(pace: Pace | None = None) -> None:
            if copy is not None:
                copy.wait()
            rank_parts()
            if main:
                backend.write_model(tmp, run.model, state_dict)
            for name, state in states:
                write.hashes.update(ckpt.save_state(tmp, name, state, pace))
            for name, text in texts.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)

        write.hashes = {}  # the sha256 of the files hashed as they were written, for the manifest
        return write

    def _wait_for_previous_write(self, step: int) -> None:
        """Before an async save: the previous checkpoint committed (at most one is in flight), with one warning
        once saves have come faster than a checkpoint is written more than once."""
        if not self.writer.in_flight:
            return
        busy, started = self.writer.busy, time.perf_counter()
        self.writer.finish()
        if not busy:
            return
        self._waits += 1
        if self._waits == 2 and self.accelerator.is_main_process:
            logger.warning(f"async_save: the save at step {step} waited {time.perf_counter() - started:.1f} s for the "
                           f"previous checkpoint's write, more than once: saves come more often than a checkpoint "
                           f"is written (save_steps={self.args.save_steps}); raise save_steps to train without "
                           "waiting")

    def poll(self, run: RunState) -> None:
        """Every rank, every step: advance the checkpoint written in the background, raising its failure
        (CheckpointError) here (with several processes, one all-reduce while a checkpoint is in flight). After the
        run's first step (the optimizer has its state), async_save's host buffers are reserved."""
        self.writer.poll()
        if self.args.async_save and not self._reserved:
            self._reserved, self._last_save_at = True, time.perf_counter()
            self.writer.copies.reserve(self._snapshot_specs(run), pinned=self.accelerator.device.type == "cuda")

    def _snapshot_specs(self, run: RunState) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The (shape, dtype) of each tensor this process's snapshot is expected to copy, from the model and the
        optimizer's state: the model's (a peft model's trainable) tensors where this process writes them, whole or
        as its shards, and the optimizer's state where it writes that. An estimate: the first snapshot's own
        tensors take over after it."""
        acc, backend, model = self.accelerator, self.backend, run.model
        specs = []

        def add(tensors, sharded: bool) -> None:
            for t in tensors:
                t = t.to_local() if sharded and hasattr(t, "to_local") else t  # a DTensor's shard
                specs.append((tuple(t.shape), t.dtype))

        whole = backend.writes_full_model(model)
        if acc.is_main_process or not whole:
            module = acc.unwrap_model(model)
            add([p for p in module.parameters() if p.requires_grad] if ckpt.is_peft_model(module)
                else list(module.parameters()) + list(module.buffers()), sharded=not whole)
        if not self.args.save_only_model:
            sharded = backend.optimizer_state(run.optimizer) is None
            if acc.is_main_process or sharded:
                add([v for state in run.optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor)], sharded)
        return specs

    @contextlib.contextmanager
    def background_writes(self):
        """The run's loop: on leaving it, the checkpoint written in the background committed (or its failure
        raised); after an error, its write waited for (committed with one process; several cannot agree any
        more and leave the temporary folder, which the next run removes). The host buffers go with the run."""
        try:
            yield
            self.writer.finish()
        except BaseException:
            self.writer.abandon()
            raise
        finally:
            self.writer.copies.release()

    def rotate(self, best: str | None) -> None:
        """Main process: apply save_total_limit to this run's checkpoints only (those an earlier run left in
        output_dir are kept, as transformers keeps them), keeping the best one; with overwrite_output_dir, remove
        the earlier runs' checkpoints once this run has a complete checkpoint of its own."""
        a = self.args
        mine, others = [], []
        for path in ckpt.list_checkpoints(a.output_dir):
            (mine if run_of(path) == self.run_id else others).append(path)
        ckpt.rotate(a.output_dir, a.save_total_limit, keep=best, among=mine)
        if a.overwrite_output_dir:
            for path in others:
                shutil.rmtree(path, ignore_errors=True)

    def keep_only_best(self, best: str | None) -> None:
        """At the end of train(), with save_total_limit=1 and a best checkpoint, as transformers: remove this run's
        other checkpoints (the newest was kept during the run so that it could be resumed). Main process."""
        if self.args.save_total_limit != 1 or best is None or not self.accelerator.is_main_process:
            return
        best = os.path.abspath(best)
        for path in ckpt.list_checkpoints(self.args.output_dir):
            if run_of(path) == self.run_id and os.path.abspath(path) != best:
                shutil.rmtree(path, ignore_errors=True)

    def _all_saved(self, failure: Exception | None, tmp: str, final: str) -> None:
        """Raise CheckpointError on every rank if any rank failed to write its part (a collective)."""
        acc = self.accelerator
        if any_on_every_process(acc, failure is not None)[0]:
            raise save_failed(failure, tmp, final, acc.is_main_process) from failure

    def layout(self, pos: LoopPosition) -> Layout:
        """This run's layout at `pos` (auto_find_batch_size may have halved the micro-batch)."""
        return Layout(self.accelerator.data_parallel_size, pos.micro_batch, pos.accumulation,
                      self.args.accelerator_config.split_batches)

    def loop_state(self, position: dict[str, int], spike: dict[str, Any] | None) -> dict[str, Any]:
        """Where the data stream stands (the run's position part), and the settings that must not change for an
        exact resume: the global batch and its layout, and the position in samples of the epoch, which any layout
        of that global batch resumes (see Layout); with the spike rollback's part, its quarantine and recent
        losses."""
        a, layout = self.args, self.layout(LoopPosition(**position))
        return {
            "epoch": position["epoch"],
            "batches_in_epoch": position["batches"],
            "samples_in_epoch": position["batches"] * layout.rows_per_micro_step,
            "global_batch": layout.global_batch,
            "data_seed": a.data_seed,
            "world_size": self.accelerator.num_processes,  # the process_<rank> parts written
            "data_parallel_size": layout.world_size,
            "parallelism": self.backend.sharding,
            "seed": a.seed,
            "per_device_train_batch_size": position["micro_batch"],  # as run: auto_find_batch_size may halve it
            "gradient_accumulation_steps": position["accumulation"],
            "split_batches": layout.split_batches,
            "train_dataset_len": self.dataset_len,
            "run_id": self.run_id,
            "save_only_model": a.save_only_model,
            **(spike or {}),
        }

    # -- resuming ----------------------------------------------------------------------------------------

    def replanned_steps(self, folder: str, loop: dict[str, Any], start: LoopPosition, batches_per_epoch: int,
                        per_epoch: int) -> int | None:
        """max_steps for an epoch-based run resumed with another global batch (resume_mismatch='warn'): the steps
        taken, then those of the new global batch up to where the checkpoint's run was to end (num_train_epochs of
        data). None when the global batch is kept, or max_steps is set (which counts steps, whatever their size)."""
        now = self.layout(start)
        if self.args.max_steps > 0 or saved_layout(loop).global_batch == now.global_batch:
            return None
        done = ckpt.read_json(folder, "trainer_state.json")["global_step"]
        skip = min(batches_to_skip(loop, now, self.args.ignore_data_skip), batches_per_epoch)
        left = (self.args.num_train_epochs - loop["epoch"]) * per_epoch - skip / start.accumulation
        return done + max(math.ceil(left), 0)

    def restore(self, folder: str, loop: dict[str, Any], run: RunState, start: LoopPosition) -> None:
        """Every rank: continue the run from `folder`, whose loop state resume_settings returned: the model and
        optimizer through the backend, then every other part the checkpoint holds handed to the run's
        `load_state_dict` (the schedule, scaler, TrainerState's progress, callback states with
        restore_callback_states_from_checkpoint, where the loop goes on in `start`'s layout, the log's sums, the
        quarantine, this process's random streams). On another number of processes, or another grouping of them
        into tensor-parallel groups, the per-process parts are regrouped: the logs' sums dealt out (LogSums.regrouped),
        the random streams of the same data-parallel rank taken where the data-parallel ranks are as many, else
        reseeded (see `reseed`)."""
        acc, a = self.accelerator, self.args
        self.backend.load_training_state(folder, run.model, run.optimizer)
        saved = TrainerState.from_dict(ckpt.read_json(folder, "trainer_state.json"))
        parts: dict[str, Any] = {"scheduler": ckpt.load_state(folder, "scheduler"), "trainer_state": vars(saved)}
        if acc.scaler is not None and os.path.exists(os.path.join(folder, "scaler.json")):
            parts["scaler"] = ckpt.load_state(folder, "scaler")
        if a.restore_callback_states_from_checkpoint:
            parts["callbacks"] = saved.stateful_callbacks
        skip = batches_to_skip(loop, self.layout(start), a.ignore_data_skip)
        parts["position"] = dataclasses.replace(start, epoch=loop["epoch"], batches=skip).state_dict()
        if "quarantine" in loop:
            parts["spike"] = {"quarantine": loop["quarantine"], "spike_losses": loop.get("spike_losses", [])}
        group, saved_ranks = ranks_per_batch(loop), saved_layout(loop).world_size
        if loop["world_size"] == acc.num_processes and group == acc.ranks_per_batch:
            own = ckpt.load_state(folder, f"process_{acc.process_index}")  # its own random streams and log
        else:  # the per-process parts regrouped (the ranks of a tensor-parallel group hold the same ones)
            rank = acc.process_index // acc.ranks_per_batch  # data-parallel
            own = ckpt.load_state(folder, f"process_{rank % saved_ranks * group}")
            if saved_ranks != acc.data_parallel_size:  # no rank's streams are this one's (see reseed)
                reseed(a.seed, saved.global_step, rank)
                own["rng"] = rng_state()
            pendings = [ckpt.load_state(folder, f"process_{r}")["pending_log"] for r in range(loop["world_size"])]
            own["pending_log"] = LogSums.regrouped(pendings, group, acc.num_processes, acc.ranks_per_batch,
                                                   acc.process_index, a.average_tokens_across_devices)
        parts.update({PART_OF_PROCESS_KEY.get(key, key): value for key, value in own.items()})
        run.load_state_dict(parts)
        if acc.is_main_process:
            logger.info(f"resumed from {folder} at step {saved.global_step}")


# the run's parts written once for every process (by the main process, or by the backend in its layout); every
# other part is each process's own, in process_<rank>, under its part's name but for the log's (an older name)
SHARED = frozenset({"model", "optimizer", "scheduler", "scaler", "trainer_state", "callbacks", "position", "spike"})
PROCESS_FILE_KEYS = {"log": "pending_log"}
PART_OF_PROCESS_KEY = {v: k for k, v in PROCESS_FILE_KEYS.items()}


def batches_to_skip(loop: dict[str, Any], now: Layout, ignore_data_skip: bool) -> int:
    """The micro-batches of each process to skip in the resumed epoch, in the layout `now`: the same samples as
    the checkpoint's run consumed when the global batch is kept; after a change (resume_mismatch='warn'), up to
    the first micro-batch at or after the checkpoint's sample, so that no sample is trained twice in the epoch."""
    if ignore_data_skip:
        return 0
    consumed = loop.get("samples_in_epoch", loop["batches_in_epoch"] * saved_layout(loop).rows_per_micro_step)
    return -(-consumed // now.rows_per_micro_step)


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


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed this process's random number generators (Python's, numpy's, torch's on every device) from the run's
    seed, the step and the data-parallel rank (the same for the ranks of a tensor-parallel group, whose replicated
    computation draws alike), for a run resumed on another number of data-parallel ranks: the checkpoint's per-process
    streams cannot be dealt out to another number of processes (and the micro-batches they drew for, dropout's
    among them, differ in shape), so each process starts a stream of its own that the same resume draws again."""
    state = np.random.SeedSequence([seed, step, rank]).generate_state(2)
    random.seed(int(state[0]))
    np.random.seed(int(state[1]))
    torch.manual_seed(int(state[0]) << 32 | int(state[1]))  # and every CUDA device's


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states `rng_state` returned (as read back from a checkpoint's JSON)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def parameters_finite(accelerator, model) -> bool:
    """Whether every parameter is finite, decided together by all ranks (each checks its own shards: an FSDP2 DTensor's
    local part, a ZeRO-3 parameter's partition). A sum is finite only if every value is, so one float32 sum per
    tensor and one host sync decide (a reduction that writes one number per tensor, where isfinite over every
    value writes a mask as large as the model and reads it back); only where a sum is not finite (a non-finite
    value, or an overflow of huge ones) are that tensor's values checked one by one."""
    def own(p):
        return p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p

    tensors = [t for t in map(own, model.parameters()) if t.numel()]
    sums = [t.sum(dtype=torch.float32) for t in tensors]
    local = not sums or bool(torch.isfinite(torch.stack([s.to(sums[0].device) for s in sums])).all())
    if not local:
        local = all(bool(torch.isfinite(t).all()) for t in tensors)
    if accelerator.num_processes == 1:
        return local
    flag = torch.tensor(0.0 if local else 1.0, device=accelerator.device)
    return accelerator.reduce(flag, reduction="sum").item() == 0
