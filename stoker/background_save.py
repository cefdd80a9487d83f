"""Checkpoints written in the background (async_save): the loop takes a snapshot of the checkpoint's state in host
memory and goes on training while a thread writes it; the commit follows the same temporary folder, fsync,
manifest and rename as a synchronous save (stoker.checkpoint_format).

The protocol, on every process, with at most one checkpoint in flight:

    save step N   (loop thread)  the synchronous save's agreements (finite parameters, the temporary folder made
                                 by the main process), then the snapshot: every tensor the checkpoint holds copied
                                 to host memory, every other value serialised; FSDP plans its shard files with
                                 every rank (torch.distributed.checkpoint's planning, a collective). The writer
                                 thread starts on the snapshot; the step returns.
    writer thread               writes this process's files into the temporary folder (safetensors, JSON; no
                                 collective ever: torch's process groups are the loop thread's alone). With one
                                 process it then commits (manifest, fsync, rename) and rotates.
    every step    (loop thread)  `poll`: with several processes, one all-reduce of (writing, failed) while a
                                 checkpoint is in flight. Once no process is writing: a failure anywhere raises
                                 CheckpointError on every process (the main one removes the partial folder);
                                 otherwise the main process's writer commits and rotates, and the next polls
                                 wait for that commit the same way. So every rank's files are on disk before the
                                 manifest is written, and no loop ever waits on another process's write.
    next save, end of train(), save_model()   `finish`: wait for this process's writer, then poll until the
                                 checkpoint is committed (or its failure raised).
    an error leaving the loop   `abandon`: wait for this process's writer (alone, it has committed); several
                                 processes cannot agree any more, and leave the uncommitted temporary folder,
                                 which the next run removes.

A process killed at any moment leaves at most an uncommitted temporary folder, as a synchronous save does.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Callable

import torch

from .errors import CheckpointError


def save_failed(failure: BaseException | None, tmp: str, final: str, is_main: bool) -> CheckpointError:
    """The error every process raises when a save failed on any of them (`failure`: this process's, or None when
    another one failed); the main process removes the partial folder first."""
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    why = (getattr(failure, "strerror", None) or failure) if failure is not None else (
        "another process could not write its part")
    return CheckpointError(f"saving {final} failed: {why}; the partial folder was removed and earlier checkpoints "
                           "are intact")


def any_on_every_process(accelerator, *flags: bool) -> list[bool]:
    """For each flag, whether it is set on any process (one all-reduce with several processes)."""
    if accelerator.num_processes == 1:
        return list(flags)
    summed = accelerator.reduce(torch.tensor([float(f) for f in flags], device=accelerator.device), reduction="sum")
    return [v > 0 for v in summed.tolist()]


class HostCopies:
    """Copies of a snapshot's tensors in host memory: pinned, and copied without waiting, from an accelerator (the
    writer waits for them; the loop's next kernels on the stream run after them anyway); cloned on the CPU. A
    tensor seen twice (tied weights, one `step` tensor shared by an optimizer's parameters) is copied once, so
    that the checkpoint's files come out as a synchronous save writes them.

    The buffers are kept from one checkpoint to the next (matched by shape and dtype) and released at the end of
    the run: allocating host memory, and pinned memory most of all, costs more than copying into it, and memory
    touched for the first time faults in page by page. `reserve` allocates and touches them in a thread once the
    run has taken its first step, so that the first checkpoint's snapshot copies into memory the process already
    has; buffers the first snapshot does not use are dropped after it."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}  # buffers the snapshot in progress has not taken
        self._taken: list[torch.Tensor] = []
        self._seen, self._event = {}, None
        self._reserving: threading.Thread | None = None
        self._snapshots = 0
        self.copied = self.allocated = 0  # bytes of the last snapshot: copied, and of buffers allocated for it

    def reserve(self, specs: list[tuple[tuple[int, ...], torch.dtype]], pinned: bool) -> None:
        """Allocate and touch, in a thread, a buffer for each (shape, dtype) a snapshot is expected to copy."""

        def allocate():
            for shape, dtype in specs:
                buffer = torch.empty(shape, dtype=dtype, pin_memory=pinned)
                buffer.zero_()  # its pages mapped now, not during the snapshot
                self._free.setdefault((shape, dtype), []).append(buffer)

        self._reserving = threading.Thread(target=allocate, name="stoker-checkpoint-buffers", daemon=True)
        self._reserving.start()

    @property
    def reserving(self) -> bool:
        """Whether the reserved buffers are still being allocated."""
        return self._reserving is not None and self._reserving.is_alive()

    def _settle(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def begin(self) -> HostCopies:
        """Before a snapshot: every buffer is free again."""
        self._settle()
        for buffer in self._taken:
            self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)
        self._taken, self._seen, self._event = [], {}, None
        self.copied = self.allocated = 0
        return self

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                   t.device) if t.numel() else None
            if key is None or key not in self._seen:
                copied = self._copy(t.detach())
                if key is None:
                    out[name] = copied
                    continue
                self._seen[key] = copied
            out[name] = self._seen[key]
        return out

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        from_cuda = t.device.type == "cuda"  # into pinned memory: the copy runs on the stream, in order
        free = self._free.get((tuple(t.shape), t.dtype))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=from_cuda)
            self.allocated += buffer.nbytes
        self.copied += buffer.nbytes
        self._taken.append(buffer)
        buffer.copy_(t, non_blocking=from_cuda)
        if from_cuda and self._event is None:
            self._event = torch.cuda.Event()
        return buffer

    def end(self) -> None:
        """After the last copy of a snapshot: mark where the accelerator's copies end; after the first, drop the
        reserved buffers it did not use."""
        if self._event is not None:
            self._event.record()
        self._snapshots += 1
        if self._snapshots == 1:
            self._free = {}

    def wait(self) -> None:
        """Writer thread: until the accelerator's copies have landed in host memory."""
        if self._event is not None:
            self._event.synchronize()

    def release(self) -> None:
        self._settle()
        self._free, self._taken, self._seen, self._event, self._snapshots = {}, [], {}, None, 0


