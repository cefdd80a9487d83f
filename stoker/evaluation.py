"""The pieces of evaluation that are not override points: which rows of a batch are real samples, what a model's
outputs hold as predictions and labels, and the collection of predictions from every process into the arrays
that compute_metrics receives, as transformers.Trainer builds them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from accelerate.utils.memory import should_reduce_batch_size

from .data import host_counts, keep_host_counts
from .outputs import EvalPrediction


@contextlib.contextmanager
def evaluating(model) -> Iterator[None]:
    """The model in eval mode (dropout off) without gradients; a model that was training trains again after."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


class OutOfMemoryInEvaluation(RuntimeError):
    """A process ran out of memory in an evaluation batch's forwards, and every process knows it: all of them halve
    the evaluation batch and start over together."""


@contextlib.contextmanager
def agreeing_on_out_of_memory(accelerator, enabled: bool) -> Iterator[None]:
    """Around one evaluation batch's forwards: with `enabled` (auto_find_batch_size on several processes, where
    the forward holds no collective), each process tells the others after them whether it ran out of memory, and if
    any did, every one raises OutOfMemoryInEvaluation. Halving alone would leave that process starting over while
    the others wait in the batch's gather (a hang). The cost, there only: a one-number all-reduce and a host sync
    per evaluation batch. Any other error is raised as it is."""
    if not enabled:
        yield
        return
    error = None
    try:
        yield
    except Exception as e:
        if not should_reduce_batch_size(e):
            raise
        error = e
    flag = torch.tensor(float(error is not None), device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() > 0:
        where = "this process" if error is not None else "another process"
        raise OutOfMemoryInEvaluation(f"out of memory in an evaluation batch on {where} (process "
                                      f"{accelerator.process_index} of {accelerator.num_processes})") from error


def split_batch(batch: dict, rows: int) -> list[dict]:
    """Cut a micro-batch into pieces of `rows` rows: the batches a loader with that batch size yields, since a
    sampler's index order nests (batch i of 2n rows = batches 2i and 2i+1 of n rows)."""
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    n = first.shape[0]

    def part(value, start: int):
        if not isinstance(value, torch.Tensor) or value.shape[:1] != first.shape[:1]:
            return value
        piece, counted = value[start:start + rows], host_counts(value)
        if counted is not None:  # what the host counted of the batch's rows, for the piece's rows
            keep_host_counts(piece, counted.rows(start, min(start + rows, n)))
        return piece

    return [{k: part(v, i) for k, v in batch.items()} for i in range(0, n, rows)]


def evaluation_readers(accelerator) -> int:
    """The processes that read different evaluation rows: every one but the ranks of a tensor- or context-parallel
    group, which read the same (ranks_per_count; a sequence-parallel rank evaluates whole rows of its own)."""
    return accelerator.num_processes // accelerator.ranks_per_count


def genuine_rows(batch: dict, accelerator) -> tuple[int | None, bool]:
    """How many rows of this process's evaluation batch are real samples (None if all of them are), and whether
    some process's batch holds real rows and fillers both (all then score their real rows once more together).

    With several data-parallel readers Accelerate fills every reader's last batch up to the same size with samples
    from the start of the dataset (even_batches), and gather_for_metrics cuts those from the gathered predictions:
    the first `remainder` gathered rows, in reader order, are real. The loss makes the same cut, so that every
    sample counts exactly once and eval_loss equals the single-process value. The ranks of a tensor-parallel group
    are one reader (they read the same rows); those of a sequence-parallel group evaluate whole rows of their own,
    each a reader."""
    state = accelerator.gradient_state
    if evaluation_readers(accelerator) == 1 or not state.end_of_dataloader or state.remainder <= 0:
        return None, False
    rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    reader = accelerator.process_index // accelerator.ranks_per_count
    genuine = min(max(state.remainder - reader * rows, 0), rows)
    return (None if genuine == rows else genuine), state.remainder % rows != 0


def gather_once_per_batch(accelerator, tensor: torch.Tensor, use_gather_object: bool):
    """Accelerate's gather_for_metrics of `tensor` from every process, where the ranks of a tensor-parallel group
    hold the same rows (ranks_per_count > 1): each group's rows are kept once (from its first rank), then the fill of
    the last batch is cut as gather_for_metrics cuts it."""
    acc, k = accelerator, accelerator.ranks_per_count
    if k == 1:
        return acc.gather_for_metrics(tensor, use_gather_object=use_gather_object)
    if use_gather_object:
        from accelerate.utils import gather_object

        data = torch.cat(gather_object([tensor])[::k])
    else:
        data = acc.gather(tensor)
        data = data.view(acc.num_processes, -1, *data.shape[1:])[::k].flatten(0, 1)
    state = acc.gradient_state
    return data[:state.remainder] if state.end_of_dataloader and state.remainder > 0 else data


def labels_of(batch: dict, label_names: list[str]):
    """The batch's labels as transformers.Trainer collects them: one tensor, or a tuple with one per entry of
    label_names; None unless every one of them is present."""
    found = tuple(batch.get(name) for name in label_names)
    if any(t is None for t in found):
        return None
    return found[0] if len(found) == 1 else found


def predictions_of(outputs, has_loss: bool, ignore: set[str]):
    """The predictions in a model's outputs, as transformers.Trainer takes them: every entry of a dict /
    ModelOutput but the loss and the `ignore`d keys, or a tuple after its loss; one entry is returned as itself,
    several as a tuple; None if there are none."""
    if isinstance(outputs, torch.Tensor):
        return None if has_loss else outputs  # a bare loss, or bare logits
    if isinstance(outputs, Mapping):
        found = tuple(v for k, v in outputs.items() if k not in ignore and k != "loss")
    else:
        found = tuple(outputs[1:] if has_loss else outputs)
    found = tuple(v for v in found if _is_nested_tensors(v))  # a KV cache object is no prediction
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def logits_of(outputs) -> torch.Tensor:
    """The logits of a model called without labels: a dict / ModelOutput's, or a tuple's first entry."""
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def eval_prediction(values: dict, include_for_metrics: list[str]) -> EvalPrediction:
    """An EvalPrediction with the inputs and losses that include_for_metrics asks for."""
    return EvalPrediction(predictions=values.get("predictions"), label_ids=values.get("label_ids"),
                          inputs=values.get("inputs") if "inputs" in include_for_metrics else None,
                          losses=values.get("losses") if "loss" in include_for_metrics else None)


class Collected:
    """Predictions, labels, inputs and per-row losses of an evaluation, gathered from every process (padded to a
    common sequence length first) and moved to the CPU every `accumulation_steps` batches (at the end without),
    then joined into arrays (or one array per batch without `concat`)."""

    KEYS = ("predictions", "label_ids", "inputs", "losses")

    def __init__(self, accelerator, accumulation_steps: int | None, use_gather_object: bool, concat: bool):
        self.accelerator, self.accumulation_steps = accelerator, accumulation_steps
        self.use_gather_object, self.concat = use_gather_object, concat
        self.kept = {k: [] for k in self.KEYS}
        self.pending = {k: [] for k in self.KEYS}

    def gather(self, values: dict, batch_number: int, keep: bool = True) -> dict:
        """This batch's values gathered from every process; kept for the end unless `keep` is False."""
        acc = self.accelerator

        def gather(t):  # sequence lengths differ between processes: pad to a common length first
            return gather_once_per_batch(acc, acc.pad_across_processes(t, dim=1, pad_index=-100),
                                         self.use_gather_object)

        step = {k: _nested(gather, v) for k, v in values.items() if v is not None}
        if keep:
            for k, v in step.items():
                self.pending[k].append(v)
            if self.accumulation_steps and batch_number % self.accumulation_steps == 0:
                self._to_cpu()
        return step

    def _to_cpu(self) -> None:
        for k in self.KEYS:
            self.kept[k] += [_nested(torch.Tensor.cpu, t) for t in self.pending[k]]
            self.pending[k] = []

    def joined(self) -> dict:
        """Everything kept, as numpy arrays (None for what was never given)."""
        self._to_cpu()
        return {k: _concat_padded(v) if self.concat else [_concat_padded([t]) for t in v] or None
                for k, v in self.kept.items()}


def _is_nested_tensors(value) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(_is_nested_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


def _nested(fn, value):
    """fn applied to every tensor of a tensor or a (nested) tuple of them."""
    if isinstance(value, (tuple, list)):
        return type(value)(_nested(fn, v) for v in value)
    return fn(value)


def _concat_padded(tensors: list, pad: int = -100):
    """Concatenate batches along dim 0, padding later dims to the largest (sequence lengths vary); batches of
    (nested) tuples give a tuple of arrays, as transformers' nested_concat does."""
    if not tensors:
        return None
    if isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(_concat_padded([t[i] for t in tensors], pad) for i in range(len(tensors[0])))
    if tensors[0].dim() == 0:
        return torch.stack(tensors).numpy()
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = torch.full((sum(t.shape[0] for t in tensors), *shape), pad, dtype=tensors[0].dtype)
    row = 0
    for t in tensors:
        out[(slice(row, row + t.shape[0]), *(slice(0, n) for n in t.shape[1:]))] = t
        row += t.shape[0]
    if out.dtype == torch.bfloat16:
        out = out.float()
    return out.numpy()
