"""The goodput ledger: where the wall time of one train() call went, as in Google's ML Goodput measurement.

One clock with a current part. The run starts in `startup`; the loop's steps count as `productive` (or as
`recomputed`, while a resumed run redoes the steps an earlier run of it had already reached); a named phase
(`with ledger.phase("evaluation"):`) counts its time to its own part, and phases nest (the inner one counts, the
outer one resumes when it ends). Some losses happen inside other parts and are known from counters that only grow:
the loop's wait for batches (`data_wait`, the LogSums' data clock) and torch.compile's compilation (`compile`,
torch._dynamo's own cumulative compile times). At each switch of part their growth since the last switch is moved
out of the part that was running, so the parts still add up to the wall time.

Nothing here runs per step: the loop's steps cost no call at all (a switch is made at an evaluation, a save, a
resume, a rollback), and a switch is a perf_counter read and a few additions, never a read of the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

from .checkpoint_format import checkpoint_step, list_checkpoints, read_json

# every part of the wall time, the productive one first; `time_<part>` in the run's final record
PARTS = ("productive", "startup", "compile", "data_wait", "evaluation", "checkpoint", "resume", "recomputed",
         "rollback", "other")
LOSSES = PARTS[1:]
METRICS_FILE = "metrics.jsonl"
QUARANTINE_FILE = "quarantine.jsonl"  # spike_rollback: one line per rollback, its step, the step restored, the rows


def compile_seconds() -> float:
    """torch._dynamo's cumulative compilation time in this process, in seconds: its frame compilations and its
    backward compilations (what torch._dynamo.utils.calculate_time_spent sums as total_wall_time). 0 before
    torch._dynamo is imported: nothing was compiled then (and reading it must not import it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    spent = getattr(utils, "cumulative_time_spent_ns", None) or {}
    return (spent.get("entire_frame_compile", 0) + spent.get("entire_backward_compile", 0)) / 1e9


@dataclasses.dataclass(frozen=True)
class Mark:
    """The ledger's step time when an in-memory snapshot of the run was taken (`Ledger.mark`)."""

    productive: float
    recomputed: float


class Ledger:
    """The wall time of one train() call split into productive step time and each loss (`PARTS`).

    `clock` is time.perf_counter unless a test gives its own; `counters` are the carved-out parts, each a function
    returning the cumulative seconds of that part (default: torch.compile's compilation time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 counters: dict[str, Callable[[], float]] | None = None):
        self.clock = clock
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._counters: dict[str, Callable[[], float]] = {}
        self._counted: dict[str, float] = {}
        for part, read in (counters if counters is not None else {"compile": compile_seconds}).items():
            self.count(part, read)
        self.started = self._since = clock()
        self._stack = ["startup"]  # the current part is the last; the first is the loop's own
        self.recompute_until = 0  # the furthest step an earlier run of this run reached (a resumed run redoes it)
        self.wall: float | None = None  # set by finish()

    @property
    def part(self) -> str:
        """The part the clock counts to now."""
        return self._stack[-1]

    def count(self, part: str, read: Callable[[], float]) -> None:
        """Carve `part` out of whatever part is running, from `read()`, its cumulative seconds (from now on)."""
        self._counters[part], self._counted[part] = read, read()

    def _switch(self) -> None:
        """Close the running segment: its time to the current part, less the carved-out parts' growth in it."""
        now = self.clock()
        segment, self._since = now - self._since, now
        for part, read in self._counters.items():
            total = read()
            # at most the segment itself: what a counter holds beyond it was not spent in this clock's time
            moved = min(max(total - self._counted[part], 0.0), segment)
            self._counted[part] = total
            self.seconds[part] += moved
            segment -= moved
        self.seconds[self._stack[-1]] += segment

    @contextlib.contextmanager
    def phase(self, part: str) -> Iterator[None]:
        """Count the time inside the block to `part`; the part it interrupts resumes after it."""
        if part not in self.seconds:
            raise ValueError(f"goodput part {part!r}: the parts are {', '.join(PARTS)}")
        self._switch()
        self._stack.append(part)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def begin_steps(self, step: int, data_clock=None) -> None:
        """The loop starts at `step`: startup ends, and the steps count as productive, or as recomputed up to
        `recompute_until` (then `caught_up`). `data_clock` (a diagnostics.Stopwatch) is the loop's wait for
        batches, carved out as data_wait."""
        self._switch()
        if self.recompute_until <= step:
            self.recompute_until = 0  # nothing to redo: no step of the loop equals 0
        self._stack[0] = "recomputed" if self.recompute_until else "productive"
        if data_clock is not None:
            self.count("data_wait", lambda: data_clock.total)

    def caught_up(self) -> None:
        """The step `recompute_until` is done: the steps from here on are new work."""
        self._switch()
        self._stack[0], self.recompute_until = "productive", 0

    def end_steps(self) -> None:
        """The loop is over: what follows (the run's metrics, the best model loaded back) counts as other."""
        self._switch()
        self._stack[0] = "other"

    def mark(self) -> Mark:
        """Taken with an in-memory snapshot of the run, for `rolled_back`."""
        self._switch()
        return Mark(self.seconds["productive"], self.seconds["recomputed"])

    def rolled_back(self, mark: Mark) -> None:
        """The run went back to the snapshot of `mark`: the step time since then is lost, counted as rollback (the
        restore itself goes in `with ledger.phase("rollback"):`)."""
        self._switch()
        for part, before in (("productive", mark.productive), ("recomputed", mark.recomputed)):
            lost = max(self.seconds[part] - before, 0.0)
            self.seconds[part] -= lost
            self.seconds["rollback"] += lost

    def finish(self) -> dict[str, float]:
        """The ledger of the run up to now, for the final record: `goodput` (the productive fraction of the wall
        time), `time_<part>` in seconds for every part, and `time_wall`, the wall time itself, measured from the
        ledger's start (train()'s entry) to now, which the parts add up to."""
        self._switch()
        self.wall = self._since - self.started
        out = {"goodput": round(self.seconds["productive"] / self.wall, 4) if self.wall > 0 else 0.0}
        out.update({f"time_{part}": round(seconds, 4) for part, seconds in self.seconds.items()})
        out["time_wall"] = round(self.wall, 4)
        return out


# ---------------------------------------------------------------------------------------------------
# a run's earlier records, and the ledger as people read it


def furthest_step(output_dir: str, run_id: str | None) -> int:
    """The furthest step that run `run_id` is known to have reached in output_dir: its newest checkpoint there and
    the last record with its id in metrics.jsonl (the loop logs every logging_steps; a checkpoint may be gone by
    rotation, or never written after the last one a crash left). 0 when nothing of it is there."""
    if not run_id:
        return 0
    steps = [0]
    for folder in list_checkpoints(output_dir):
        try:
            if read_json(folder, "loop_state.json").get("run_id") == run_id:
                steps.append(checkpoint_step(folder))
        except (OSError, ValueError):  # an incomplete checkpoint: the records below may still know its step
            continue
    for record in read_records(os.path.join(output_dir, METRICS_FILE)):
        if record.get("run_id") == run_id and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return max(steps)


def read_records(path: str) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line; a line a crash cut short (or any that is no JSON object) is
    left out, and a missing file has none."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def ledger_of(record: dict) -> dict[str, float]:
    """The part seconds of a record that holds a ledger (`finish()`'s keys), by part, in PARTS' order; {} for none."""
    return {part: float(record[f"time_{part}"]) for part in PARTS
            if isinstance(record.get(f"time_{part}"), (int, float)) and math.isfinite(record[f"time_{part}"])}


def format_seconds(seconds: float) -> str:
    """Seconds as people read them: 0.42 s, 52.1 s, 4 min 12 s, 2 h 05 min."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def summary_line(record: dict) -> str:
    """One line of a record's ledger: `goodput 87.3%: productive 52.1 s, startup 4.20 s, ...`, the parts that are
    not zero, largest loss first."""
    parts = ledger_of(record)
    losses = sorted(((p, s) for p, s in parts.items() if p != "productive" and s >= 0.005), key=lambda x: -x[1])
    shown = [("productive", parts.get("productive", 0.0)), *losses]
    return (f"goodput {100 * record.get('goodput', 0.0):.1f}%: "
            + ", ".join(f"{p.replace('_', ' ')} {format_seconds(s)}" for p, s in shown))
