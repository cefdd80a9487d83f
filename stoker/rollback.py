"""Spike rollback (`spike_rollback=True`): a run that heals itself from a loss spike in-process.

A bad batch (corrupt rows, a rare sequence, a numerical blow-up) sends the loss up; Adam's moments absorb it and
the run may never recover. PaLM's remedy was manual (restart ~100 steps before the spike, skip 200-500 batches by
hand); Lightning's SpikeDetection and llm-foundry's KillLossSpike stop the run for a person to restart. Here the run
rolls back by itself:

    every step         the window's loss over every process rides the step's one check (step.StepCheck); the host
                       compares it with spike_factor x the median of the last spike_window accepted windows
                       (`SpikeDetector`, after spike_window steps); a non-finite loss or gradient norm is a spike too
    every spike_snapshot_steps steps   `SpikeRollback.snapshot`: the run's state (its one list of parts, stoker.run)
                       copied to host memory (as async_save copies it: no device memory, no disk)
    on a spike at k    the rows of step k's window (dataset indices, from the sampler's order of the epoch) recorded
                       in output_dir/quarantine.jsonl (fsynced first, so a crash mid-rollback keeps them), the
                       snapshot restored in place, and the loop goes on from the snapshot's step with the sampler
                       skipping the quarantined rows (`QuarantineSampler`): the next rows fill the batches.

A rollback restores the state a resume from a checkpoint taken at the snapshot's step would restore, so the run
goes on as that resume would, on the data without the quarantined rows: it ends equal (bit for bit on the CPU) to
the run trained from the start with those rows skipped, sampled in the same order (the sampler's order of every
epoch with them removed). Rows quarantined in epoch e were trained on in the epochs before e (they were not known
to be bad then), and a snapshot taken in an earlier epoch than the spike's has trained on them in that epoch; the
equality holds from there on.

Every process computes the same rows (the sampler's order is the same on every process; the window's rows are a
slice of it whatever the layout, see step.Layout), so the quarantine needs no collective of its own, and the
decision to roll back rides the step's existing all-reduce: every process rolls back together.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import math
import os
import statistics
from typing import Any

import torch

from .background_save import HostCopies
from .goodput import QUARANTINE_FILE, Mark, read_records
from .step import Layout, LoopPosition, RunState


class SpikeDetected(Exception):
    """Raised by the step's verdict on a spike; the loop catches it and rolls back (never seen by a user)."""

    def __init__(self, step: int, loss: float, median: float | None, reason: str):
        super().__init__(f"{reason} at step {step}")
        self.step, self.loss, self.median, self.reason = step, loss, median, reason


class SpikeDetector:
    """A window's loss is a spike when it is above `factor` x the median of the last `window` accepted windows
    (once there are `window` of them); a non-finite one always is. The losses are those the log shows (over every
    process), so every process decides the same."""

    def __init__(self, factor: float, window: int, losses: list[float] = ()):
        self.factor = factor
        self.losses: collections.deque[float] = collections.deque(losses, maxlen=window)

    def check(self, step: int, loss: float, finite: bool) -> None:
        """Accept the window's loss, or raise SpikeDetected."""
        if not finite or not math.isfinite(loss):
            raise SpikeDetected(step, loss, self.median(), "non-finite loss or gradient norm")
        median = self.median()
        if median is not None and loss > self.factor * median:
            raise SpikeDetected(step, loss, median, "loss spike")
        self.losses.append(loss)

    def median(self) -> float | None:
        if len(self.losses) < self.losses.maxlen:
            return None
        return statistics.median(self.losses)


class QuarantineSampler(torch.utils.data.Sampler):
    """The index sampler of a training loader without the quarantined rows: the wrapped sampler's order with them
    removed. Each epoch's order is kept (the latest two) so that the rows of a step's window can be named."""

    def __init__(self, sampler, quarantined: set[int]):
        self.sampler, self.quarantined = sampler, quarantined
        self.epoch = 0
        self.orders: dict[int, list[int]] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        order = [int(i) for i in self.sampler if int(i) not in self.quarantined]
        self.orders[self.epoch] = order
        for old in [e for e in self.orders if e < self.epoch - 1]:
            del self.orders[old]
        yield from order

    def __len__(self) -> int:
        return max(len(self.sampler) - len(self.quarantined), 0)


