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

import shutil
import threading
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
    that the checkpoint's files come out as a synchronous save writes them. The buffers are kept from one
    checkpoint to the next of the same shapes (allocating pinned memory costs more than copying into it), and
    released at the end of the run."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._used, self._seen, self._event = 0, {}, None

    def begin(self) -> HostCopies:
        self._used, self._seen, self._event = 0, {}, None
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
        buffer = self._buffers[self._used] if self._used < len(self._buffers) else None
        if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype) != (t.shape, t.stride(), t.dtype):
            buffer = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
            if self._used < len(self._buffers):
                self._buffers[self._used] = buffer
            else:
                self._buffers.append(buffer)
        self._used += 1
        from_cuda = t.device.type == "cuda"  # into pinned memory: the copy runs on the stream, in order
        buffer.copy_(t, non_blocking=from_cuda)
        if from_cuda and self._event is None:
            self._event = torch.cuda.Event()
        return buffer

    def end(self) -> None:
        """After the last copy of a snapshot: mark where the accelerator's copies end."""
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        """Writer thread: until the accelerator's copies have landed in host memory."""
        if self._event is not None:
            self._event.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def release(self) -> None:
        self._buffers = []
        self.begin()


class Job:
    """A checkpoint in flight: where it is written, and the main process's commit (with the rotation after it)."""

    def __init__(self, step: int, tmp: str, final: str, commit: Callable[[], None]):
        self.step, self.tmp, self.final, self.commit = step, tmp, final, commit
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
        if self._thread is not None:
            self._thread.join()
        self._job, self._thread, self._error = None, None, None
