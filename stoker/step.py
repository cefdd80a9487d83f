"""The pieces of one optimizer step, passed explicitly instead of living in the Trainer's attributes: where the
loop stands in the data (`LoopPosition`) and how a run splits its global batch (`Layout`), the sums the loop keeps
between two logs (`LogSums`), what every process decides together after a window (`StepCheck`), the non-finite
policy (`NonFinitePolicy`), out-of-memory halving (`MicroBatchHalver`) and preemption signals. The step itself is
`Trainer._optimizer_step`; the run that owns these pieces is stoker.run.Run (docs/architecture.md, "The step")."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from . import diagnostics
from .errors import NonFiniteError
from .evaluation import split_batch
from .log import logger


class RunState(Protocol):
    """What the checkpointer and the spike rollback see of a run (stoker.run.Run): the model and optimizer as
    trained (a checkpoint writes them through the backend, in its layout), the TrainerState, and the one list of
    the run's state."""

    model: Any
    optimizer: Any
    state: Any

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def window_sizes(num_batches: int, accumulation: int) -> list[int]:
    """Micro-batches in each optimizer step of an epoch of num_batches: full windows, then a short one."""
    full, rest = divmod(num_batches, accumulation)
    return [accumulation] * full + ([rest] if rest else [])


def plan_steps(train_dataloader, accumulation: int, args) -> tuple[int, int | None]:
    """(max_steps, optimizer steps per epoch or None for a dataset without a length) of a run over the prepared
    loader of one process: max_steps when set, else num_train_epochs (which may be fractional) of epochs."""
    try:
        per_epoch = len(window_sizes(len(train_dataloader), accumulation))
    except TypeError:
        per_epoch = None
    if args.max_steps > 0:
        return args.max_steps, per_epoch
    if per_epoch is None:
        raise ValueError("max_steps must be > 0 for a dataloader without a length (an IterableDataset)")
    if not per_epoch:
        raise ValueError("train_dataset yields no full micro-batch (dataloader_drop_last=True with fewer rows "
                         f"than per_device_train_batch_size={args.per_device_train_batch_size})")
    return math.ceil(args.num_train_epochs * per_epoch), per_epoch