def index_sampler_holder(loader):
    """The batch sampler that holds `loader`'s index sampler (under Accelerate's sharding and skipping wrappers),
    or None for a loader without one (an IterableDataset, a loader of the user's own making)."""
    holder = getattr(loader, "batch_sampler", None)
    while holder is not None and hasattr(holder, "batch_sampler"):
        holder = holder.batch_sampler
    return holder if holder is not None and hasattr(holder, "sampler") else None


def install_quarantine(loader, quarantined: set[int]) -> QuarantineSampler | None:
    """Make `loader` skip the `quarantined` rows (a set shared with the caller, which adds to it later); returns
    the filter, or None where the loader has no index sampler to filter."""
    holder = index_sampler_holder(loader)
    if holder is None:
        return None
    if not isinstance(holder.sampler, QuarantineSampler):
        holder.sampler = QuarantineSampler(holder.sampler, quarantined)
    holder.sampler.quarantined = quarantined
    return holder.sampler


@dataclasses.dataclass
class Window:
    """The rows of one step's window: [start, stop) of the epoch's order, and how they were dealt out."""

    step: int
    epoch: int
    start: int
    stop: int
    layout: Layout

    def rank_of(self, position: int) -> int:
        """The process that trained the row at `position` of the epoch's order (Accelerate deals micro-batches to
        the processes in turn; split_batches splits each one between them)."""
        lay = self.layout
        if lay.split_batches:
            return (position % lay.micro_batch) // max(lay.micro_batch // lay.world_size, 1)
        return (position // lay.micro_batch) % lay.world_size


@dataclasses.dataclass
class Snapshot:
    """The run's state at the end of a step, in host memory: its parts' states with every tensor copied (the tree
    keeps everything else as it was, copied again each time it is put back)."""

    step: int
    tree: Any  # the parts' states, each tensor replaced by its key in `host`
    host: dict[str, torch.Tensor]
    ledger_mark: Mark | None = None  # the goodput ledger's step time at the snapshot


def _split(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """`state` with each tensor replaced by a key into `tensors` (where it is put), everything else copied."""
    if isinstance(state, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = state
        return _Tensor(key)
    if isinstance(state, dict):
        return {k: _split(v, tensors) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in state):
        return type(state)(_split(v, tensors) for v in state)
    return copy.deepcopy(state)


def _joined(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state `_split` took apart: its tensors from `tensors`, everything else a fresh copy."""
    if isinstance(tree, _Tensor):
        return tensors[tree.key]
    if isinstance(tree, dict):
        return {k: _joined(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and any(isinstance(v, (_Tensor, dict, list, tuple)) for v in tree):
        return type(tree)(_joined(v, tensors) for v in tree)
    return copy.deepcopy(tree)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    key: str


class SpikeRollback:
    """One run's spike rollback: the detector, the latest snapshot, the quarantined rows and their record.

    `quarantined` (dataset indices) is shared with the training loader's QuarantineSampler; `sources` maps a
    packed row to the rows it was packed from (stoker.packing), for the record."""

    def __init__(self, args, accelerator, run_id: str, quarantined: set[int], losses: list[float],
                 sources: list[list[int]] | None = None):
        self.args, self.accelerator, self.run_id = args, accelerator, run_id
        self.enabled = args.spike_rollback
        self.quarantined, self.sources = quarantined, sources
        self.detector = SpikeDetector(args.spike_factor, args.spike_window, losses)
        self.rollbacks = 0
        self.saved: Snapshot | None = None
        self.sampler: QuarantineSampler | None = None
        self.windows: collections.deque[Window] = collections.deque(maxlen=2)  # the steps whose verdict may be due
        self._copies = HostCopies()

    # -- its part of the run's state -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The quarantine and the detector's recent losses (a checkpoint keeps them in loop_state.json): a resumed
        run skips the same rows and checks its next windows as the run it continues would have."""
        return {"quarantine": sorted(self.quarantined), "spike_losses": list(self.detector.losses)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """The detector's recent losses as saved; the saved quarantine joins the rows quarantined since (a row once
        quarantined stays so: the rollback that restores an earlier state keeps the rows it found)."""
        self.quarantined.update(saved["quarantine"])
        self.detector.losses.clear()
        self.detector.losses.extend(saved["spike_losses"])

    @staticmethod
    def recorded(output_dir: str, run_id: str) -> list[dict[str, Any]]:
        """The quarantine records a run with this id wrote (a crash may have come between a record and the next
        checkpoint); a torn last line (killed mid-write) is ignored."""
        return [r for r in read_records(os.path.join(output_dir, QUARANTINE_FILE)) if r.get("run_id") == run_id]

    # -- every step ------------------------------------------------------------------------------------

    def install(self, loader) -> None:
        """The training loader (built anew after an out-of-memory halving) skips the quarantined rows."""
        self.sampler = install_quarantine(loader, self.quarantined)

    def window(self, step: int, pos: LoopPosition, micro_batches: int) -> None:
        """Step `step` trains `micro_batches` micro-batches from micro-batch pos.batches of epoch pos.epoch. The rows
        are dealt over the data-parallel ranks: the ranks of one tensor-parallel group read the same rows, so they
        count once (and are named by their group's data-parallel rank)."""
        acc = self.accelerator
        layout = Layout(acc.data_parallel_size, pos.micro_batch, pos.accumulation,
                        self.args.accelerator_config.split_batches)
        rows = layout.rows_per_micro_step
        self.windows.append(Window(step, pos.epoch, pos.batches * rows, (pos.batches + micro_batches) * rows, layout))

    def check_loss(self, step: int, loss: float, finite: bool) -> None:
        """The step's verdict: accepted, or SpikeDetected."""
        self.detector.check(step, loss, finite)

    # -- snapshots -------------------------------------------------------------------------------------

    def snapshot(self, run: RunState, ledger_mark: Mark | None = None) -> None:
        """Snapshot the run at the end of the current step (its verdict read and accepted): its state copied to host
        memory, into the previous snapshot's buffers."""
        host = self._copies.begin()
        tensors: dict[str, torch.Tensor] = {}
        tree = _split(run.state_dict(), tensors)
        self.saved = Snapshot(run.state.global_step, tree, host(tensors), ledger_mark)
        host.end()

    def restore(self, run: RunState) -> Snapshot:
        """Put the snapshot back in place through the run's list (weights, buffers, optimizer state and
        hyperparameters, schedule, scaler, TrainerState, callback states, loop position, log sums, the detector's
        recent losses, RNG states), the gradients of the step the spike interrupted dropped first. Returns it."""
        snap = self.saved
        self._copies.wait()
        run.optimizer.zero_grad(set_to_none=True)
        run.load_state_dict(_joined(snap.tree, snap.host))
        self.windows.clear()
        return snap

    def release(self) -> None:
        """At the end of the run: the host copies go."""
        self.saved = None
        self._copies.release()

    # -- a spike ---------------------------------------------------------------------------------------

    def quarantine(self, spike: SpikeDetected) -> dict[str, Any]:
        """Name the rows of the spike's window, add them to the quarantine and record them (main process: one
        line of quarantine.jsonl, fsynced before the rollback goes on). Returns the record."""
        window = next((w for w in self.windows if w.step == spike.step), None)
        order = self.sampler.orders.get(window.epoch) if window is not None and self.sampler is not None else None
        if order is None:
            raise RuntimeError(f"spike rollback: the rows of step {spike.step}'s window are not known")
        positions = range(window.start, min(window.stop, len(order)))
        indices = [order[p] for p in positions]
        record = {"step": spike.step, "restored_step": self.saved.step, "reason": spike.reason,
                  "loss": spike.loss if math.isfinite(spike.loss) else str(spike.loss),
                  "median": spike.median, "factor": self.detector.factor, "epoch": window.epoch,
                  "indices": indices, "ranks": [window.rank_of(p) for p in positions], "run_id": self.run_id}
        if self.sources is not None:  # packed rows: the rows they were packed from
            record["source_indices"] = [self.sources[i] for i in indices]
        self.quarantined.update(indices)
        self.rollbacks += 1
        if self.accelerator.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, QUARANTINE_FILE), "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record

    def describe(self, record: dict[str, Any]) -> str:
        """One line for the log about a rollback."""
        median = record["median"]
        what = (f"loss {record['loss']:.4g} > {self.detector.factor:g} x median {median:.4g}"
                if record["reason"] == "loss spike" else record["reason"])
        return (f"{record['reason']} at step {record['step']} ({what}): rolled back to step {record['restored_step']}, "
                f"{len(record['indices'])} rows quarantined ({QUARANTINE_FILE}); rollback {self.rollbacks} of "
                f"max_rollbacks={self.args.max_rollbacks}")

