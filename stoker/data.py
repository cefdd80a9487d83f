"""Batches: the padding collator, column filtering, samplers, the dataloaders the Trainer builds, and the per-row
counts of a training batch taken on the host before it is copied to the device (`RowCounts`).

The default collator is written here rather than taken from transformers because transformers' padding
collators need a tokenizer and do not pad `labels` (DataCollatorWithPadding) or insist on seq2seq
conventions (DataCollatorForSeq2Seq); a Trainer must batch variable-length rows of any model without one.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import weakref
from collections.abc import Mapping
from functools import partial

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

IGNORE_INDEX = -100
_PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0}


# what a column may hold to be batched as a tensor
_BATCHABLE = (np.ndarray, np.generic, int, float, bool, list, tuple)


def _unbatchable(key: str, value):
    raise TypeError(f"collator: column {key!r} holds {type(value).__name__} values, which cannot be batched "
                    "as tensors; remove the column or pass a data_collator")


class PaddingCollator:
    """Stacks rows into a batch, padding 1-D sequences to the longest row (input_ids with pad_token_id,
    attention_mask with 0, labels with -100). Rows without attention_mask get one when padding is needed, and
    with `always_mask` (a transformers model) always: given no mask, transformers reads its position ids on the
    host on every forward to detect packed rows (masking_utils.find_packed_sequence_indices), a GPU sync; an
    all-ones mask skips that check and means the same. Packed rows (with position_ids) never get one."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None, always_mask: bool = False):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.always_mask = always_mask

    def __call__(self, features: list[Mapping]) -> dict[str, torch.Tensor]:
        if not isinstance(features[0], Mapping):
            raise TypeError(f"collator: rows must be dicts of columns, got {type(features[0]).__name__}")
        if not LABEL_COLUMNS.isdisjoint(features[0]):
            features = [rename_label_columns(f) for f in features]
        batch = {}
        for key in features[0]:
            values = [v if isinstance(v := f[key], torch.Tensor) else torch.as_tensor(v) if isinstance(v, _BATCHABLE)
                      else _unbatchable(key, v) for f in features]
            if values[0].dim() == 1 and len({v.shape[0] for v in values}) > 1:
                batch[key] = self._pad(key, values)
            else:
                batch[key] = torch.stack(values)
        # packed rows (stoker.packing) carry position_ids and must stay mask-free: with an attention_mask,
        # transformers stops deriving the block-diagonal mask from position_ids and sequences see each other
        # (their padding gets position 0, a one-token sequence of its own)
        if "input_ids" in batch and "attention_mask" not in batch and "position_ids" not in batch and (
                self.always_mask or any(len(f["input_ids"]) != batch["input_ids"].shape[1] for f in features)):
            batch["attention_mask"] = self._pad("attention_mask", [torch.ones(len(f["input_ids"]), dtype=torch.long)
                                                                   for f in features])
        return batch

    def _pad(self, key: str, values: list[torch.Tensor]) -> torch.Tensor:
        length = max(v.shape[0] for v in values)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fill = self.pad_token_id if key == "input_ids" else _PAD_VALUES.get(key, 0)
        out = torch.full((len(values), length), fill, dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out


# the column names datasets give labels (GLUE-style `label`, older `label_ids`), which transformers' collators
# hand to the model as `labels`
LABEL_COLUMNS = frozenset({"label", "label_ids"})


def rename_label_columns(row: Mapping) -> Mapping:
    """A row with its `label` / `label_ids` column named `labels`, as transformers' collators do."""
    found = [k for k in ("label", "label_ids") if k in row]
    if not found or "labels" in row:
        return row
    return {("labels" if k == found[0] else k): v for k, v in row.items()}


class ColumnFilter:
    """Wraps a collator so that it only sees the columns the model accepts (remove_unused_columns)."""

    def __init__(self, collator, keep: set[str]):
        self.collator = collator
        self.keep = keep

    def __call__(self, features):
        # `label` and `label_ids` are kept for the collator to rename, as transformers.Trainer keeps them
        return self.collator([{k: v for k, v in f.items() if k in self.keep or k in LABEL_COLUMNS} for f in features])


# --- what the host counts of a training batch before it is copied to the device ------------------------------

@dataclasses.dataclass(frozen=True)
class RowCounts:
    """Counts of one [rows, positions] tensor of a collated batch, one per row, taken on the host before the batch
    is copied to the device: what the chunked loss (its target count, a shape), the shared prefix (its length,
    a slice) and sdpa's choice of its causal kernel (no padding: stoker.sdpa_mask) need on the host, and would
    otherwise read back from the device (a host sync each micro-batch, which
    on a GPU waits for the queue to drain). None where a count does not apply to the tensor."""

    width: int  # positions per row
    targets: tuple[int, ...] | None = None  # labels: target tokens after the causal shift (labels[:, 1:] != -100)
    untargeted: tuple[int, ...] | None = None  # labels: leading positions t whose label t + 1 is no target
    attended: tuple[int, ...] | None = None  # attention mask: leading positions attended to
    same_as_next: tuple[int, ...] | None = None  # input ids: leading ids equal to the next row's (last row: width)

    def rows(self, start: int, stop: int) -> RowCounts:
        """The counts of rows [start, stop) as a batch of their own (a micro-batch split by out-of-memory
        halving)."""
        def cut(counts):
            return None if counts is None else counts[start:stop]
        same = self.same_as_next
        if same is not None:  # the part's last row has no next row in the part
            same = same[start:stop - 1] + (self.width,) if stop > start else ()
        return RowCounts(self.width, cut(self.targets), cut(self.untargeted), cut(self.attended), same)


def _row_counts(name: str, tensor, label_name: str | None) -> RowCounts | None:
    """The counts of a batch's tensor named `name`, from its host copy; None for any other tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.device.type != "cpu":
        return None
    width = tensor.shape[1]
    if name == label_name and not tensor.is_floating_point():
        targets = tensor[:, 1:] != IGNORE_INDEX
        return RowCounts(width, targets=tuple(targets.sum(1).tolist()),
                         untargeted=tuple((~targets).int().cumprod(1).sum(1).tolist()))
    if name == "attention_mask":
        return RowCounts(width, attended=tuple((tensor != 0).int().cumprod(1).sum(1).tolist()))
    if name == "input_ids":
        return RowCounts(width, same_as_next=(*(tensor[:-1] == tensor[1:]).int().cumprod(1).sum(1).tolist(), width))
    return None


# device tensor's id -> (a weak reference to it, its version when counted, its counts): the entry goes with the
# tensor, and an in-place write to it (a compute_loss override masking labels) bumps the version, so its counts
# are no longer handed out
_COUNTED: dict[int, tuple[weakref.ref, int, RowCounts]] = {}


def keep_host_counts(tensor: torch.Tensor, counts: RowCounts) -> None:
    """Record `counts` as what the host knows of `tensor` as it is now."""
    key = id(tensor)

    def forget(ref, key=key, counted=_COUNTED):
        if counted.get(key, (None,))[0] is ref:
            del counted[key]

    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor keeps no version, so a change could not be seen
        return
    _COUNTED[key] = (weakref.ref(tensor, forget), version, counts)


def host_counts(tensor) -> RowCounts | None:
    """The counts taken on the host of exactly this tensor, unless it has been written to since; None for any
    other tensor (a slice of it, a tensor a compute_loss override made): its reader then reads the device."""
    entry = _COUNTED.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
    if entry is None or entry[0]() is not tensor:
        return None
    try:
        return entry[2] if tensor._version == entry[1] else None
    except RuntimeError:
        return None


def host_target_count(labels) -> int | None:
    """Target tokens of `labels` after the causal shift, known on the host (None: not counted there)."""
    counts = host_counts(labels)
    return sum(counts.targets) if counts is not None and counts.targets is not None else None


class CountedBatch(dict):
    """A collated training batch that counts its rows on the host as Accelerate copies it to the device (which
    calls its `to`, as it calls a BatchEncoding's): the device tensors made from it then carry their RowCounts
    (`host_counts`). A batch that is rebuilt on the way (dispatch_batches broadcasts and slices it) is a new mapping
    of new tensors, without counts, whose readers fall back on reading the device."""

    label_name: str | None = None  # the batch's labels column (the Trainer's first label name)

    def to(self, device, non_blocking: bool = False) -> CountedBatch:
        moved = CountedBatch({k: send_to_device(v, device, non_blocking=non_blocking) for k, v in self.items()})
        moved.label_name = self.label_name
        for name, host in self.items():
            counts = _row_counts(name, host, self.label_name)
            if counts is not None and isinstance(moved[name], torch.Tensor):
                keep_host_counts(moved[name], counts)
        return moved


class HostCounting:
    """Wraps a training collator so that its batches are CountedBatch, whose counts per micro-batch the chunked loss,
    the shared prefix and sdpa's choice of kernel (stoker.sdpa_mask) would otherwise read from the device. A
    collator that returns no mapping is left as it is."""

    def __init__(self, collator, label_name: str):
        self.collator, self.label_name = collator, label_name

    def __call__(self, features):
        batch = self.collator(features)
        if not isinstance(batch, Mapping):
            return batch
        counted = CountedBatch(batch)
        counted.label_name = self.label_name
        return counted


def forward_columns(model: torch.nn.Module) -> set[str]:
    """Named arguments of model.forward. transformers models also take **kwargs (attention options), which
    never stand for dataset columns, so they are ignored as transformers.Trainer does."""
    params = inspect.signature(model.forward).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


class LengthGroupedSampler(torch.utils.data.Sampler):
    """transformers' length-grouped order (mega-batches sorted by length), reseeded per epoch so the order of
    every epoch is a pure function of (data_seed, epoch), which exact resume relies on."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def _lengths(dataset, column: str) -> list[int]:
    if hasattr(dataset, "column_names") and column in dataset.column_names:
        return list(dataset[column])
    return [len(row["input_ids"]) for row in dataset]


def pins_memory(args) -> bool:
    """Whether the loaders pin their batches: dataloader_pin_memory, on a GPU (the CPU has nothing to pin for)."""
    return args.dataloader_pin_memory and torch.cuda.is_available() and not args.use_cpu


def seed_worker(worker_id: int, num_workers: int, rank: int) -> None:
    """transformers' worker seed (trainer_utils.seed_worker): a training loader's worker seeds `random`, numpy and
    torch with torch's own worker seed (the loader's base seed + worker id) plus num_workers x rank, so that a
    collator or dataset that draws random numbers (MLM masking, augmentation) draws differently on every process.
    The base seed comes from the loader's generator, reseeded with data_seed + epoch, so the seeds stay a pure
    function of (data_seed, epoch, rank, worker): resumable. Written here, not imported, so that a worker started
    by spawn or forkserver needs no transformers import to unpickle it."""
    seed = num_workers * rank + torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # and every device generator, as transformers.set_seed does


def unseeded_shuffle_problem(args, dataset) -> str | None:
    """accelerator_config's use_seedable_sampler=False, for a shuffled training set: transformers then draws the
    order from the global generator, whose state when an epoch starts a resumed run cannot restore; and Accelerate
    would leave this sampler's generator, seeded once, running on across epochs (a resumed epoch in another
    order). Refused rather than honoured: exact resume is the promise."""
    shuffled = not (isinstance(dataset, torch.utils.data.IterableDataset) or args.group_by_length
                    or args.train_sampling_strategy == "sequential")
    if not shuffled or getattr(args.accelerator_config, "use_seedable_sampler", True):
        return None
    return ("accelerator_config.use_seedable_sampler=False: stoker draws the training shuffle from data_seed and the "
            "epoch (Accelerate's seedable sampler), so that a resumed run reads the order of the run it continues; an "
            "order drawn from the global generator could not be read again; accepted: True (the default), or "
            "train_sampling_strategy='sequential' for no shuffle")


def build_dataloader(dataset, args, batch_size: int, collator, train: bool) -> DataLoader:
    """A DataLoader honouring every dataloader_* field. Training data is shuffled by a RandomSampler that
    Accelerate replaces with its seedable sampler (order = f(data_seed, epoch)) when it prepares the loader.
    An IterableDataset takes no sampler: it yields its rows in its own order."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        sampler = None
    elif not train or args.train_sampling_strategy == "sequential":
        sampler = SequentialSampler(dataset)
    elif args.group_by_length:
        sampler = LengthGroupedSampler(_lengths(dataset, args.length_column_name), batch_size, args.data_seed)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.data_seed))
    workers = args.dataloader_num_workers
    extra = {"in_order": args.dataloader_in_order} if workers > 0 else {}  # torch >= 2.6
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=workers,
        pin_memory=pins_memory(args),
        persistent_workers=args.dataloader_persistent_workers and workers > 0,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        drop_last=args.dataloader_drop_last,  # evaluation too, as transformers.Trainer applies it
        # iterator creation draws worker seeds from this generator instead of the global RNG, which
        # would otherwise shift dropout masks after a resume (reseeded per epoch by the Trainer)
        generator=torch.Generator().manual_seed(args.data_seed) if train else None,
        multiprocessing_context=args.dataloader_multiprocessing_context if workers > 0 else None,
        # evaluation workers keep torch's seeds (base + worker id), as transformers leaves them
        worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index) if train and workers
        else None,
        **extra,
    )