@dataclasses.dataclass
class LoopPosition:
    """Where the loop stands: the epoch, how many of its micro-batches are consumed, and the window's shape.

    `batches` counts micro-batches of `micro_batch` rows. With auto_find_batch_size an out-of-memory error
    halves the micro-batch (`halve`): the same samples then make twice as many micro-batches, so the count
    doubles and the loader is rebuilt at the same sample.
    """

    epoch: int
    batches: int
    micro_batch: int
    accumulation: int

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: dict[str, int]) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

    def halve(self) -> None:
        self.micro_batch //= 2
        self.accumulation *= 2
        self.batches *= 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run splits its global batch: data-parallel ranks x micro-batch x accumulation (with Accelerate's
    split_batches, the micro-batch is the loader's batch over every rank, split between them). The data-parallel
    ranks are the processes that read different rows: every process under DDP and FSDP, one per tensor-parallel
    group (whose ranks read the same rows).

    The seedable sampler's order does not depend on the layout, and Accelerate hands the data-parallel ranks
    consecutive micro-batches of it in turn, so optimizer step j of an epoch trains rows [j x G, (j + 1) x G) of
    that order whatever the layout of a global batch of G: two layouts of one global batch make the same steps of
    the same samples. That is what lets a checkpoint resume on another number of processes, or another parallel
    layout, as the same run.
    """

    world_size: int  # the data-parallel ranks
    micro_batch: int
    accumulation: int
    split_batches: bool = False

    @property
    def rows_per_micro_step(self) -> int:
        """Rows of one micro-batch over every process."""
        return self.micro_batch if self.split_batches else self.micro_batch * self.world_size

    @property
    def global_batch(self) -> int:
        return self.rows_per_micro_step * self.accumulation

    def __str__(self) -> str:
        if self.split_batches:
            return f"{self.global_batch} = {self.micro_batch} x {self.accumulation} split over {self.world_size}"
        return f"{self.global_batch} = {self.world_size} x {self.micro_batch} x {self.accumulation}"

    def keeping_global_batch(self, world_size: int) -> list[Layout]:
        """The layouts on `world_size` processes with this global batch, the ones closest to this micro-batch first
        (it is known to fit memory)."""
        per_step = self.global_batch if self.split_batches else self.global_batch / world_size
        if per_step != int(per_step) or (self.split_batches and per_step % world_size):
            return []
        per_step = int(per_step)
        micro = [m for m in range(1, per_step + 1) if per_step % m == 0
                 and (not self.split_batches or m % world_size == 0)]
        micro.sort(key=lambda m: (m > self.micro_batch, abs(m - self.micro_batch)))
        return [Layout(world_size, m, per_step // m, self.split_batches) for m in micro]


class LogSums:
    """What the loop sums between two logs, kept on the device so that a step needs no host sync: the window
    losses, input tokens and samples, the last gradient norm and learning rate, and non-finite step counts.
    The run-long totals (train_loss's numerator, tokens seen) are here too. Its `state_dict()` is part of the run's
    (a checkpoint and a rollback keep it); the timing fields never are (a resumed run times itself).
    """

    def __init__(self, device: torch.device, counts_pairs: bool = True):
        self.loss = torch.zeros((), device=device)
        self.steps, self.grad_norm, self.learning_rate = 0, None, None
        self.total_loss = 0.0  # every logged loss of the run, over every process: train_loss's numerator
        self.tokens = torch.zeros(2, dtype=torch.long, device=device)  # non-padding tokens, all tokens
        self.samples_seen, self.samples_at_log, self.tokens_seen = 0, 0, 0
        self.nonfinite_run, self.nonfinite_total = 0, 0
        self.nonfinite_at_log = 0  # nonfinite_total when the last log was made: the window's skipped steps
        self.data_clock, self.warned_data_wait, self.flops_shape = diagnostics.Stopwatch(device), False, None
        # sum of length^2 over the sequences since the last log (diagnostics.attention_pairs): MFU's attention
        # term, counted where MFU is reported (a GPU); a diagnostic, so not part of the run's state
        self.counts_pairs = counts_pairs
        self.attention_pairs = torch.zeros((), dtype=torch.long, device=device)
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing the period up to the next log; time spent evaluating and saving is `excluded` from it."""
        self.window_started, self.excluded = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.window_started - self.excluded, 1e-9)

    def add_step(self, window_loss: torch.Tensor, grad_norm: torch.Tensor | None = None,
                 learning_rate: float | None = None) -> None:
        self.loss += window_loss
        self.steps += 1
        if grad_norm is not None:
            self.grad_norm, self.learning_rate = grad_norm, learning_rate

    def count(self, batch: dict, num_processes: int) -> None:
        """Add a micro-batch's input tokens (on the device) and samples (over every process)."""
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        # non-padding tokens, an integer whatever the mask's dtype (float masks are integer-valued)
        non_padding = (mask.sum().round().long() if isinstance(mask, torch.Tensor)
                       else ids.numel() if isinstance(ids, torch.Tensor) else 0)
        # added in place, a count on the device as a tensor and one known on the host as a kernel argument: a
        # tensor made from a Python int would be a copy from the host that waits for the GPU
        for i, n in enumerate((non_padding, ids.numel() if ids is not None else non_padding)):
            self.tokens.select(0, i).add_(n.to(self.tokens.device) if isinstance(n, torch.Tensor) else n)
        if self.counts_pairs:
            pairs = diagnostics.attention_pairs(batch)
            self.attention_pairs.add_(pairs.to(self.tokens.device) if isinstance(pairs, torch.Tensor) else pairs)
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        self.samples_seen += first.shape[0] * num_processes if first is not None else 0

    def fold_tokens(self, accelerator, counting: str) -> tuple[int, int, int]:
        """Input tokens since the last call (non-padding, all), summed over every process and added to the run's
        count, and the tokens state.num_input_tokens_seen grows by as include_num_input_tokens_seen (`counting`)
        asks. A host sync, so done when logging and once at the end rather than per step."""
        counts = self.tokens.clone()
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts, reduction="sum") // accelerator.ranks_per_count  # a batch counted once
        tokens, all_tokens = (int(c) for c in counts.tolist())
        self.tokens.zero_()
        self.tokens_seen += tokens
        return tokens, all_tokens, tokens if counting == "non_padding" else all_tokens if counting == "all" else 0

    def logs(self, args, accelerator, model, learning_rate: float) -> tuple[dict[str, float], dict, int]:
        """The log of the steps since the last one (a host sync), as (logs, diagnostics, the tokens
        num_input_tokens_seen grows by). `logs` has
        transformers' keys: the mean loss over its applied steps (NaN where every step of the window was
        non-finite and skipped: its loss is not a number, where transformers makes up 0.0), the last gradient norm
        and learning rate (`learning_rate` if no step has recorded one), and the non-finite steps skipped so far
        if any.
        `diagnostics` holds stoker's wall-clock figures (throughput, where the time went), which differ between
        two identical runs and so stay out of log_history (metrics.jsonl has them). The sums restart, the
        clock with `restart_clock`."""
        steps = self.steps
        logged = self.reduce_loss(accelerator, args.average_tokens_across_devices) if steps else 0.0
        self.total_loss += logged
        tokens, all_tokens, seen = self.fold_tokens(accelerator, args.include_num_input_tokens_seen)
        elapsed, samples = self.elapsed(), self.take_samples()
        skipped, self.nonfinite_at_log = self.nonfinite_total - self.nonfinite_at_log, self.nonfinite_total
        logs = {"loss": logged / steps} if steps else {"loss": math.nan} if skipped else {}
        if self.grad_norm is not None:
            logs["grad_norm"] = float(self.grad_norm)
        if self.nonfinite_total:
            logs["nonfinite_steps_skipped"] = self.nonfinite_total
        logs["learning_rate"] = self.learning_rate if self.learning_rate is not None else learning_rate
        extra = {"tokens_per_second": round(tokens / elapsed, 2), "samples_per_second": round(samples / elapsed, 3),
                 **self.diagnostics(args, accelerator, model, tokens, all_tokens, samples, elapsed)}
        return logs, extra, seen

    def reduce_loss(self, accelerator, averaged_across_devices: bool) -> float:
        """Sum of the window losses since the last log (over every process), then reset. A host sync."""
        total = self.loss.clone()
        if accelerator.num_processes > 1:
            total = accelerator.reduce(total, reduction="sum")
            # each process's loss is a mean of its own, or a share of the batch its tensor-parallel group reads (a
            # context-parallel group's ranks each hold the share of their slice)
            total /= accelerator.num_processes if not averaged_across_devices else accelerator.ranks_per_loss
        self.loss.zero_()
        self.steps = 0
        return total.item()

    def take_samples(self) -> int:
        """Samples since the last call."""
        samples, self.samples_at_log = self.samples_seen - self.samples_at_log, self.samples_seen
        return samples

    def diagnostics(self, args, accelerator, model, tokens: int, all_tokens: int, samples: int,
                    elapsed: float) -> dict[str, float]:
        """Where a logging window's time went (stoker.diagnostics): the fraction spent waiting for data (warned
        about once above DATA_WAIT_WARNING) and, on a GPU, MFU and the peak of allocated memory so far."""
        on_gpu = accelerator.device.type == "cuda"
        out, advice = diagnostics.data_wait_metrics(self.data_clock.take(), elapsed, args, on_gpu)
        if advice is not None and not self.warned_data_wait:
            self.warned_data_wait = True
            logger.warning(advice)
        pairs, self.attention_pairs = self.attention_pairs, torch.zeros_like(self.attention_pairs)
        if not on_gpu:
            return out
        out["peak_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(accelerator.device) / 2**30, 3)
        peak = args.peak_tflops or diagnostics.peak_tflops(torch.cuda.get_device_name(accelerator.device),
                                                           diagnostics.matmul_precision(args.mixed_precision))
        if peak and samples:
            if self.flops_shape is None:  # parameter counts: computed once per run
                self.flops_shape = diagnostics.model_flops_shape(accelerator.unwrap_model(model))
            if accelerator.num_processes > 1:  # a collective, on logging steps only
                pairs = accelerator.reduce(pairs, reduction="sum")
            # attention per token from each sequence's own length (packed rows hold several, padding none):
            # sum(length^2) / tokens; a window without counted pairs (the first after a resume) uses the rows
            pairs = int(pairs)
            seq_len = pairs / tokens if pairs and tokens else all_tokens / samples
            per_token = diagnostics.flops_per_token(*self.flops_shape, seq_len=seq_len)
            out["mfu"] = round(diagnostics.mfu(tokens / elapsed, per_token, peak, accelerator.num_processes), 4)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last log, and the run's totals and non-finite counts."""
        return {"loss": self.loss, "steps": self.steps, "tokens": self.tokens, "total_loss": self.total_loss,
                "samples": self.samples_seen - self.samples_at_log, "nonfinite_total": self.nonfinite_total,
                "nonfinite_run": self.nonfinite_run, "nonfinite_at_log": self.nonfinite_at_log}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on with the sums `state_dict()` returned (the samples and tokens this call has seen keep counting:
        they time this call's throughput)."""
        device = self.loss.device
        self.loss, self.tokens = saved["loss"].to(device, copy=True), saved["tokens"].to(device, copy=True)
        self.steps, self.samples_seen = saved["steps"], self.samples_at_log + saved["samples"]
        self.total_loss = saved.get("total_loss", 0.0)
        self.nonfinite_total, self.nonfinite_run = saved["nonfinite_total"], saved["nonfinite_run"]
        # a checkpoint written before this count: the non-finite steps in a row up to it fall in its window
        self.nonfinite_at_log = saved.get("nonfinite_at_log", self.nonfinite_total - self.nonfinite_run)

    @staticmethod
    def regrouped(pendings: list[dict[str, Any]], saved_ranks_per_batch: int, world_size: int, ranks_per_batch: int,
                  rank: int, averaged_across_devices: bool) -> dict[str, Any]:
        """This process's share of the logs in progress that `pendings` (one per process of a checkpoint's run, whose
        tensor-parallel groups had `saved_ranks_per_batch` ranks) held, for a run on `world_size` processes in groups
        of `ranks_per_batch`: the next log then reports what it would have reported on the checkpoint's processes.

        The log divides its sums over processes (loss, tokens) by the ranks that read one batch (a tensor-parallel
        group counts its batch once per rank), or, with average_tokens_across_devices=False, the loss by the
        processes (each one's is a mean of its own). So each sum is first brought back to what the log would
        report, then handed to the ranks of data-parallel rank 0 of the new run as its log will divide it, every
        rank of that group holding the same, as the ranks of a tensor-parallel group do. The rest is the same on
        every process (step and sample counts, totals already reduced, the agreed non-finite counts)."""
        first = pendings[0]
        loss, tokens = sum(p["loss"] for p in pendings), sum(p["tokens"] for p in pendings)
        if averaged_across_devices:
            loss = loss / saved_ranks_per_batch
        else:  # the log divides by the processes, of which group 0 holds the sum
            loss = loss * world_size / (len(pendings) * ranks_per_batch)
        tokens = tokens // saved_ranks_per_batch
        if rank >= ranks_per_batch:  # not of data-parallel rank 0
            loss, tokens = torch.zeros_like(loss), torch.zeros_like(tokens)
        return {**first, "loss": loss, "tokens": tokens}


class PreemptionSignals:
    """While training, SIGTERM / SIGUSR1 only record the signal in `received`: the loop finishes the optimizer
    step, saves and exits. The handler never raises, so a second signal during the save cannot interrupt it.
    Outside the main thread (where Python cannot install handlers) or with `enabled` False, nothing changes."""

    def __init__(self, enabled: bool):
        self.enabled, self.received, self._previous = enabled, None, {}

    def __enter__(self) -> PreemptionSignals:
        if self.enabled and threading.current_thread() is threading.main_thread():
            wanted = [signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in wanted}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        self.received = signum


@contextlib.contextmanager
def neftune_noise(embeddings: torch.nn.Module | None, alpha: float | None):
    """NEFTune (neftune_noise_alpha): uniform noise on the input embeddings in training forwards, of bound
    alpha / sqrt(sequence length x width), drawn from torch's RNG (saved with checkpoints, so resumes stay
    exact). Nothing without an alpha."""
    if not alpha:
        yield
        return

    def add_noise(module, inputs, output):
        if not module.training:
            return output
        bound = alpha / math.sqrt(output.size(1) * output.size(2))
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    handle = embeddings.register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()


class StepVerdict(NamedTuple):
    """What every process agrees on after a window's backward."""

    finite: bool  # the window's loss and gradient norm are finite on every process
    finite_here: bool  # ... on this one
    preempted: int | None  # the signal to checkpoint and stop on, if any process has received one
    loss: float  # with reads_loss, the window's loss over every process (what the log shows for it), else NaN


class PendingStep(NamedTuple):
    """What the host keeps of a step until its verdict is read: its number, and its loss, gradient norm (device
    tensors) and learning rate for the log."""

    step: int
    loss: torch.Tensor
    grad_norm: Any
    learning_rate: float


class StepCheck:
    """The step's one check, whether its update may be applied (the window's loss and gradient norm finite on every
    process) and whether the run is being preempted: computed on the device, with one all-reduce of its flags on
    several processes, and read on the host from a copy of them.

    Deferred (`deferred`, decided once per run: an optimizer whose skip of an update on the device is exact, as
    torch's fused AdamW / Adam skip it for the GradScaler's `found_inf` (Backend.skips_on_device), on the plain
    backend without fp16 loss scaling), step k's update is queued with the flag that skips it on the device, and
    the host reads step k's verdict (`take`) only after step k+1's forwards and backwards are queued: the wait is
    for the flags' copy, which the GPU made before step k's update, so the GPU always has a step's work queued.
    The schedule and the log are then told of step k one step late, before step k+1's update (whose learning rate
    is so the right one). Otherwise the host reads the verdict right after the window (`take` at once: one host
    sync per step), and the update is applied only if it is finite.

    With `reads_loss` (spike_rollback), the window's loss over every process rides the same all-reduce and copy, to
    be compared with the running median of the windows before.

    The host copy is a numpy view of one host tensor (pinned on a GPU, where the copy is asynchronous and an event
    marks its end): reading it is a read of host memory, never a device sync of its own."""

    def __init__(self, accelerator, deferred: bool, check_grad_norm: bool, reads_loss: bool = False,
                 averaged_across_devices: bool = True):
        self.accelerator, self.deferred, self.check_grad_norm = accelerator, deferred, check_grad_norm
        # each process's loss is a mean of its own where the losses are not averaged over the processes' tokens,
        # else its share of the global batch, which the ranks of a tensor-parallel group hold alike (those of a
        # context-parallel group each the share of their slice: ranks_per_loss)
        sharing = accelerator.ranks_per_loss if averaged_across_devices else accelerator.num_processes
        self._loss_share = 1.0 / sharing if reads_loss else None
        on_gpu = accelerator.device.type == "cuda"
        self._host = torch.zeros(4, pin_memory=on_gpu)  # bad anywhere, signalled anywhere, loss, bad here
        self._values = self._host.numpy()
        self._event = torch.cuda.Event() if on_gpu else None
        self.pending: PendingStep | None = None
        self.preempted: int | None = None  # the agreed signal, from the last verdict read

    def queue(self, window_loss: torch.Tensor, grad_norm, step: int, learning_rate: float,
              received: int | None) -> torch.Tensor | None:
        """Queue the check of `step` (its flags computed, all-reduced on several processes, copied to the host) and
        keep the step pending until `take`. Returns the flag that skips the update on the device (1.0 where it is
        not finite on some process) when deferred, else None."""
        device = window_loss.device
        bad = ~torch.isfinite(window_loss)
        if self.check_grad_norm:  # with fp16 loss scaling, inf gradients are the scaler's business
            bad |= ~torch.isfinite(torch.as_tensor(grad_norm, device=device))
        flags = torch.zeros(4, device=device)
        flags[0] = bad  # a copy on the device, as below: no number comes from the host
        if self._loss_share is not None:
            flags[2] = window_loss.detach() * self._loss_share
        if self.accelerator.num_processes > 1:  # the check's one collective; a signal seen here counts everywhere
            flags[1].fill_(float(received is not None))
            flags[:3] = self.accelerator.reduce(flags[:3].clone(), reduction="sum")
        flags[3] = bad
        self._host.copy_(flags, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self.pending = PendingStep(step, window_loss, grad_norm, learning_rate)
        return (flags[0] > 0).float() if self.deferred else None

    def take(self, received: int | None) -> tuple[PendingStep, StepVerdict] | None:
        """The pending step and its verdict, or None when no step is pending. The host waits for the flags' copy
        only (already done when deferred: the GPU made it before the pending step's update)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        bad_anywhere, signalled, loss, bad_here = self._values
        if self.accelerator.num_processes == 1:  # alone, the signal is this process's own
            self.preempted = received
        else:  # a signal another process received reads as the scheduler's usual SIGTERM here
            self.preempted = (received or signal.SIGTERM) if signalled else None
        return pending, StepVerdict(not bad_anywhere, not bad_here, self.preempted,
                                    float(loss) if self._loss_share is not None else math.nan)


class NonFinitePolicy:
    """nonfinite_policy / max_nonfinite_steps: a step whose loss or gradient norm is not finite is skipped with a
    warning, or stops the run with NonFiniteError ("stop", too many in a row, or a backend that has applied the
    update already). The counts live in the LogSums, part of the run's state."""

    def __init__(self, args, backend):
        self.policy, self.limit, self.backend = args.nonfinite_policy, args.max_nonfinite_steps, backend

    def allows(self, verdict: StepVerdict, log: LogSums, window_loss: torch.Tensor, grad_norm, step: int,
               process_index: int) -> bool:
        """Whether the update of `step` is applied; raises NonFiniteError where the run must stop."""
        if verdict.finite:
            log.nonfinite_run = 0
            return True
        log.nonfinite_run += 1
        log.nonfinite_total += 1
        what = f"non-finite loss ({window_loss.item():.4g}) or gradient norm ({float(grad_norm):.4g}) at step {step}"
        if verdict.finite_here:
            what += f" on another process (this is process {process_index})"
        if self.backend.update_applied_despite_nonfinite():  # its own overflow check skips some, not all
            raise NonFiniteError(f"{what}; DeepSpeed has applied the update inside its engine, where it cannot be "
                                 "skipped: stopping")
        if self.policy == "stop":
            raise NonFiniteError(f"{what}; stopping (nonfinite_policy='stop')")
        if log.nonfinite_run >= self.limit:
            raise NonFiniteError(f"{what}: {log.nonfinite_run} non-finite steps in a row "
                                 f"(max_nonfinite_steps={self.limit}); stopping")
        logger.warning(f"{what}; update skipped")
        return False


class OutOfMemoryElsewhere(RuntimeError):
    """Another process ran out of memory in this window: every process drops the window and halves together."""


class MicroBatchHalver:
    """auto_find_batch_size, in one place. An out-of-memory error in a window reruns the same samples as twice as
    many micro-batches of half the size (`retry`); one in a callback after the update (`after_update`) halves
    the windows from the next on. Either way the update is unchanged (the loss is normalised over the window's
    target tokens, not over micro-batches), `position` follows, and the loop rebuilds its loader at the same
    sample. Any other error, or any without auto_find_batch_size, is raised.

    On several processes every process halves, or none: halving alone would leave one process rerunning the
    window's collectives while the others wait in the next ones (a hang). A process that runs out of memory in a
    window says so at the point every process reaches before the window's gradient all-reduce
    (`before_gradient_sync`, which the backend's backward of the window's last micro-batch calls): all of them
    then drop the window and rerun it halved. That covers an error in any forward (the last micro-batch's
    included) and in the backward of every micro-batch but the last; one inside the last backward, where the other
    processes wait in DDP's all-reduce, and one under FSDP (whose forward and backward hold collectives) cannot be
    agreed on: it is raised, with a message saying so, and the process's exit ends the others' collectives. The
    cost, on several processes only: a one-number all-reduce and host sync before the last backward of every
    window, and after on_step_end."""

    def __init__(self, enabled: bool, position: LoopPosition, state, accelerator=None, backend=None):
        self.enabled, self.position, self.state = enabled, position, state
        self.accelerator, self.backend = accelerator, backend
        self.processes = accelerator.num_processes if accelerator is not None else 1
        self.together = enabled and self.processes > 1  # halving is decided with the other processes
        # ... where they can agree on it (DDP): before the window's gradient all-reduce
        self.agreeing = self.together and backend.agrees_on_out_of_memory
        self._synced = False  # this attempt at the window has passed before_gradient_sync

    def retry(self, error: Exception, window: list[dict], optimizer) -> list[dict]:
        """The window to rerun after `error` in its forwards or backwards: the same samples as micro-batches of half
        the rows, the partial gradients dropped first; `error` raised where it is no out-of-memory error to halve
        on (or one the processes cannot agree on)."""
        optimizer.zero_grad(set_to_none=True)
        self._halve(self._agreed(error) if self.together else error)  # _agreed reads whether the sync was passed
        self._synced = False
        return [part for batch in window for part in split_batch(batch, self.position.micro_batch)]

    def window_done(self) -> None:
        """Where the processes agree on out-of-memory errors (`agreeing`), after a window that ran: its last backward
        must have gone through before_gradient_sync."""
        synced, self._synced = self._synced, False
        if not synced:
            raise RuntimeError(
                f"auto_find_batch_size on {self.processes} processes: the window's last backward did not go "
                "through the Trainer's backend (a training_step override that calls accelerator.backward "
                "itself?), where the processes agree on out-of-memory errors; call super().training_step, or "
                "self._backend.backward(loss), or set auto_find_batch_size=False")

    def before_gradient_sync(self) -> None:
        """Every process, before the backward of a window's last micro-batch (whose gradients DDP all-reduces):
        raises OutOfMemoryElsewhere if another process ran out of memory in this window."""
        if not self.agreeing:
            return
        self._synced = True
        if self._exchange(False):
            raise OutOfMemoryElsewhere("out of memory on another process in this window")

    @contextlib.contextmanager
    def after_update(self) -> Iterator[None]:
        error = None
        try:
            yield
        except Exception as e:
            if not self.together:
                self._halve(e)
                return
            if not (self.enabled and should_reduce_batch_size(e)):
                raise
            error = e
        if self.together and self._exchange(error is not None):  # every process reaches this point, every step
            self._halve(error or OutOfMemoryElsewhere("out of memory on another process after the update"))

    def _agreed(self, error: Exception) -> Exception:
        """On several processes, the error of a window once every process knows of it (they all halve), or raised
        where the processes cannot agree on it."""
        if isinstance(error, OutOfMemoryElsewhere):  # told at before_gradient_sync
            self.backend.abandon_window()
            return error
        if not should_reduce_batch_size(error):
            raise error
        where = f"out of memory on process {self.accelerator.process_index} of {self.processes}"
        if not self.agreeing:
            raise RuntimeError(
                f"{where}: auto_find_batch_size halves the micro-batch of several processes under DDP only; "
                f"{self.backend.kind} run's forward and backward hold collectives that the other processes are "
                f"waiting in. Lower per_device_train_batch_size (now {self.position.micro_batch})") from error
        if self._synced:
            raise RuntimeError(
                f"{where}, in the backward of the window's last micro-batch, while DDP all-reduces the gradients "
                "with the other processes: auto_find_batch_size cannot halve there on several processes (the others "
                "are waiting inside that all-reduce). Lower per_device_train_batch_size (now "
                f"{self.position.micro_batch}) or raise gradient_accumulation_steps") from error
        self._exchange(True)
        self.backend.abandon_window()
        return error

    def _exchange(self, out_of_memory_here: bool) -> bool:
        """Whether any process ran out of memory: a one-number all-reduce and a host sync."""
        flag = torch.tensor(float(out_of_memory_here), device=self.accelerator.device)
        return self.accelerator.reduce(flag, reduction="sum").item() > 0

    def _halve(self, error: Exception) -> None:
        pos = self.position
        if not (self.enabled and should_reduce_batch_size(error) or isinstance(error, OutOfMemoryElsewhere)):
            raise error
        if pos.micro_batch % 2:
            raise RuntimeError(f"out of memory with a micro-batch of {pos.micro_batch}: auto_find_batch_size "
                               "can only halve an even micro-batch (use a power of two)") from error
        clear_device_cache(garbage_collection=True)
        pos.halve()  # the loop rebuilds its loader, and sets state.train_batch_size, at the next window
        logger.warning(f"out of memory at step {self.state.global_step + 1}; micro-batch now "
                       f"{pos.micro_batch} x accumulation {pos.accumulation} (same update)")
