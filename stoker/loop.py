"""The training loop's own state, passed explicitly through `Trainer._train_loop` instead of living in attributes:
where the loop stands in the data (`LoopPosition`, written into every checkpoint) and what it sums between two
logs (`RunningLog`, saved with every checkpoint so that a resumed run logs what the uninterrupted one logged)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from typing import Any

import torch

from . import diagnostics
from .data import count_input_tokens
from .log import logger


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

    def halve(self) -> None:
        self.micro_batch //= 2
        self.accumulation *= 2
        self.batches *= 2


class RunningLog:
    """What the loop sums between two logs, kept on the device so that a step needs no host sync: the window
    losses, input tokens and samples, the last gradient norm and learning rate, and non-finite step counts.
    The run-long totals (train_loss's numerator, tokens seen) are here too. `pending()` is saved with each
    checkpoint and `restore()` brings it back; the timing fields are never saved (a resumed run times itself).
    """

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), device=device)
        self.steps, self.grad_norm, self.learning_rate = 0, None, None
        self.total_loss = 0.0  # every logged loss of the run, over every process: train_loss's numerator
        self.tokens = torch.zeros(2, dtype=torch.long, device=device)  # non-padding tokens, all tokens
        self.samples_seen, self.samples_at_log, self.tokens_seen = 0, 0, 0
        self.nonfinite_run, self.nonfinite_total = 0, 0
        self.data_clock, self.warned_data_wait, self.flops_shape = diagnostics.Stopwatch(), False, None
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing a logging window; time spent evaluating and saving is `excluded` from it."""
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
        non_padding = count_input_tokens(batch)
        ids = batch.get("input_ids")
        self.tokens += torch.stack([torch.as_tensor(non_padding, device=self.tokens.device),
                                    torch.as_tensor(ids.numel() if ids is not None else non_padding,
                                                    device=self.tokens.device)])
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        self.samples_seen += first.shape[0] * num_processes if first is not None else 0

    def fold_tokens(self, accelerator, state, counting: str) -> tuple[int, int]:
        """Input tokens since the last call (non-padding, all), summed over every process and added to the
        run's count, and to state.num_input_tokens_seen as include_num_input_tokens_seen (`counting`) asks. A
        host sync, so done when logging and once at the end rather than per step."""
        counts = self.tokens.clone()
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts, reduction="sum")
        tokens, all_tokens = (int(c) for c in counts.tolist())
        self.tokens.zero_()
        self.tokens_seen += tokens
        state.num_input_tokens_seen += tokens if counting == "non_padding" else all_tokens if counting == "all" else 0
        return tokens, all_tokens

    def window_logs(self, args, accelerator, model, state, learning_rate: float) -> tuple[dict[str, float], dict]:
        """The log of the window since the last one (a host sync), as (logs, diagnostics). `logs` has
        transformers' keys: the mean loss over its applied steps, the last gradient norm and learning rate
        (`learning_rate` if no step has recorded one), and the non-finite steps skipped so far if any.
        `diagnostics` holds stoker's wall-clock figures (throughput, where the time went), which differ between
        two identical runs and so stay out of log_history (metrics.jsonl has them). The sums restart, the
        clock with `restart_clock`."""
        steps = self.steps
        logged = self.reduce_loss(accelerator, args.average_tokens_across_devices) if steps else 0.0
        self.total_loss += logged
        tokens, all_tokens = self.fold_tokens(accelerator, state, args.include_num_input_tokens_seen)
        elapsed, samples = self.elapsed(), self.take_samples()
        logs = {"loss": round(logged / steps, 6)} if steps else {}
        if self.grad_norm is not None:
            logs["grad_norm"] = float(self.grad_norm)
        if self.nonfinite_total:
            logs["nonfinite_steps_skipped"] = self.nonfinite_total
        logs["learning_rate"] = self.learning_rate if self.learning_rate is not None else learning_rate
        extra = {"tokens_per_second": round(tokens / elapsed, 2), "samples_per_second": round(samples / elapsed, 3),
                 **self.diagnostics(args, accelerator, model, tokens, all_tokens, samples, elapsed)}
        return logs, extra

    def reduce_loss(self, accelerator, averaged_across_devices: bool) -> float:
        """Sum of the window losses since the last log (over every process), then reset. A host sync."""
        total = self.loss.clone()
        if accelerator.num_processes > 1:
            total = accelerator.reduce(total, reduction="sum")
            if not averaged_across_devices:  # each process's loss is a mean of its own
                total /= accelerator.num_processes
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
        wait = min(self.data_clock.take() / elapsed, 1.0)
        out = {"data_wait_fraction": round(wait, 4)}
        if wait > diagnostics.DATA_WAIT_WARNING and not self.warned_data_wait:
            self.warned_data_wait = True
            logger.warning(diagnostics.data_wait_advice(wait, args, on_gpu))
        if not on_gpu:
            return out
        out["peak_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(accelerator.device) / 2**30, 3)
        peak = args.peak_tflops or diagnostics.peak_tflops(torch.cuda.get_device_name(accelerator.device),
                                                           diagnostics.matmul_precision(args.mixed_precision))
        if peak and samples:
            if self.flops_shape is None:  # parameter counts: computed once per run
                self.flops_shape = diagnostics.model_flops_shape(accelerator.unwrap_model(model))
            per_token = diagnostics.flops_per_token(*self.flops_shape, seq_len=round(all_tokens / samples))
            out["mfu"] = round(diagnostics.mfu(tokens / elapsed, per_token, peak, accelerator.num_processes), 4)
        return out

    def pending(self) -> dict[str, Any]:
        """What a checkpoint keeps of the log in progress."""
        return {"loss": self.loss, "steps": self.steps, "tokens": self.tokens, "total_loss": self.total_loss,
                "samples": self.samples_seen - self.samples_at_log, "nonfinite_total": self.nonfinite_total,
                "nonfinite_run": self.nonfinite_run}

    def restore(self, pending: dict[str, Any]) -> None:
        """Continue the log in progress that `pending()` returned when the checkpoint was written."""
        device = self.loss.device
        self.loss, self.tokens = pending["loss"].to(device), pending["tokens"].to(device)
        self.steps, self.samples_seen = pending["steps"], pending["samples"]
        self.total_loss = pending.get("total_loss", 0.0)
        self.nonfinite_total, self.nonfinite_run = pending["nonfinite_total"], pending["nonfinite_run"]


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