# the share of the time between two saves that a background write is spread over: the checkpoint is committed
# half an interval after its step, long before the next save would wait for it
COMPLETION_TARGET = 0.5
# the longest a write is spread over, in seconds: a checkpoint not yet committed is lost to a crash, so with saves
# hours apart it is still committed within a minute of its step; spread over a minute, a write's rate is already
# too low to slow the loop
MAX_SPREAD_S = 60.0


class Pace:
    """Spreads a background write of about `nbytes` over COMPLETION_TARGET of `interval` seconds, the time
    expected until the next save, and at most MAX_SPREAD_S (PostgreSQL spreads a checkpoint's writes over
    its interval the same way, checkpoint_completion_target): the writer reports each chunk it writes or hashes
    and sleeps while it is ahead. A write at full speed takes the memory bandwidth and the CPU time the training
    loop needs, most visibly where the host has few cores (benchmarks/checkpoint.py's "write step" ratio shows
    it); spread out, it takes them a little at a time. `hurry` lifts it for good, for whoever waits for the write."""

    def __init__(self, nbytes: int, interval: float):
        seconds = min(COMPLETION_TARGET * interval, MAX_SPREAD_S)
        self.rate = nbytes / seconds if seconds > 0 else math.inf
        self._start, self._done = time.perf_counter(), 0
        self._hurried = threading.Event()

    def __call__(self, nbytes: int) -> None:
        self._done += nbytes
        ahead = self._done / self.rate - (time.perf_counter() - self._start)
        if ahead > 0:
            self._hurried.wait(ahead)

    def hurry(self) -> None:
        self._hurried.set()


class Job:
    """A checkpoint in flight: where it is written, the main process's commit (with the rotation after it), and
    the pace of its write."""

    def __init__(self, step: int, tmp: str, final: str, commit: Callable[[], None], pace: Pace):
        self.step, self.tmp, self.final, self.commit, self.pace = step, tmp, final, commit, pace
        self.committing = False  # several processes: every rank's files are written, the main one commits


class BackgroundWriter:
    """One process's writer of checkpoints in the background: one thread per checkpoint, at most one in flight
    (see the module docstring for the protocol). Methods other than `busy` are called by the loop thread of every
    process at the same points."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.copies = HostCopies()
        self._job: Job | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    @property
    def busy(self) -> bool:
        """Whether this process's thread is still writing."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Job, write: Callable[[], None]) -> None:
        """Write a snapshot in the background (`write`: this process's files); alone, commit it there too."""
        assert self._job is None, "one checkpoint in flight at a time"
        self._job = job
        alone = self.accelerator.num_processes == 1

        def files_then_commit():
            write()
            if alone:
                job.commit()

        self._run(files_then_commit)

    def _run(self, work: Callable[[], None]) -> None:
        self._error = None

        def target():
            try:
                work()
            except BaseException as e:  # raised in the loop at the next poll
                self._error = e

        self._thread = threading.Thread(target=target, name="stoker-checkpoint-writer", daemon=True)
        self._thread.start()

    def poll(self, wait: bool = False) -> None:
        """Every process, loop thread: advance the checkpoint in flight (`wait`: for this process's writer first).
        Raises CheckpointError on every process when any failed to write or commit it."""
        job = self._job
        if job is None:
            return
        if wait and self._thread is not None:
            job.pace.hurry()
            self._thread.join()
        busy = self.busy
        failure = None if busy else self._error
        writing, failed = any_on_every_process(self.accelerator, busy, failure is not None)
        if writing:
            return
        acc = self.accelerator
        if failed:
            self._job = None
            raise save_failed(failure, job.tmp, job.final, acc.is_main_process) from failure
        if acc.num_processes > 1 and not job.committing:  # every rank's files are on disk: the main one commits
            job.committing = True
            self._error, self._thread = None, None
            if acc.is_main_process:
                self._run(job.commit)
            return
        self._job = None

    def finish(self) -> None:
        """Every process: the checkpoint in flight committed (or its failure raised)."""
        while self._job is not None:
            self.poll(wait=True)

    def abandon(self) -> None:
        """After an error in the loop: wait for this process's writer, without agreeing with the others."""
        if self._job is not None:
            self._job.pace.hurry()
        if self._thread is not None:
            self._thread.join()
        self._job, self._thread, self._error = None, None, None
